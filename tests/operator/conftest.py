"""Config documents for the operator's unit tests."""

from __future__ import annotations

from typing import Any

import pytest

from iop.edgeconfig import token_sha256


def operator_document() -> dict[str, Any]:
    """Two nodes with two providers each, one model on all of them; admin off loopback."""

    def provider(pid: str, node: int) -> dict[str, Any]:
        return {
            "id": pid,
            "adapter": {"type": "fake"},
            "served_models": [f"served-{node}"],
            "capacity": 4,
        }

    return {
        "edge": {
            "id": "edge-op",
            "admin": {"listen": "0.0.0.0:9090", "token_file": "/etc/iop/admin/token"},
        },
        "models": [{"id": "m", "providers": {"pa": "served-1", "pc": "served-2"}}],
        "nodes": [
            {
                "id": f"node-{n}",
                "token_hash_sha256": token_sha256(f"node-{n}"),
                "providers": [
                    provider(f"p{chr(96 + 2 * n - 1)}", n),
                    provider(f"p{chr(96 + 2 * n)}", n),
                ],
            }
            for n in (1, 2)
        ],
    }


@pytest.fixture(name="document")
def document_fixture() -> dict[str, Any]:
    return operator_document()
