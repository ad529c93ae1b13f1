"""A frozen Edge (SIGSTOP on a real `iop edge run`) is detected by its Nodes: they cancel its runs
(freeing their capacity for the other Edges), keep serving the other Edge, and reconnect when it
comes back. On a quiet link whose beats go one way (docs/reliability.md, "Quiet links") the
transport finds a stopped Edge, and an Edge whose event loop is only held keeps its Node."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from iop.edge.hub import nodehub
from iop.edge.hub.nodesessions import NodeSession
from iop.node import NodeAgent
from iop.wire import RunDone, RunRequest
from testkit import CLIENT_TOKEN

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

SLACK_S = 5.0
#: A quiet link beats every second and is silent past its deadline after 3 s.
QUIET = {"idle_heartbeat_interval_ms": 1000, "idle_heartbeat_timeout_ms": 3000}


async def test_a_frozen_edge_is_left_by_its_node_which_keeps_serving_the_other_edge(
    document_of, kit, start_edge, iop_processes, tls, until, node_token, tmp_path: Path
) -> None:
    slow = {"type": "fake", "tokens_per_second": 10, "completion_tokens": 100}
    document = document_of(
        [{"id": "p1", "adapter": slow, "served_models": ["served"], "capacity": 4}],
        edge={"admin": {"listen": "127.0.0.1:0"}},
    )
    (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
    other = await start_edge(document)  # an in-process replica beside the process
    async with contextlib.AsyncExitStack() as stack:
        edge_process, started = await iop_processes.edge(stack, tmp_path / "edge.yaml")
        agent = await stack.enter_async_context(
            NodeAgent(
                node_id="node-1",
                token=node_token,
                edges=[f"127.0.0.1:{started['hub_port']}", f"127.0.0.1:{other.hub_port}"],
                tls=tls.client(),
                backoff_initial=0.05,
                backoff_max=0.5,
            )
        )
        await agent.wait_connected()
        frozen_link = agent.connections[f"127.0.0.1:{started['hub_port']}"]
        headers = {"authorization": f"Bearer {CLIENT_TOKEN}"}
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=started["url"], headers=headers, timeout=60)
        )
        await iop_processes.wait_available(started["url"], ["p1"])

        # A run in flight on the node for the Edge that is about to freeze.
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        began = asyncio.Event()

        async def stream() -> None:
            with contextlib.suppress(httpx.HTTPError):
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        began.set()

        streaming = asyncio.create_task(stream())
        await asyncio.wait_for(began.wait(), 30)
        assert agent.runner.running == 1

        async with kit.frozen(edge_process.pid):
            frozen_at = time.monotonic()
            await until(lambda: frozen_link.silences == 1, timeout=30)
            detected_s = time.monotonic() - frozen_at
            assert detected_s < 2.0 + 0.5 + SLACK_S, f"detected after {detected_s:.1f}s"
            # Its run was cancelled: the capacity is free for the other Edge.
            await until(lambda: agent.runner.running == 0, timeout=10)
            async with httpx.AsyncClient(base_url=other.url, headers=headers, timeout=30) as near:
                answer = await near.post(
                    "/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                )
            assert answer.status_code == 200, answer.text

        # Resumed, the Edge gets its node back.
        welcomes = frozen_link.welcomes
        await until(lambda: frozen_link.welcomes > welcomes, timeout=30)
        streaming.cancel()
        await asyncio.gather(streaming, return_exceptions=True)


async def test_a_frozen_edge_on_a_quiet_link_is_left_when_the_transport_finds_it(
    document_of, kit, iop_processes, tls, until, node_token, tmp_path: Path
) -> None:
    """No deadline judges the Edge on a one-way quiet link: the Node's keepalive ping, which a
    stopped process never acknowledges, closes the transport, and the Node redials."""
    document = document_of(
        [{"id": "p1", "adapter": {"type": "fake"}, "served_models": ["served"]}],
        edge={"admin": {"listen": "127.0.0.1:0"}, "node_link": QUIET},
    )
    (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
    async with contextlib.AsyncExitStack() as stack:
        edge_process, started = await iop_processes.edge(stack, tmp_path / "edge.yaml")
        target = f"127.0.0.1:{started['hub_port']}"
        agent = await stack.enter_async_context(
            NodeAgent(
                node_id="node-1",
                token=node_token,
                edges=[target],
                tls=tls.client(),
                backoff_initial=0.05,
                backoff_max=0.5,
            )
        )
        await agent.wait_connected()
        link = agent.connections[target]
        assert link.quiet_one_way
        await iop_processes.wait_available(started["url"], ["p1"])

        async with kit.frozen(edge_process.pid):
            frozen_at = time.monotonic()
            await until(lambda: link.failures == 1, timeout=40)
            detected_s = time.monotonic() - frozen_at
            assert link.silences == 0  # the transport did it, not a deadline
            keepalive_s = 10.5 + 3.0  # a first dial's keepalive_time_ms + ping_timeout_ms
            assert detected_s < keepalive_s + SLACK_S, f"detected after {detected_s:.1f}s"

        welcomes = link.welcomes
        await until(lambda: link.welcomes > welcomes, timeout=30)


@pytest.mark.parametrize(
    "one_way",
    [
        pytest.param(True, id="one-way-stays"),
        pytest.param(False, id="older-edge-is-left"),
    ],
)
async def test_a_node_keeps_a_quiet_link_to_an_edge_whose_event_loop_is_held(
    wire_config, start_hub, iop_processes, until, node_token, monkeypatch, tmp_path: Path, one_way
) -> None:
    """The Edge's event loop held for four times a quiet link's deadline and past a keepalive
    ping's whole course (this test's loop is the hub's) while grpc-core's threads still answer
    the transport's pings: a real Node process
    on a one-way quiet link stays, so a held Edge loop does not make a fleet leave. With an
    Edge that beats on quiet links (as one that predates one-way links does) the Node judges it
    by the deadline, leaves and redials."""
    if not one_way:

        def beating(**options: Any) -> NodeSession:
            return NodeSession(**{**options, "quiet_one_way": False})

        monkeypatch.setattr(nodehub, "NodeSession", beating)
    hub = await start_hub(
        wire_config([{"id": "p1", "adapter": {"type": "fake"}}], edge={"node_link": QUIET})
    )
    token_file = tmp_path / "token"
    token_file.write_text(node_token + "\n")
    async with contextlib.AsyncExitStack() as stack:
        await iop_processes.node(stack, hub.port, "node-1", token_file)
        await until(hub.connected_providers, timeout=30)
        session = hub._sessions["node-1"]
        assert session.quiet_one_way is one_way
        await until(lambda: session.last_heartbeat is not None, timeout=10)

        time.sleep(14.0)  # the Edge's loop held past a ping's 10.5 s and its 3 s for an ack
        released = time.monotonic()

        if not one_way:
            await until(lambda: hub.sessions_opened == 2, timeout=30)
            assert hub.silent_nodes == 0  # the Node left; the hub judged nobody
            return
        # The Node's beats go on in the same session, and it serves a run there.
        await until(lambda: (session.last_heartbeat or 0.0) > released, timeout=10)
        body = orjson.dumps({"model": "served", "messages": [{"role": "user", "content": "hi"}]})
        async with hub.run(RunRequest("r1", "p1", "served", "chat", body, False)) as stream:
            events = [event async for event in stream]
        assert isinstance(events[-1], RunDone)
        assert hub.sessions_opened == 1 and hub._sessions["node-1"] is session
        assert not session.closing.done()
