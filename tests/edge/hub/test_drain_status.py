"""Drain you can watch: a Node's shutdown drain and a registry swap's drain reach the Edge over
the wire, and its admin API (`GET /status`) and `/metrics` show which Node drains and how many
runs each provider has left, down to zero exactly when the last run ends.

An in-process Edge (real sockets) and an in-process Node over real gRPC, the `fake` adapter
streaming slowly enough that runs overlap the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import httpx
import pytest

from iop.edge.hub.nodesessions import NodeSession
from iop.edgeconfig import load_data
from iop.wire import DrainProgress

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

#: 20 tokens a second: a stream of n tokens lasts about n / 20 s.
SLOW = {"type": "fake", "tokens_per_second": 20, "completion_tokens": 40}


def slow_pa(document: dict[str, Any]) -> dict[str, Any]:
    """Model m on pa alone, pa streaming slowly."""
    document["models"][0]["providers"] = {"pa": "served-a"}
    pa = document["nodes"][0]["providers"][0]
    pa.update(adapter=dict(SLOW), capacity=4)
    return document


async def stream(
    http: httpx.AsyncClient, tokens: int, *, started: asyncio.Event | None = None
) -> str:
    """One streamed chat completion of `tokens` tokens; `started` is set at its first chunk."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"stream": True, "max_tokens": tokens}
    parts: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for part in response.aiter_text():
            parts.append(part)
            if started is not None:
                started.set()
    text = "".join(parts)
    assert response.status_code == 200, text
    return text


@pytest.fixture
def drains_seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[DrainProgress, int]]:
    """Each drain progress the Edge receives, with the node's runs still in flight on the Edge
    at that moment (the Node sends a run's end before the progress it makes)."""
    seen: list[tuple[DrainProgress, int]] = []
    received = NodeSession._drained

    def drained(session: NodeSession, progress: DrainProgress) -> None:
        seen.append((progress, len(session.runs)))
        received(session, progress)

    monkeypatch.setattr(NodeSession, "_drained", drained)
    return seen


async def test_a_node_shutdown_drain_shows_on_the_edge_down_to_zero_at_its_last_run(
    refresh_stack, refresh_document, until, drains_seen
) -> None:
    stack = await refresh_stack(slow_pa(refresh_document()))
    hub = stack.edge.hub
    streams = [asyncio.create_task(stream(stack.http, n)) for n in (4, 12)]
    # Both runs are on the Node, not only sent by the Edge: a drain that began before they
    # arrived would refuse them (provider_busy) and count none.
    await until(lambda: stack.node.runner.running == 2)

    drain = asyncio.create_task(stack.node.drain(30))
    await until(lambda: hub.nodes()["node-1"].drain.total == 2)
    node = hub.nodes()["node-1"]
    assert node.draining and node.drain.shutting_down
    text = stack.edge.metrics.render().decode()
    assert 'iop_edge_node_draining{node="node-1"} 1.0' in text
    assert 'iop_edge_node_draining_runs{node="node-1",provider="pa"} 2.0' in text
    assert 'iop_edge_node_draining_runs{node="node-1",provider="pb"} 0.0' in text
    assert (
        'iop_edge_provider_unhealthy_reason{node="node-1",provider="pa",reason="draining"}' in text
    )
    status = (await stack.admin.get("/status")).json()
    one, two = status["nodes"]
    assert (one["node_id"], one["draining"], one["shutting_down"]) == ("node-1", True, True)
    assert one["draining_runs"] == {"pa": 2}
    assert {p["provider_id"]: p["reason"] for p in one["providers"]} == {
        "pa": "draining",
        "pb": "draining",
    }
    assert (two["node_id"], two["connected"], two["draining"]) == ("node-2", False, False)
    assert [(p["provider_id"], p["reason"]) for p in two["providers"]] == [
        ("pc", "node_disconnected")
    ]

    await asyncio.gather(*streams)  # both finish: a drain cuts nothing
    assert await drain is True
    # Back from the drain, the node has left: the Edge read the drain's zero, then the end of
    # the node's stream, and closed it.
    assert "node-1" not in hub.nodes()
    totals = [progress.total for progress, _ in drains_seen]
    # 2, 1, 0 (a report that a later one overtook in the same write is folded into it).
    assert totals[0] == 2 and totals[-1] == 0 and totals == sorted(totals, reverse=True)
    # Every report counted exactly the runs the Edge still had on the node: zero arrived as the
    # last run ended, not while it streamed.
    assert all(progress.total == runs for progress, runs in drains_seen)
    text = stack.edge.metrics.render().decode()
    assert 'iop_edge_node_draining{node="node-1"}' not in text  # gone with its session


async def test_a_swap_drain_shows_on_the_edge_and_ends(
    refresh_stack, refresh_document, until, drains_seen
) -> None:
    document = slow_pa(refresh_document())
    stack = await refresh_stack(document)
    hub = stack.edge.hub
    streams = [asyncio.create_task(stream(stack.http, n)) for n in (6, 12)]
    await until(lambda: stack.node.runner.running == 2)  # on the old adapter: the Node has them

    # New adapter settings for pa (an Edge restarted on a new config sends the same on
    # welcome): the Node swaps registries and drains the old adapter's runs.
    document["nodes"][0]["providers"][0]["adapter"] = {**SLOW, "completion_tokens": 50}
    await hub.swap_config(load_data(document))
    await until(lambda: hub.nodes()["node-1"].drain.total == 2)
    node = hub.nodes()["node-1"]
    assert node.draining and not node.drain.shutting_down
    assert dict(node.drain.runs_left) == {"pa": 2}
    assert 'iop_edge_node_draining{node="node-1"} 1.0' in stack.edge.metrics.render().decode()

    await asyncio.gather(*streams)
    await until(lambda: not hub.nodes()["node-1"].draining)
    totals = [progress.total for progress, _ in drains_seen]
    assert totals[0] == 2 and totals[-1] == 0 and totals == sorted(totals, reverse=True)
    assert all(progress.total == runs for progress, runs in drains_seen)
    text = stack.edge.metrics.render().decode()
    assert 'iop_edge_node_draining{node="node-1"} 0.0' in text
    assert "iop_edge_node_draining_runs{" not in text
    status = (await stack.admin.get("/status")).json()
    assert (status["nodes"][0]["draining"], status["nodes"][0]["draining_runs"]) == (False, {})


async def test_a_node_process_sends_its_last_runs_ends_and_zero_before_it_exits(
    start_edge, refresh_document, iop_processes, node_token, tokens, until, drains_seen, tmp_path
) -> None:
    """SIGTERM to `iop node run` with streams on it: they all finish, and the Edge hears zero
    runs left before the Node closes its link (it flushes what it queued before it goes)."""
    edge = await start_edge(slow_pa(refresh_document()))
    (tmp_path / "token").write_text(node_token)
    async with contextlib.AsyncExitStack() as stack:
        node = await iop_processes.node(stack, edge.hub_port, "node-1", tmp_path / "token")
        await until(lambda: {"pa", "pb"} <= edge.dispatcher.available, timeout=30)
        http = await stack.enter_async_context(
            httpx.AsyncClient(
                base_url=edge.url,
                headers={"authorization": f"Bearer {tokens['search-chat']}"},
                timeout=30,
            )
        )
        started = [asyncio.Event() for _ in range(3)]
        streams = [
            asyncio.create_task(stream(http, n, started=s))
            for n, s in zip((6, 10, 14), started, strict=True)
        ]
        for event in started:  # every run is streaming on the Node
            await asyncio.wait_for(event.wait(), 30)

        node.send_signal(signal.SIGTERM)
        texts = await asyncio.gather(*streams)
        assert await asyncio.wait_for(node.wait(), 30) == 0
    assert all(text.rstrip().endswith("data: [DONE]") for text in texts), texts
    totals = [progress.total for progress, _ in drains_seen]
    assert totals[0] == 3 and totals[-1] == 0 and totals == sorted(totals, reverse=True)
    assert all(progress.shutting_down for progress, _ in drains_seen)
