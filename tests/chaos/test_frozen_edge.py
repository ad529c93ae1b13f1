"""A frozen Edge (SIGSTOP on a real `iop edge run`) is detected by its Nodes: they cancel its runs
(freeing their capacity for the other Edges), keep serving the other Edge, and reconnect when it
comes back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx
import pytest
import yaml

from iop.node import NodeAgent
from testkit import CLIENT_TOKEN

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

SLACK_S = 5.0


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
