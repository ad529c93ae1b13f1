"""A run the Node never accepts (the Node is alive, its heartbeats flow, but the run got lost on
the way to an adapter) fails as retryable after the first-event deadline, is cancelled on the
Node, and the request moves to another candidate: it never waits forever."""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson
import pytest

from iop.node import EdgeConnection
from iop.wire import RunFailed, RunRequest, statuses
from testkit import CLIENT_TOKEN

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]

SLACK_S = 5.0


def lose_runs_of(node_id: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every connection of `node_id` drop the runs it is sent (it stays alive)."""
    lost: list[str] = []
    real_start = EdgeConnection._start

    def start(self: EdgeConnection, message: Any, writer: Any) -> None:
        if self.identity.node_id == node_id:
            lost.append(message.run_id)
            return
        real_start(self, message, writer)

    monkeypatch.setattr(EdgeConnection, "_start", start)
    return lost


async def test_a_run_never_accepted_fails_as_retryable_after_the_deadline(
    wire_config, start_hub, start_node, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    lost = lose_runs_of("node-1", monkeypatch)
    await start_node(hub)
    body = orjson.dumps({"model": "served", "messages": [{"role": "user", "content": "hi"}]})
    sent = time.monotonic()
    async with hub.run(RunRequest("r1", "p1", "served", "chat", body, False)) as stream:
        events = [event async for event in stream]
    waited = time.monotonic() - sent
    (failed,) = events
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.retryable) == (statuses.NOT_ACCEPTED, True)
    assert lost == ["r1"]
    assert hub.runs_not_accepted == 1
    assert hub.first_event_timeout <= waited < hub.first_event_timeout + SLACK_S
    assert hub.connected_providers()  # the node itself stays: it is alive


async def test_the_request_moves_to_a_node_that_accepts(
    document_of, kit, start_edge, start_node, monkeypatch: pytest.MonkeyPatch, until
) -> None:
    # node-1 (p1) wins every dispatch but loses its runs; node-2 (p2) serves.
    document = kit.two_nodes_document(
        document_of, priorities=(0, 10), edge={"admin": {"listen": "127.0.0.1:0"}}
    )
    edge = await start_edge(document)
    lost = lose_runs_of("node-1", monkeypatch)
    await start_node(edge.hub, node_id="node-1", token=kit.node_tokens["node-1"])
    await start_node(edge.hub, node_id="node-2", token=kit.node_tokens["node-2"])
    await until(lambda: edge.dispatcher.available == {"p1", "p2"})
    async with httpx.AsyncClient(
        base_url=edge.url, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, timeout=30
    ) as http:
        status, text = await kit.chat(http)
    assert status == 200, text
    assert len(lost) == 1
    assert edge.hub.runs_not_accepted == 1
