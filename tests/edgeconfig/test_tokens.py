"""Tokens named by a Kubernetes Secret: accepted in an EdgeConfig, resolved into hashes for the
Edge, and refused by the Edge while unresolved."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest

from iop.edgeconfig import (
    ConfigError,
    config_hash,
    load_data,
    require_token_hashes,
    token_refs,
    with_token_hashes,
)

from .conftest import make_config


def _secret_tokens(data: dict[str, Any]) -> None:
    """node-1 and principal token app-2 by Secret; the admin token from a Secret too."""
    del data["nodes"][0]["token_hash_sha256"]
    data["nodes"][0]["token_secret"] = {"name": "iop-node-node-1", "generate": True}
    del data["openai"]["principal_tokens"][1]["token_hash_sha256"]
    data["openai"]["principal_tokens"][1]["token_secret"] = {"name": "iop-api-keys", "key": "app-2"}
    data["edge"]["admin"] = {
        "listen": "0.0.0.0:9090",
        "token_file": "/etc/iop/admin/token",
        "token_secret": {"name": "iop-edge-admin", "generate": True},
    }


def problems_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_data(data)
    return [str(p) for p in info.value.problems]


def test_a_token_may_be_named_by_its_secret() -> None:
    config = load_data(make_config(_secret_tokens))

    refs = {(ref.owner, ref.owner_id): (ref.path, ref.key) for ref in token_refs(config)}

    assert refs == {
        ("admin", "admin"): ("edge.admin.token_secret", ("iop-edge-admin", "token")),
        ("principal", "app-2"): (
            "openai.principal_tokens[1].token_secret",
            ("iop-api-keys", "app-2"),
        ),
        ("node", "node-1"): ("nodes[0].token_secret", ("iop-node-node-1", "token")),
    }


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        pytest.param(
            lambda d: d["nodes"][0].pop("token_hash_sha256"),
            "nodes[0]: a node needs exactly one of token_hash_sha256",
            id="node-neither",
        ),
        pytest.param(
            lambda d: d["nodes"][0].update(token_secret={"name": "s"}),
            "nodes[0]: a node needs exactly one of token_hash_sha256",
            id="node-both",
        ),
        pytest.param(
            lambda d: d["openai"]["principal_tokens"][0].pop("token_hash_sha256"),
            "openai.principal_tokens[0]: a principal token needs exactly one of",
            id="principal-neither",
        ),
        pytest.param(
            lambda d: d["nodes"][0].update(
                token_secret={"name": "Bad_Name"}, token_hash_sha256=None
            ),
            "nodes[0].token_secret.name: must be a Kubernetes object name",
            id="secret-name",
        ),
    ],
)
def test_each_token_has_exactly_one_source(mutate: Any, expected: str) -> None:
    problems = problems_of(make_config(mutate))

    assert any(problem.startswith(expected) for problem in problems), problems


def test_resolved_config_carries_the_hashes_and_names_no_secret() -> None:
    config = load_data(make_config(_secret_tokens))
    node_hash = hashlib.sha256(b"node-1-token").hexdigest()
    app_hash = hashlib.sha256(b"app-2-token").hexdigest()

    resolved = with_token_hashes(
        config, {("iop-node-node-1", "token"): node_hash, ("iop-api-keys", "app-2"): app_hash}
    )

    assert resolved.nodes[0].token_hash_sha256 == node_hash
    assert resolved.openai.principal_tokens[1].token_hash_sha256 == app_hash
    assert token_refs(resolved) == []
    rendered = orjson.dumps(resolved.model_dump(mode="json", exclude_unset=True)).decode()
    assert "token_secret" not in rendered and node_hash in rendered
    # The same config written with its hashes has the same hash: what the Edge reports.
    by_hash = load_data(
        make_config(
            lambda d: (
                d["nodes"][0].update(token_hash_sha256=node_hash),
                d["openai"]["principal_tokens"][1].update(token_hash_sha256=app_hash),
                d["edge"].update(
                    admin={"listen": "0.0.0.0:9090", "token_file": "/etc/iop/admin/token"}
                ),
            )
        )
    )
    assert config_hash(resolved) == config_hash(by_hash)
    require_token_hashes(resolved)


def test_the_edge_refuses_a_config_that_still_names_a_secret() -> None:
    config = load_data(make_config(_secret_tokens))

    with pytest.raises(ConfigError) as info:
        require_token_hashes(config)

    assert [p.path for p in info.value.problems] == [
        "openai.principal_tokens[1].token_secret",
        "nodes[0].token_secret",
    ]
    assert "only the operator reads" in str(info.value.problems[0])
