"""Quiet links (the wire's "Quiet links"): a Node link with no run in flight beats only every
idle interval, and only from the Node when both sides say so (an older Node or Edge keeps the
beats both ways), so an idle fleet costs its Edge little; a run in flight brings the fast
heartbeats both ways and the fast deadline back. Real hub, real Node agent, real gRPC stream;
what each side heard is read from its own bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from iop.edge.hub import NodeHub, nodehub
from iop.edge.hub.nodesessions import NodeSession
from iop.edgeconfig import EdgeConfig, NodeLinkSection
from iop.node import NodeAgent
from iop.node.connecting import FIRST_DIAL_LIVENESS, EdgeConnection
from iop.wire import Liveness, RunDone, RunRequest, grpc_options
from iop.wire import runtime_pb2 as pb

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


def older_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes of this process say hello as a Node that predates one-way quiet links."""
    hello = EdgeConnection._hello

    def without_one_way(connection: EdgeConnection) -> pb.Hello:
        message = hello(connection)
        message.quiet_one_way = False
        return message

    monkeypatch.setattr(EdgeConnection, "_hello", without_one_way)


def older_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hubs of this process ignore a hello's `quiet_one_way`, as an Edge that predates it."""

    def session(**options: Any) -> NodeSession:
        return NodeSession(**{**options, "quiet_one_way": False})

    monkeypatch.setattr(nodehub, "NodeSession", session)


@pytest.mark.parametrize(
    ("idle_ms", "older", "fewest", "most", "one_way"),
    [
        pytest.param(1000, None, 1, 4, True, id="one-way"),
        pytest.param(1000, older_node, 1, 4, False, id="older-node"),
        pytest.param(1000, older_edge, 1, 4, False, id="older-edge"),
        pytest.param(0, None, 20, 40, False, id="quiet-links-off"),
    ],
)
async def test_an_idle_link_beats_every_idle_interval_and_stays_up(
    start_hub,
    start_node,
    wire_config,
    monkeypatch: pytest.MonkeyPatch,
    idle_ms: int,
    older: Callable[[pytest.MonkeyPatch], None] | None,
    fewest: int,
    most: int,
    one_way: bool,
) -> None:
    """The Node beats every idle interval; the Edge does too only for a Node or an Edge that
    predates one-way quiet links (the welcome says which), and every link beats at the fast
    interval when quiet links are off."""
    if older is not None:
        older(monkeypatch)
    hub, agent = await connected(
        start_hub, start_node, wire_config, {**LINK, "idle_heartbeat_interval_ms": idle_ms}
    )
    session = hub._sessions["node-1"]
    (connection,) = agent.connections.values()
    assert session.quiet_one_way is one_way
    assert connection.quiet_one_way is one_way
    edge_heard, node_heard = await heard(hub, agent, 3.0)

    assert fewest <= edge_heard <= most
    if one_way:
        assert node_heard == 0
    else:
        assert fewest <= node_heard <= most
    # Silent far past the fast deadline (400 ms) and still up: the quiet link's is 3 s.
    assert hub._sessions["node-1"] is session and not session.closing.done()
    assert hub.silent_nodes == 0
    assert connection.silences == 0


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

    assert busy[0] >= 6 and busy[1] >= 6  # every 100 ms both ways while the run is in flight
    assert quiet[0] <= 3  # every second again once it ended, from the Node
    assert quiet[1] <= 1  # and none from the Edge (but one that was on its way)
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


def test_a_first_dial_pings_no_more_often_than_a_default_edges_quiet_links_beat() -> None:
    """A Node's first dial cannot know the Edge's quiet interval: its keepalive assumes
    edge.node_link's defaults, so the pings of a one-way quiet link (the Node reads nothing
    there) go every 10.5 s rather than every 5 s."""
    link = NodeLinkSection()
    idle_ms, idle_timeout_ms = link.quiet_link_ms()
    defaults = Liveness(
        link.heartbeat_interval_ms / 1000,
        link.heartbeat_timeout_ms / 1000,
        idle_ms / 1000,
        idle_timeout_ms / 1000,
    )
    assert FIRST_DIAL_LIVENESS == defaults
    assert dict(grpc_options(liveness=FIRST_DIAL_LIVENESS))["grpc.keepalive_time_ms"] == 10_500
