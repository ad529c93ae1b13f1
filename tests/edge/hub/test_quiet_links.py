"""Quiet links (the wire's "Quiet links"): a Node link with no run in flight beats only every
idle interval both ways and is judged by the idle deadline, so an idle fleet costs its Edge
little; a run in flight brings the fast heartbeats and deadline back. Real hub, real Node agent,
real gRPC stream; what each side heard is read from its own bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from iop.edge.hub import NodeHub
from iop.edgeconfig import EdgeConfig
from iop.node import NodeAgent
from iop.wire import RunDone, RunRequest

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

#: Heartbeats every 100 ms (deadline 400 ms); a quiet link every 1 s (deadline 3 s).
LINK = {
    "heartbeat_interval_ms": 100,
    "heartbeat_timeout_ms": 400,
    "idle_heartbeat_interval_ms": 1000,
    "idle_heartbeat_timeout_ms": 3000,
}
SLOW = {"type": "fake", "latency_ms": 1500, "completion_tokens": 1}


async def heard(hub: NodeHub, agent: NodeAgent, seconds: float) -> tuple[int, int]:
    """(heartbeats the Edge heard from the node, messages the node heard from the Edge) over
    `seconds`, sampled every 10 ms (each side stamps the last one it got)."""
    session = hub._sessions["node-1"]
    (connection,) = agent.connections.values()
    edge_heard: set[float | None] = set()
    node_heard: set[float] = set()
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        edge_heard.add(session.last_heartbeat)
        node_heard.add(connection.last_heard)
        await asyncio.sleep(0.01)
    return len(edge_heard) - 1, len(node_heard) - 1


async def connected(
    start_hub: Callable[[EdgeConfig], Awaitable[NodeHub]],
    start_node: Callable[..., Awaitable[NodeAgent]],
    wire_config: Callable[..., EdgeConfig],
    link: dict[str, Any],
) -> tuple[NodeHub, NodeAgent]:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": SLOW}], edge={"node_link": link}))
    agent = await start_node(hub)
    await asyncio.sleep(0.5)  # the first heartbeats and health reports in
    return hub, agent


@pytest.mark.parametrize(
    ("idle_ms", "fewest", "most"),
    [
        pytest.param(1000, 1, 4, id="quiet"),
        pytest.param(0, 20, 40, id="quiet-links-off"),
    ],
)
async def test_an_idle_link_beats_every_idle_interval_both_ways_and_stays_up(
    start_hub, start_node, wire_config, idle_ms: int, fewest: int, most: int
) -> None:
    hub, agent = await connected(
        start_hub, start_node, wire_config, {**LINK, "idle_heartbeat_interval_ms": idle_ms}
    )
    session = hub._sessions["node-1"]
    edge_heard, node_heard = await heard(hub, agent, 3.0)

    assert fewest <= edge_heard <= most
    assert fewest <= node_heard <= most
    # Silent far past the fast deadline (400 ms) and still up: the quiet link's is 3 s.
    assert hub._sessions["node-1"] is session and not session.closing.done()
    assert hub.silent_nodes == 0


async def test_a_run_in_flight_brings_the_fast_heartbeats_back_and_then_quiet(
    start_hub, start_node, wire_config
) -> None:
    hub, agent = await connected(start_hub, start_node, wire_config, LINK)
    body = orjson.dumps({"model": "served", "messages": [{"role": "user", "content": "hi"}]})

    async def run() -> list[Any]:
        async with hub.run(RunRequest("r1", "p1", "served", "chat", body, False)) as stream:
            return [event async for event in stream]

    running = asyncio.create_task(run())
    try:
        await asyncio.sleep(0.2)  # sent, accepted: both sides count it in flight
        busy = await heard(hub, agent, 1.0)
        events = await running
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    assert isinstance(events[-1], RunDone)
    quiet = await heard(hub, agent, 2.0)

    assert busy[0] >= 6 and busy[1] >= 6  # every 100 ms while the run is in flight
    assert quiet[0] <= 3 and quiet[1] <= 3  # every second again once it ended
    assert hub.silent_nodes == 0


@pytest.mark.parametrize(
    ("idle_ms", "keepalive_ms"),
    [
        pytest.param(10_000, 10_100, id="quiet"),
        pytest.param(0, 5_000, id="quiet-links-off"),
    ],
)
async def test_keepalive_pings_wait_longer_than_a_quiet_links_heartbeats(
    start_hub, start_node, wire_config, idle_ms: int, keepalive_ms: int
) -> None:
    """A ping goes out after as long without reads; on a quiet link of a longer interval than
    the transport's 5 s it would take the heartbeats' place. The Node learns the interval in
    the welcome, so its next dial follows it (its first cannot know it)."""
    link = {**LINK, "idle_heartbeat_interval_ms": idle_ms, "idle_heartbeat_timeout_ms": 30_000}
    hub, agent = await connected(start_hub, start_node, wire_config, link)
    (connection,) = agent.connections.values()

    node_options = dict(connection.channel_options())
    hub_options = dict(hub.caps.server_options(hub.liveness))
    assert node_options["grpc.keepalive_time_ms"] == keepalive_ms
    assert hub_options["grpc.keepalive_time_ms"] == keepalive_ms
