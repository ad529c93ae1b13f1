"""Stream clients that read slowly or not at all pin neither a slot nor memory.

Every per-run buffer is bounded: past `openai.stream_buffer_bytes` the Edge pauses the run on its
Node, which stops reading the upstream (backpressure down to the model server). A run that ended
on its Node gives its slot back even while its client has not read the end yet, and a client
that reads nothing for `openai.send_timeout_ms` is cut, which cancels its run.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest
import yaml

from iop.processes import spawn_fake_upstream
from testkit import CLIENT_TOKEN, node_token_of

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]


async def test_a_run_that_ended_frees_its_slot_while_its_client_reads_nothing(
    document_of, kit, start_edge, start_node, until
) -> None:
    document = document_of(
        [
            {
                "id": "p1",
                "adapter": {"type": "fake", "completion_tokens": 60_000},
                "served_models": ["served"],
                "capacity": 1,
            }
        ],
        # The whole answer (about 11 MB: more than the kernel's socket buffers hold) fits the
        # Edge's buffer for its client.
        openai={"stream_buffer_bytes": 32 * 1024 * 1024},
        edge={"admin": {"listen": "127.0.0.1:0"}},
    )
    edge = await start_edge(document)
    await start_node(edge.hub)
    await until(lambda: edge.dispatcher.available == {"p1"})
    reader, writer = await kit.open_stream(edge.url, 60_000, receive_buffer=4096)
    try:
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
        # The run ends on the Node long before its client reads it: the slot is free again.
        await until(lambda: edge.dispatcher.in_flight("p1") == 0, timeout=30)
        assert not reader.at_eof()
        async with httpx.AsyncClient(
            base_url=edge.url, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, timeout=30
        ) as http:
            answer = await http.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert answer.status_code == 200, answer.text
    finally:
        writer.close()


async def test_stopped_and_slow_readers_keep_memory_bounded_and_others_are_served(
    document_of, kit, iop_processes, until, tmp_path: Path
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        # A fast model: 20,000 tokens a second (about 3.6 MB/s of SSE per stream), answers of
        # up to 200,000 tokens.
        upstream = await stack.enter_async_context(
            spawn_fake_upstream(["--tokens-per-second", "20000", "--completion-tokens", "200000"])
        )
        document = document_of(
            [
                {
                    "id": "p1",
                    "adapter": {"type": "openai", "base_url": upstream.base_url},
                    "served_models": ["served"],
                    "capacity": 4,
                }
            ],
            # No client is cut here, nor its run stopped: what is measured is what the Edge and
            # the Node hold for paused runs.
            openai={"send_timeout_ms": 120_000, "stream_stall_timeout_ms": 120_000},
            edge={"admin": {"listen": "127.0.0.1:0"}},
        )
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        (tmp_path / "node.token").write_text(node_token_of("node-1"))
        edge_process, started = await iop_processes.edge(stack, tmp_path / "edge.yaml")
        node = await iop_processes.node(
            stack, started["hub_port"], "node-1", tmp_path / "node.token"
        )
        await iop_processes.wait_available(started["url"], ["p1"])
        http = await stack.enter_async_context(
            httpx.AsyncClient(
                base_url=started["url"], headers={"authorization": f"Bearer {CLIENT_TOKEN}"}
            )
        )
        warm_up = await kit.chat(http, stream=True, max_tokens=50)  # both processes warm
        assert kit.stream_ok(*warm_up)
        before = {"edge": kit.rss_mb(edge_process.pid), "node": kit.rss_mb(node.pid)}
        peak = dict(before)

        def sample() -> None:
            peak["edge"] = max(peak["edge"], kit.rss_mb(edge_process.pid))
            peak["node"] = max(peak["node"], kit.rss_mb(node.pid))

        # Answers of about 35 MB each: two clients stop reading, one reads 2 KB a second.
        stopped = [await kit.open_stream(started["url"], 200_000) for _ in range(2)]
        slow_reader, slow_writer = await kit.open_stream(started["url"], 200_000)
        read = 0

        async def read_slowly() -> None:
            nonlocal read
            while chunk := await slow_reader.read(2048):
                read += len(chunk)
                await asyncio.sleep(1.0)

        reading = asyncio.create_task(read_slowly())
        try:
            # For as long as the slow reader takes 16 KB (some 8 s: about 30 MB of answer per
            # stream from the model), memory is sampled; another client is served meanwhile.
            served = asyncio.create_task(kit.chat(http, stream=True, max_tokens=50))

            def progressed() -> bool:
                sample()
                return read >= 16 * 1024

            await until(progressed, timeout=60, interval=0.25)
            status, text = await served
            assert kit.stream_ok(status, text), text[-300:]
        finally:
            reading.cancel()
            slow_writer.close()
            for _, writer in stopped:
                writer.close()
        grown = {name: peak[name] - before[name] for name in before}
        # Unbounded buffering holds what the model wrote (some 100 MB) in each process.
        assert grown["edge"] < 48, f"Edge grew {grown['edge']:.0f} MB ({before} -> {peak})"
        assert grown["node"] < 48, f"Node grew {grown['node']:.0f} MB ({before} -> {peak})"


async def test_a_client_that_reads_nothing_is_cut_and_its_slot_serves_another(
    document_of, kit, start_edge, start_node, until
) -> None:
    document = document_of(
        [
            {
                "id": "p1",
                "adapter": {"type": "fake", "completion_tokens": 200_000},
                "served_models": ["served"],
                "capacity": 1,
            }
        ],
        openai={"send_timeout_ms": 2000},
        edge={"admin": {"listen": "127.0.0.1:0"}},
    )
    edge = await start_edge(document)
    await start_node(edge.hub)
    await until(lambda: edge.dispatcher.available == {"p1"})
    server = edge.http_server
    assert server is not None
    reader, writer = await kit.open_stream(edge.url, 200_000, receive_buffer=4096)
    try:
        assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
        # It holds the only slot (its answer is far larger than every buffer) until it is cut.
        await until(lambda: server.refusals.counts["send_timeout"] == 1, timeout=30)
        await until(lambda: edge.dispatcher.in_flight("p1") == 0, timeout=10)
        async with httpx.AsyncClient(
            base_url=edge.url, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, timeout=30
        ) as http:
            answer = await http.post(
                "/v1/chat/completions",
                json={
                    "model": "m",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                },
            )
        assert answer.status_code == 200, answer.text
    finally:
        writer.close()
