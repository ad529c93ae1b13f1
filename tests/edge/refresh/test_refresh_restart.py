"""Every restart-required class of change is refused on apply, named with its path and scope, and
changes nothing: the config in use, its hash and generation, dispatch and the Node stay as they
were. A dry run reports the same paths with a 200."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from iop.edgeconfig import token_sha256

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

Document = dict[str, Any]


def pa(document: Document) -> dict[str, Any]:
    return document["nodes"][0]["providers"][0]  # type: ignore[no-any-return]


def add_node(document: Document) -> None:
    document["nodes"].append({"id": "node-3", "token_hash_sha256": token_sha256("three")})


def remove_node(document: Document) -> None:
    document["nodes"].pop()  # node-2: no model maps its provider


def add_provider(document: Document) -> None:
    document["nodes"][0]["providers"].append(
        {"id": "pd", "adapter": {"type": "fake"}, "served_models": ["served-d"]}
    )


def add_principal_token(document: Document) -> None:
    document["openai"]["principal_tokens"].append(
        {
            "token_ref": "other-app",
            "token_hash_sha256": token_sha256("other"),
            "principal_ref": "team-other",
        }
    )


CASES = [
    pytest.param(
        lambda d: d["openai"].update(listen="127.0.0.1:1"),
        "openai.listen",
        "edge",
        id="openai-listener",
    ),
    pytest.param(
        lambda d: d["edge"].update(listen="127.0.0.1:2"), "edge.listen", "edge", id="node-listener"
    ),
    pytest.param(
        lambda d: d["edge"]["admin"].update(listen="127.0.0.1:3"),
        "edge.admin.listen",
        "edge",
        id="admin-listener",
    ),
    pytest.param(
        lambda d: d.update(a2a={"listen": "127.0.0.1:4"}), "a2a.listen", "edge", id="a2a-listener"
    ),
    pytest.param(lambda d: d["edge"].update(id="edge-other"), "edge.id", "edge", id="edge-id"),
    pytest.param(
        lambda d: d["edge"].update(bootstrap={"artifact_path": "/srv/iop/bootstrap"}),
        "edge.bootstrap.artifact_path",
        "edge",
        id="bootstrap-path",
    ),
    pytest.param(
        lambda d: d.update(control_plane={"url": "https://control.example"}),
        "control_plane.url",
        "edge",
        id="control-plane",
    ),
    pytest.param(add_node, "nodes[node-3]", "edge", id="node-added"),
    pytest.param(remove_node, "nodes[node-2]", "edge", id="node-removed"),
    pytest.param(
        lambda d: d["nodes"][0].update(token_hash_sha256=token_sha256("new")),
        "nodes[node-1].token_hash_sha256",
        "edge",
        id="node-token",
    ),
    pytest.param(
        lambda d: d["nodes"][0].update(alias="gpu-a"),
        "nodes[node-1].alias",
        "edge",
        id="node-alias",
    ),
    pytest.param(
        lambda d: pa(d)["adapter"].update(completion_tokens=9),
        "nodes[node-1].providers[pa].adapter.completion_tokens",
        "node:node-1",
        id="adapter-settings",
    ),
    pytest.param(
        lambda d: pa(d).update(adapter={"type": "openai", "base_url": "http://127.0.0.1:9/v1"}),
        "nodes[node-1].providers[pa].adapter",
        "node:node-1",
        id="adapter-type",
    ),
    pytest.param(add_provider, "nodes[node-1].providers[pd]", "node:node-1", id="provider-added"),
    pytest.param(
        add_principal_token,
        "openai.principal_tokens[other-app]",
        "edge",
        id="principal-token-added",
    ),
    pytest.param(
        lambda d: d["openai"]["principal_tokens"][0].update(principal_ref="team-other"),
        "openai.principal_tokens[search-chat].principal_ref",
        "edge",
        id="principal-token-remapped",
    ),
]


@pytest.mark.parametrize(("change", "path", "scope"), CASES)
async def test_a_restart_required_change_is_refused_and_changes_nothing(
    refresh_stack, refresh_document, change: Callable[[Document], None], path: str, scope: str
) -> None:
    stack = await refresh_stack()
    before = await stack.current()
    registry = stack.node.runner.registry
    (connection,) = stack.node.connections.values()
    candidate = refresh_document()
    change(candidate)
    # A live change rides along: it must not apply either.
    pa(candidate)["priority"] = 20

    dry = await stack.refresh(candidate, "dry_run")
    assert dry["outcome"] == "restart_required"
    assert {"path": path, "scope": scope} in dry["restart_required_paths"]
    assert scope in dry["restart_scopes"]
    assert dry["live_paths"] == ["nodes[node-1].providers[pa].priority"]
    assert dry["applied"] is False

    refused = await stack.refresh(candidate, status=409)
    assert refused["outcome"] == "restart_required"
    assert refused["applied"] is False
    assert {"path": path, "scope": scope} in refused["restart_required_paths"]
    assert path in refused["message"]
    assert refused["pushes"] == []
    assert refused["generation"] == refused["previous_generation"] == before["generation"]
    assert refused["previous_config_hash"] == before["config_hash"] != refused["config_hash"]

    after = await stack.current()
    assert (after["config_hash"], after["generation"]) == (
        before["config_hash"],
        before["generation"],
    )
    assert after["config"] == before["config"]
    assert stack.served(await stack.chat()) == "served-a"  # the priority change did not apply
    assert stack.node.runner.registry is registry
    assert connection.refreshes == 0
    last = (await stack.admin.get("/refresh/last", params={"mode": "apply"})).json()
    assert last["outcome"] == "restart_required" and last["mode"] == "apply"
