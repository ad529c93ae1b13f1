"""A frozen Node (SIGSTOP: its process stops, its TCP connections stay open) is detected by its
heartbeat deadline; the runs on it fail fast, and those that sent the client nothing move to
the other node; dispatch leaves it until it comes back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import pytest

from testkit import CLIENT_TOKEN

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

#: Room for a loaded two-core machine on top of a deadline: a bound on correctness, not speed.
SLACK_S = 5.0


async def test_a_frozen_node_is_detected_its_runs_move_and_it_comes_back(
    document_of, kit, start_edge, iop_processes, until, tmp_path: Path
) -> None:
    slow = {"type": "fake", "latency_ms": 300, "tokens_per_second": 10, "completion_tokens": 40}
    # p1 (node-1) wins every dispatch while it is available; p2 (node-2) is the other one.
    document = kit.two_nodes_document(
        document_of, adapter=slow, priorities=(0, 10), edge={"admin": {"listen": "127.0.0.1:0"}}
    )
    edge = await start_edge(document)
    hub = edge.hub
    tokens = kit.token_files(tmp_path)
    async with contextlib.AsyncExitStack() as stack:
        node_1 = await iop_processes.node(stack, edge.hub_port, "node-1", tokens["node-1"])
        await iop_processes.node(stack, edge.hub_port, "node-2", tokens["node-2"])
        await until(lambda: edge.dispatcher.available == {"p1", "p2"}, timeout=30)
        http = await stack.enter_async_context(
            httpx.AsyncClient(
                base_url=edge.url,
                headers={"authorization": f"Bearer {CLIENT_TOKEN}"},
                timeout=60,
            )
        )

        # A stream that has sent its client some chunks, on node-1.
        started = asyncio.Event()
        streamed: list[str] = []

        async def stream() -> int:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    streamed.append(line)
                    if line.startswith("data: {"):
                        started.set()
                return response.status_code

        streaming = asyncio.create_task(stream())
        await asyncio.wait_for(started.wait(), 30)

        async with kit.frozen(node_1.pid):
            frozen_at = time.monotonic()
            # A request sent now goes to node-1 (the Edge does not know yet): nothing of it has
            # reached its client, so it moves to node-2 when node-1 is found dead.
            moved = asyncio.create_task(kit.chat(http))
            await until(lambda: hub.silent_nodes == 1, timeout=30)
            detected_s = time.monotonic() - frozen_at
            deadline = hub.liveness.heartbeat_timeout + hub.liveness.heartbeat_interval
            assert detected_s < deadline + SLACK_S, f"detected after {detected_s:.1f}s"

            # The stream that had begun fails fast with an error event, not a hang.
            assert await asyncio.wait_for(streaming, 30) == 200
            assert kit.error_code("\n".join(streamed)) == "node_disconnected"
            # The request that had sent nothing was served by node-2.
            status, text = await asyncio.wait_for(moved, 30)
            assert status == 200, text
            assert edge.dispatcher.available == {"p2"}
            ready = (await http.get("/readyz")).json()
            assert ready["providers_available"] == ["p2"]
            # New requests go to node-2 while node-1 stays frozen.
            statuses = await asyncio.gather(*(kit.chat(http) for _ in range(4)))
            assert [status for status, _ in statuses] == [200] * 4

        # Resumed, node-1 finds its stream ended, dials again and serves again.
        await until(lambda: edge.dispatcher.available == {"p1", "p2"}, timeout=30)
        assert (await kit.chat(http))[0] == 200


async def test_http2_keepalive_alone_closes_the_link_of_a_frozen_node(
    document_of, kit, start_edge, iop_processes, until, tmp_path: Path
) -> None:
    """The transport's backstop: with heartbeats all but off (a minute's deadline), the HTTP/2
    keepalive ping that a frozen process never acknowledges still ends its link."""
    patient = {"heartbeat_interval_ms": 20_000, "heartbeat_timeout_ms": 60_000}
    document = kit.two_nodes_document(
        document_of, edge={"admin": {"listen": "127.0.0.1:0"}, "node_link": patient}
    )
    edge = await start_edge(document)
    tokens = kit.token_files(tmp_path)
    async with contextlib.AsyncExitStack() as stack:
        node_1 = await iop_processes.node(stack, edge.hub_port, "node-1", tokens["node-1"])
        await until(lambda: "p1" in edge.dispatcher.available, timeout=30)
        async with kit.frozen(node_1.pid):
            frozen_at = time.monotonic()
            await until(lambda: "p1" not in edge.dispatcher.available, timeout=40)
            closed_s = time.monotonic() - frozen_at
        assert edge.hub.silent_nodes == 0  # the heartbeat deadline did not do it
        keepalive_s = 5.0 + 3.0  # keepalive_time_ms + ping_timeout_ms (iop.wire.grpc_options)
        assert closed_s < keepalive_s + SLACK_S, f"closed after {closed_s:.1f}s"
