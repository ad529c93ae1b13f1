"""`iop edge run --wait-for-nodes SECONDS`: a real Edge process answers `/readyz` 503, naming the
nodes it waits for, until every node of its config has dialed in (real `iop node run` processes)
or the wait has run out; once ready it stays ready when a node drops."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from testkit import node_token_of, provider

pytestmark = pytest.mark.timeout(120)

NODES = ("node-a", "node-b")


def write_config(folder: Path, document_of: Any) -> Path:
    """Two nodes that dial in, one fake provider each (`pa` on node-a, `pb` on node-b)."""
    fake = {"type": "fake", "completion_tokens": 4}
    document = document_of(
        nodes={
            "node-a": [provider("pa", fake, served="served-a")],
            "node-b": [provider("pb", fake, served="served-b")],
        },
        models={"m": ["pa", "pb"]},
        edge_id="edge-wait",
    )
    path = folder / "edge.yaml"
    path.write_text(yaml.safe_dump(document))
    for node_id in NODES:
        (folder / f"{node_id}.token").write_text(node_token_of(node_id))
    return path


async def readyz(http: httpx.AsyncClient) -> tuple[int, dict[str, Any]]:
    answer = await http.get("/readyz")
    body: dict[str, Any] = answer.json()
    return answer.status_code, body


async def test_ready_once_every_node_has_connected_and_for_good(
    tmp_path, iop_processes, document_of, until
) -> None:
    config = write_config(tmp_path, document_of)
    async with contextlib.AsyncExitStack() as stack:
        # A bound no test run reaches: here only the nodes make the Edge ready.
        _, started = await iop_processes.edge(stack, config, "--wait-for-nodes", "600")
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=started["url"]))

        status, body = await readyz(http)
        assert status == 503 and body["status"] == "not ready"
        assert body["waiting_for_nodes"] == ["node-a", "node-b"]
        assert body["waiting_for_nodes_count"] == 2
        assert 0 < body["wait_left_s"] <= 600

        await iop_processes.node(stack, started["hub_port"], "node-a", tmp_path / "node-a.token")

        async def only_b_awaited() -> dict[str, Any] | None:
            status, body = await readyz(http)
            assert status == 503, body  # node-b never came: still not ready
            return body if body["waiting_for_nodes"] == ["node-b"] else None

        body = await until(only_b_awaited, timeout=30, interval=0.05, what="node-a connected")
        assert body["providers_available"] == ["pa"]
        assert body["waiting_for_nodes_count"] == 1

        node_b = await iop_processes.node(
            stack, started["hub_port"], "node-b", tmp_path / "node-b.token"
        )

        async def ready() -> dict[str, Any] | None:
            status, body = await readyz(http)
            return body if status == 200 else None

        body = await until(ready, timeout=30, interval=0.05, what="the Edge ready")
        assert body["status"] == "ready"
        assert "waiting_for_nodes" not in body and "wait_left_s" not in body

        # node-b leaves: its provider leaves dispatch, and the Edge stays ready.
        node_b.terminate()
        await node_b.wait()

        async def b_gone() -> dict[str, Any] | None:
            status, body = await readyz(http)
            assert status == 200, body
            return body if body["providers_available"] == ["pa"] else None

        body = await until(b_gone, timeout=30, interval=0.05, what="node-b out of dispatch")
        assert body["providers"]["pb"] == {"healthy": False, "reason": "node_disconnected"}


async def test_ready_when_the_wait_runs_out_with_a_node_that_never_comes(
    tmp_path, iop_processes, document_of, until
) -> None:
    config = write_config(tmp_path, document_of)
    log = tmp_path / "edge.log"
    async with contextlib.AsyncExitStack() as stack:
        _, started = await iop_processes.edge(stack, config, "--wait-for-nodes", "3", log_file=log)
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=started["url"]))

        status, body = await readyz(http)
        assert status == 503
        assert body["waiting_for_nodes"] == ["node-a", "node-b"]
        assert 0 < body["wait_left_s"] <= 3

        # node-a comes (before or after the wait ran out); node-b never does.
        await iop_processes.node(stack, started["hub_port"], "node-a", tmp_path / "node-a.token")

        async def ready() -> dict[str, Any] | None:
            status, body = await readyz(http)
            return body if status == 200 else None

        body = await until(ready, timeout=30, interval=0.05, what="the wait to run out")
        assert "waiting_for_nodes" not in body
        assert body["providers"]["pb"] == {"healthy": False, "reason": "node_disconnected"}
        lines = [line for line in log.read_text().splitlines() if "edge ready" in line]
        assert len(lines) == 1, lines
        assert "edge ready after waiting" in lines[0]
        assert lines[0].endswith("node-b") and "of 2 connected, still missing" in lines[0]
