"""Config documents for the operator's unit tests."""

from __future__ import annotations

from typing import Any

import pytest

from testkit import edge_document, provider


def operator_document() -> dict[str, Any]:
    """Two nodes with two providers each, one model on all of them; admin off loopback."""
    nodes = {
        f"node-{n}": [
            provider(f"p{chr(96 + 2 * n - 1)}", served=f"served-{n}", capacity=4),
            provider(f"p{chr(96 + 2 * n)}", served=f"served-{n}", capacity=4),
        ]
        for n in (1, 2)
    }
    return edge_document(
        nodes,
        {"m": ["pa", "pc"]},
        edge_id="edge-op",
        listeners=False,
        clients=(),
        edge={"admin": {"listen": "0.0.0.0:9090", "token_file": "/etc/iop/admin/token"}},
    )


@pytest.fixture(name="document")
def document_fixture() -> dict[str, Any]:
    return operator_document()
