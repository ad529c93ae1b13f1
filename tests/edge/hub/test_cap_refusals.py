"""The hub's caps met by real Nodes and raw gRPC connections over real sockets: each connection
turned away is counted by cap (`iop_edge_hub_connections_refused_total{reason}`) and logged once
per interval, not once per refusal; an Edge that admits fewer nodes than its config has says so
at start and on a refresh."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

import iop.edge.hub.caps
from iop.edge.hub.nodehub import NodeHub
from iop.edgeconfig import load_data
from iop.wire.runtime_pb2_grpc import NodeRuntimeStub
from testkit import node_token_of, provider

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

NODE_IDS = [f"node-{i}" for i in range(10)]
REFUSED = "node hub refused a connection"


def fleet(document_of: Any, node_ids: list[str]) -> dict[str, Any]:
    """A config with `node_ids`, each holding one fake provider (`p-<node id>`)."""
    fake = {"type": "fake", "completion_tokens": 4}
    return dict(document_of(nodes={n: [provider(f"p-{n}", fake, capacity=2)] for n in node_ids}))


def refused_total(text: str, reason: str) -> float:
    """The counter's value in a /metrics text."""
    pattern = rf'^iop_edge_hub_connections_refused_total\{{reason="{reason}"\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, text
    return float(match[1])


def lines_with(caplog: pytest.LogCaptureFixture, *parts: str) -> list[str]:
    messages = (record.getMessage() for record in caplog.records)
    return [m for m in messages if all(part in m for part in parts)]


async def test_nodes_past_the_fitted_cap_are_refused_counted_and_logged_once(
    document_of,
    start_edge,
    start_node,
    until,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An open-file limit that leaves the hub room for 16 connections: 8 Nodes, 8 hellos.
    monkeypatch.setattr(iop.edge.hub.caps, "open_file_room", lambda open_files=None: 32)
    caplog.set_level(logging.WARNING, logger="iop.edge.hub.nodehub")
    edge = await start_edge(fleet(document_of, NODE_IDS))
    hub = edge.hub
    assert isinstance(hub, NodeHub) and hub.caps.max_connections == 8
    (started,) = lines_with(caplog, "nodes dial this Edge")
    assert started.startswith("10 nodes dial this Edge but its node hub admits 8 at once: ")
    assert "edge.node_link.max_connections (1024) lowered to fit" in started
    assert "open-file limit" in started

    nodes = [await start_node(hub, node_id=n, token=node_token_of(n), wait=False) for n in NODE_IDS]
    # The two left out keep redialing (every 0.05 to 0.5 s) and are refused each time.
    await until(lambda: len(hub.connected_providers()) == 8, timeout=30)
    await until(lambda: hub.cap_refusals.counts["connections"] >= 6, timeout=30)
    assert len(hub.connected_providers()) == 8
    errors = [c.last_error for node in nodes for c in node.connections.values() if c.failures]
    assert any("this Edge admits 8 nodes at once" in error for error in errors), errors

    text = edge.metrics.render().decode()
    counted = hub.cap_refusals.counts["connections"]
    assert refused_total(text, "connections") >= 6
    assert refused_total(text, "connections") <= counted
    # One line for all of them, naming the cap and its value: the interval is a minute.
    (line,) = lines_with(caplog, REFUSED, "(edge.node_link.max_connections is 8)")
    assert "8 nodes are connected" in line

    # A refresh that adds a node says it again, with the new count.
    grown = load_data(fleet(document_of, [*NODE_IDS, "node-10"]))
    await hub.swap_config(grown, ack_timeout=5.0)
    (refreshed,) = lines_with(caplog, "11 nodes dial this Edge")
    assert "admits 8 at once" in refreshed


@contextlib.asynccontextmanager
async def silent_calls(
    port: int, credentials: grpc.ChannelCredentials, count: int
) -> AsyncIterator[list[grpc.aio.StreamStreamCall[Any, Any]]]:
    """`count` calls that never send their hello, each on a connection of its own."""
    async with contextlib.AsyncExitStack() as stack:
        calls = []
        for index in range(count):
            channel = await stack.enter_async_context(
                grpc.aio.secure_channel(
                    f"127.0.0.1:{port}",
                    credentials,
                    options=[("grpc.use_local_subchannel_pool", 1), ("iop.test.channel", index)],
                )
            )
            call = NodeRuntimeStub(channel).Connect()
            stack.callback(call.cancel)
            calls.append(call)
        yield calls


@pytest.mark.parametrize(
    ("link", "waiting", "reason", "setting"),
    [
        pytest.param(
            {"max_unauthenticated_connections": 2, "max_unauthenticated_per_client": 2},
            2,
            "unauthenticated",
            "edge.node_link.max_unauthenticated_connections is 2",
            id="unauthenticated",
        ),
        pytest.param(
            {"max_unauthenticated_connections": 4, "max_unauthenticated_per_client": 1},
            1,
            "per_client",
            "edge.node_link.max_unauthenticated_per_client is 1",
            id="per-client",
        ),
    ],
)
async def test_connections_past_the_hello_caps_are_counted_by_reason_and_logged_once(
    wire_config,
    start_hub,
    tls,
    until,
    caplog: pytest.LogCaptureFixture,
    link: dict[str, int],
    waiting: int,
    reason: str,
    setting: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="iop.edge.hub.nodehub")
    config = wire_config([{"id": "p1", "adapter": {"type": "fake"}}], edge={"node_link": link})
    hub = await start_hub(config)
    assert hub.port is not None
    credentials = tls.client().credentials()
    async with silent_calls(hub.port, credentials, waiting) as calls:
        for call in calls:
            await call.wait_for_connection()
        await until(lambda: hub._admission._gate.pending == waiting)
        async with silent_calls(hub.port, credentials, 3) as extra:
            for call in extra:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert hub.cap_refusals.counts == {
        "connections": 0,
        "unauthenticated": 0,
        "per_client": 0,
        reason: 3,
    }
    assert hub.hellos_refused == 3
    (line,) = lines_with(caplog, REFUSED, f"({setting})")
    assert "waiting for their hello to be checked" in line
