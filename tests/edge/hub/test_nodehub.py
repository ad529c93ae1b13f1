"""The node hub with real Nodes, over real sockets: runs, cancellation, refusals, swap, capacity."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import grpc
import grpc.aio
import httpx
import orjson
import pytest

from iop.edge.hub.nodehub import NodeHub
from iop.edge.hub.protocol import ProviderLink
from iop.fakes import FakeUpstream, tokens
from iop.wire import (
    PROTOCOL_VERSION,
    RunChunk,
    RunDone,
    RunEvent,
    RunFailed,
    RunRequest,
    RunUsage,
    statuses,
)
from iop.wire import runtime_pb2 as pb
from iop.wire.runtime_pb2_grpc import NodeRuntimeStub

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

MESSAGES = [{"role": "user", "content": "hello"}]
#: A provider whose plain answers are some 2.5 MB: larger than a wire message (1 MiB).
LARGE = {"id": "p1", "adapter": {"type": "fake", "completion_tokens": 400_000}}


def run_request(
    provider: str = "p1", *, stream: bool = True, run_id: str = "run-1", **body: Any
) -> RunRequest:
    document = {"model": "served", "messages": MESSAGES, "stream": stream, **body}
    return RunRequest(
        run_id, provider, "served", "chat", orjson.dumps(document), stream, time.time() + 30
    )


async def collect(hub: NodeHub, request: RunRequest) -> list[RunEvent]:
    async with hub.run(request) as stream:
        return [event async for event in stream]


def openai_provider(upstream: FakeUpstream, **settings: Any) -> dict[str, Any]:
    return {"id": "p1", "adapter": {"type": "openai", "base_url": upstream.base_url, **settings}}


async def test_a_streamed_run_arrives_intact(
    wire_config, start_hub, start_node, fake_upstream: FakeUpstream
) -> None:
    hub = await start_hub(wire_config([openai_provider(fake_upstream)]))
    await start_node(hub)
    events = await collect(hub, run_request(stream_options={"include_usage": True}))

    async with httpx.AsyncClient() as http:
        direct = await http.post(
            f"{fake_upstream.base_url}/chat/completions",
            json={
                "model": "served",
                "messages": MESSAGES,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    direct_chunks = [
        orjson.loads(line[6:])
        for line in direct.content.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    chunks = [orjson.loads(e.data) for e in events if isinstance(e, RunChunk)]
    assert [c["choices"] for c in chunks] == [c["choices"] for c in direct_chunks]
    assert [c["usage"] for c in chunks] == [c["usage"] for c in direct_chunks]
    assert [e.usage_only for e in events if isinstance(e, RunChunk)][-1] is True
    assert events[-2:] == [RunUsage(8, 16, 24), RunDone("stop")]


async def test_a_non_streaming_run_arrives_intact(
    wire_config, start_hub, start_node, fake_upstream: FakeUpstream
) -> None:
    hub = await start_hub(wire_config([openai_provider(fake_upstream)]))
    await start_node(hub)
    chunk, usage, done = await collect(hub, run_request(stream=False, max_tokens=5))
    assert isinstance(chunk, RunChunk)
    body = orjson.loads(chunk.data)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "".join(tokens(5))
    assert usage == RunUsage(8, 5, 13)
    assert done == RunDone("length")


async def test_leaving_a_run_early_cancels_it_up_to_the_upstream(
    wire_config, start_hub, start_node, fake_upstream: FakeUpstream, until
) -> None:
    hub = await start_hub(wire_config([openai_provider(fake_upstream)]))
    node = await start_node(hub)
    request = run_request(fake_upstream={"tokens_per_second": 10})
    async with hub.run(request) as stream:
        async for event in stream:
            assert isinstance(event, RunChunk)
            break
        assert fake_upstream.stats.in_flight == 1
    await until(lambda: fake_upstream.stats.disconnects == 1, timeout=5)
    assert fake_upstream.stats.in_flight == 0
    await until(lambda: not node.runner.in_flight())


async def test_a_provider_without_a_connected_node_is_unavailable(wire_config, start_hub) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    (failed,) = await collect(hub, run_request())
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.retryable) == (statuses.NODE_UNAVAILABLE, True)


async def test_connects_and_disconnects_are_announced(
    wire_config, start_hub, start_node, until
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    seen: list[dict[str, ProviderLink]] = []
    hub.add_listener(lambda: seen.append(dict(hub.connected_providers())))
    node = await start_node(hub)
    assert hub.connected_providers() == {"p1": ProviderLink("p1", "node-1", True, "")}
    await node.stop()
    await until(lambda: not hub.connected_providers())
    # The listeners hear of it on the loop's next turn.
    await until(lambda: seen[-1] == {})
    assert seen[0] == {"p1": ProviderLink("p1", "node-1", True, "")}
    assert hub.connected_providers() == {}


async def test_a_burst_of_changes_is_announced_once(wire_config, start_hub) -> None:
    """Changes in one turn of the loop (a thousand Nodes reconnecting) reach the listeners once,
    on the next turn, not once each: every listener reads every provider."""
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    heard: list[int] = []
    hub.add_listener(lambda: heard.append(len(heard)))
    for replicas in (2, 3, 4):
        hub.set_edge_replicas(replicas)
    assert heard == []
    await asyncio.sleep(0)
    assert heard == [0]


async def test_a_node_that_goes_away_fails_its_runs_at_once(
    wire_config, start_hub, start_node
) -> None:
    slow = {"type": "fake", "tokens_per_second": 5, "completion_tokens": 50}
    hub = await start_hub(wire_config([{"id": "p1", "adapter": slow}]))
    node = await start_node(hub)
    async with hub.run(run_request()) as stream:
        first = await anext(stream)
        assert isinstance(first, RunChunk)
        started = time.monotonic()
        await node.stop()
        rest = [event async for event in stream]
    assert time.monotonic() - started < 2
    failed = rest[-1]
    assert isinstance(failed, RunFailed)
    assert failed.code == statuses.NODE_DISCONNECTED
    assert not failed.retryable  # a chunk already reached the client
    assert "node node-1 disconnected" in failed.message


async def _hello(
    port: int, credentials: grpc.ChannelCredentials, **fields: Any
) -> grpc.aio.AioRpcError:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        call = NodeRuntimeStub(channel).Connect()
        hello = {"protocol_version": PROTOCOL_VERSION, "node_id": "node-1", **fields}
        await call.write(pb.NodeMessage(hello=pb.Hello(**hello)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.read()
        return refused.value


@pytest.mark.parametrize(
    ("hello", "code", "details"),
    [
        pytest.param(
            {"token": "not-the-token"},
            grpc.StatusCode.UNAUTHENTICATED,
            "unknown node id or wrong token",
            id="wrong-token",
        ),
        pytest.param(
            {"node_id": "ghost", "token": "not-the-token"},
            grpc.StatusCode.UNAUTHENTICATED,
            "unknown node id or wrong token",  # the same answer: ids cannot be probed
            id="unknown-node",
        ),
        pytest.param(
            {"protocol_version": 99, "token": "not-the-token"},
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this Edge speaks runtime protocol {PROTOCOL_VERSION}, the node 99",
            id="protocol",
        ),
    ],
)
async def test_refused_nodes_get_a_clear_status(
    wire_config,
    start_hub,
    tls,
    caplog: pytest.LogCaptureFixture,
    hello: dict[str, Any],
    code,
    details,
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    with caplog.at_level(logging.DEBUG):
        refused = await _hello(hub.port, tls.client().credentials(), **hello)
    assert (refused.code(), refused.details()) == (code, details)
    assert "not-the-token" not in caplog.text
    assert hub.connected_providers() == {}


async def test_a_node_with_a_wrong_token_keeps_trying_and_says_why(
    wire_config, start_hub, start_node, until
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    node = await start_node(hub, token="wrong", wait=False)
    (connection,) = node.connections.values()
    await until(lambda: connection.last_error != "")
    assert connection.last_error == "refused by the Edge: unknown node id or wrong token"
    assert hub.connected_providers() == {}


async def test_a_swap_during_a_stream_lets_it_finish_then_closes_the_old_adapter(
    wire_config, start_hub, start_node, until
) -> None:
    old_settings = {"type": "fake", "tokens_per_second": 40, "completion_tokens": 10}
    config = wire_config([{"id": "p1", "adapter": old_settings}])
    hub = await start_hub(config)
    node = await start_node(hub)
    old_adapter = node.runner.registry.provisions["p1"].adapter
    new_config = wire_config([{"id": "p1", "adapter": {**old_settings, "latency_ms": 1}}])

    async with hub.run(run_request()) as stream:
        events = [await anext(stream)]
        acks = await hub.swap_config(new_config)
        assert acks["node-1"] is not None and acks["node-1"].ok
        assert node.runner.registry.provisions["p1"].adapter is not old_adapter
        assert not old_adapter.closed
        events += [event async for event in stream]

    assert events[-1] == RunDone("stop")
    assert len([e for e in events if isinstance(e, RunChunk)]) == 1 + 10 + 1
    await until(lambda: old_adapter.closed)
    assert node.runner.drain_reports[-1].cut_runs == 0
    assert node.runner.drain_reports[-1].provider_ids == ("p1",)
    # New runs use the new adapter.
    assert (await collect(hub, run_request(stream=False, run_id="run-2")))[-1] == RunDone("stop")


async def test_a_swap_that_changes_only_limits_keeps_the_adapter(
    wire_config, start_hub, start_node
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    node = await start_node(hub)
    adapter = node.runner.registry.provisions["p1"].adapter
    acks = await hub.swap_config(
        wire_config([{"id": "p1", "adapter": {"type": "fake"}, "capacity": 3}])
    )
    assert acks["node-1"] is not None and acks["node-1"].ok
    assert node.runner.registry.provisions["p1"].payload.capacity == 3
    assert node.runner.registry.provisions["p1"].adapter is adapter
    assert (
        await hub.swap_config(
            wire_config([{"id": "p1", "adapter": {"type": "fake"}, "capacity": 3}])
        )
        == {}
    )


@pytest.mark.parametrize(
    ("hook", "settings", "code"),
    [
        pytest.param({"fail": "status", "status": 500}, {}, "upstream_error", id="500"),
        pytest.param({"fail": "drop"}, {}, "upstream_error", id="dropped"),
        pytest.param(
            {"latency_ms": 3000}, {"request_timeout_s": 0.2}, "upstream_timeout", id="timeout"
        ),
    ],
)
async def test_upstream_failures_arrive_as_run_errors(
    wire_config, start_hub, start_node, fake_upstream: FakeUpstream, hook, settings, code
) -> None:
    hub = await start_hub(wire_config([openai_provider(fake_upstream, **settings)]))
    await start_node(hub)
    (failed,) = await collect(hub, run_request(fake_upstream=hook))
    assert isinstance(failed, RunFailed)
    assert failed.code == code
    assert failed.message


async def test_capacity_holds_across_two_edges(wire_config, start_hub, start_node) -> None:
    slow = {"type": "fake", "tokens_per_second": 50, "completion_tokens": 10}
    config = wire_config([{"id": "p1", "adapter": slow, "capacity": 1}])
    edge_a, edge_b = await start_hub(config), await start_hub(config)
    await start_node(edge_a, edge_b)

    async with edge_a.run(run_request()) as stream:
        assert isinstance(await anext(stream), RunChunk)
        (refused,) = await collect(edge_b, run_request(run_id="run-b"))
        assert isinstance(refused, RunFailed)
        assert (refused.code, refused.retryable) == (statuses.PROVIDER_BUSY, True)
        assert "across all Edges" in refused.message
        assert [e async for e in stream][-1] == RunDone("stop")
    assert (await collect(edge_b, run_request(run_id="run-c", stream=False)))[-1] == RunDone("stop")


async def test_a_node_follows_its_edge_through_a_restart(
    wire_config, start_hub, start_node, until
) -> None:
    config = wire_config([{"id": "p1", "adapter": {"type": "fake"}}])
    first = NodeHub(config)
    port = await first.start()
    try:
        await start_node(first)
    finally:
        await first.stop(grace=0)
    second = await start_hub(
        config.model_copy(
            update={"edge": config.edge.model_copy(update={"listen": f"127.0.0.1:{port}"})}
        )
    )
    await until(lambda: bool(second.connected_providers()))
    assert (await collect(second, run_request(stream=False)))[-1] == RunDone("stop")


async def test_take_ready_hands_over_what_arrived_up_to_the_end(
    wire_config, start_hub, start_node
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": {"type": "fake"}}]))
    await start_node(hub)
    async with hub.run(run_request()) as stream:
        assert stream.take_ready() == []  # nothing has arrived before the first wait
        first = await anext(stream)
        assert isinstance(first, RunChunk)
        rest: list[RunEvent] = []
        while not rest or not isinstance(rest[-1], RunDone):
            rest.extend(stream.take_ready() or [await anext(stream)])
        assert stream.take_ready() == []
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
    assert isinstance(rest[-2], RunUsage)
    assert [e for e in rest if isinstance(e, RunDone)] == [rest[-1]]


async def test_an_answer_larger_than_a_wire_message_arrives_whole_in_pieces(
    wire_config, start_hub, start_node
) -> None:
    hub = await start_hub(wire_config([LARGE]))
    await start_node(hub)
    events = await collect(hub, run_request(stream=False))
    chunks = [event for event in events if isinstance(event, RunChunk)]
    assert len(chunks) == 1 and len(chunks[0].data) > 2 * 1024 * 1024  # past the 1 MiB bound
    answer = orjson.loads(chunks[0].data)
    assert answer["usage"]["completion_tokens"] == 400_000
    assert isinstance(events[-1], RunDone)


async def test_the_edge_refuses_an_answer_past_the_runs_bound_whatever_the_node_sends(
    wire_config, start_hub, start_node, until
) -> None:
    # The fake adapter reads no upstream, so nothing bounds it on the Node: the Edge's join does.
    hub = await start_hub(wire_config([LARGE]))
    node = await start_node(hub)
    request = run_request(stream=False)
    events = await collect(hub, dataclasses.replace(request, max_response_bytes=512 * 1024))
    assert len(events) == 1 and isinstance(events[0], RunFailed)
    assert events[0].code == statuses.RESPONSE_TOO_LARGE and not events[0].retryable
    assert "openai.max_response_bytes" in events[0].message
    await until(lambda: node.runner.in_flight() == {})  # cancelled on the Node
