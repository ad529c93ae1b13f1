"""The Node reads a model server's load from its /metrics (vLLM's names) after each passing
probe, and hands it to the heartbeats; a server without those metrics costs one read a minute."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from iop.edgeconfig import node_payloads
from iop.fakes import FakeUpstream, FakeUpstreamSettings, GpuSettings
from iop.providers import Runner
from iop.providers.probing import Prober, ProbeTarget, metrics_url, read_server_load
from iop.wire.nodestates import ServerLoad

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 4.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.5
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 1234.0
process_resident_memory_bytes 1.2e9
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(VLLM_TEXT, ServerLoad(5, 4, 0.5), id="two-engines"),
        pytest.param(
            "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.75\n",
            ServerLoad(1, 0, 0.75),
            id="older-vllm-no-labels",
        ),
        pytest.param('vllm:num_requests_waiting{a="}"} 7\n', ServerLoad(0, 7, 0.0), id="brace"),
        pytest.param("tgi_queue_size 3\n# vllm:num_requests_waiting 9\n", None, id="not-vllm"),
        pytest.param("vllm:num_requests_running{} NaN-ish\n", None, id="garbage"),
    ],
)
def test_a_servers_load_is_read_from_vllms_metrics(text: str, expected: ServerLoad | None) -> None:
    assert read_server_load(text) == expected


LORA_TEXT = """\
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora",waiting_lora_adapters=""} \
1.7645e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora,chat-lora",\
waiting_lora_adapters="law-lora"} 1.7646e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7644e+09
""".replace("\\\n", "")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            LORA_TEXT,
            ServerLoad(3, 1, 0.0, 0, 0, ("sql-lora", "chat-lora"), ("law-lora",), 2),
            id="latest-sample-wins",
        ),
        pytest.param(
            'vllm:num_requests_running 0\nvllm:lora_requests_info{max_lora="4",'
            'running_lora_adapters="",waiting_lora_adapters=""} 1.7e9\n',
            ServerLoad(0, 0, 0.0, max_loras=4),
            id="idle",
        ),
        pytest.param(
            "vllm:num_requests_running 2\nvllm:lora_requests_info{running_lora_adapters="
            '" a\\"b , c ",waiting_lora_adapters=",,",max_lora="x"} 1\n',
            ServerLoad(2, 0, 0.0, running_adapters=('a"b', "c")),
            id="escaped-spaced-bad-max",
        ),
        pytest.param(
            "vllm:num_requests_running 2\n",
            ServerLoad(2, 0, 0.0),
            id="no-lora",
        ),
    ],
)
def test_a_servers_adapters_are_read_from_lora_requests_info(
    text: str, expected: ServerLoad
) -> None:
    load = read_server_load(text)
    assert load == expected
    assert load.active_adapters == set(expected.running_adapters) | set(expected.waiting_adapters)


def test_metrics_are_read_on_the_servers_host() -> None:
    assert metrics_url("http://gpu-1:8000/v1") == "http://gpu-1:8000/metrics"
    assert metrics_url("https://u:p@h/openai/v1/") == "https://u:p@h/metrics"


@pytest.fixture
async def gpu_upstream() -> AsyncIterator[FakeUpstream]:
    settings = GpuSettings(max_batch=1, step_ms=1000)  # slow steps: the queue stays put
    async with FakeUpstream(FakeUpstreamSettings(gpu=settings)) as upstream:
        yield upstream


async def test_the_runner_reports_what_the_server_says(
    gpu_upstream: FakeUpstream, wire_config: Callable[..., Any], until
) -> None:
    engine = gpu_upstream.engine
    assert engine is not None
    for _ in range(3):
        engine.submit(b"queued " * 40, 5)
    engine.step()  # one runs, two wait
    provider = {
        "id": "p1",
        "adapter": {"type": "openai", "base_url": gpu_upstream.base_url},
        "health": {"interval_ms": 100},
    }
    runner = Runner()
    try:
        runner.apply(node_payloads(wire_config([provider]))["node-1"])
        await until(lambda: "p1" in runner.server_loads())
        load = runner.server_loads()["p1"]
        assert (load.running, load.waiting) == (1, 2)
        assert 0 < load.kv_cache_usage <= 1
        assert load.age_s < 5
    finally:
        await runner.aclose()


async def test_a_server_without_vllm_metrics_is_asked_once_a_minute(until) -> None:
    paths: Counter[str] = Counter()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                path = line.split()[1].decode()
                while (await reader.readline()).strip():
                    pass
                paths[path] += 1
                status = b"200 OK" if path == "/v1/models" else b"404 Not Found"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loads: list[tuple[str, ServerLoad]] = []
    prober = Prober(lambda pid, failure: None, lambda pid, load: loads.append((pid, load)))
    try:
        base = f"http://127.0.0.1:{port}"
        target = ProbeTarget("p1", f"{base}/v1/models", 0.05, 1.0, {}, f"{base}/metrics")
        prober.watch({"p1": target})
        await until(lambda: paths["/v1/models"] >= 10)
    finally:
        await prober.aclose()
        server.close()
        await server.wait_closed()
    assert paths["/metrics"] == 1
    assert loads == []
