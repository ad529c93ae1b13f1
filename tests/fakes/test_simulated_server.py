"""The fake upstream with a simulated GPU server (`--gpu`), over HTTP, driven by the official
openai client: what a gateway in front of it sees (cached prompt tokens in the usage, vLLM's
metrics, a client that leaves freeing its place)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from iop.fakes import FakeUpstream, FakeUpstreamSettings, GpuSettings, tokens
from iop.fakes.simulating import render_answer, render_chat
from iop.processes import iop_command, spawn_fake_upstream

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

SYSTEM = "Answer as a patient teacher would, step by step. " * 30


@pytest.fixture
async def gpu_upstream() -> AsyncIterator[FakeUpstream]:
    settings = GpuSettings(step_ms=2, step_ms_per_seq=0.1, prefill_tokens_per_s=200_000)
    async with FakeUpstream(FakeUpstreamSettings(models=("served",), gpu=settings)) as upstream:
        yield upstream


async def test_a_conversations_second_turn_is_served_from_the_prefix_cache(
    gpu_upstream: FakeUpstream,
) -> None:
    async with openai.AsyncOpenAI(
        base_url=gpu_upstream.base_url, api_key="unused", max_retries=0
    ) as client:
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is a prefix cache?"},
        ]
        first = await client.chat.completions.create(
            model="served", messages=messages, max_tokens=5
        )
        assert first.choices[0].message.content == "".join(tokens(5))
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And why does it matter?"},
        ]
        stream = await client.chat.completions.create(
            model="served",
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(tokens(4))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    # Every full block of the first turn, its prompt and its answer, was cached.
    first_turn = render_chat(messages[:2]) + render_answer("".join(tokens(5)))
    assert usage.prompt_tokens_details.cached_tokens == len(first_turn) // (16 * 4) * 16
    assert usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens - 16
    assert usage.completion_tokens == 4


async def test_metrics_are_served_under_vllms_names(gpu_upstream: FakeUpstream) -> None:
    async with httpx.AsyncClient() as http:
        await http.post(
            f"{gpu_upstream.base_url}/completions",
            json={"model": "served", "prompt": "x" * 400, "max_tokens": 2},
        )
        response = await http.get(f"http://{gpu_upstream.address}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    labels = '{engine="0",model_name="served"}'
    assert f"vllm:num_requests_running{labels} 0" in text
    assert f"vllm:num_requests_waiting{labels} 0" in text
    assert f"vllm:prefix_cache_queries_total{labels} 100" in text
    assert f"vllm:request_success_total{labels} 1" in text


async def test_a_client_that_leaves_frees_its_place_in_the_batch(until) -> None:
    settings = GpuSettings(step_ms=20, step_ms_per_seq=0, max_batch=1)
    async with (
        FakeUpstream(FakeUpstreamSettings(gpu=settings)) as upstream,
        httpx.AsyncClient(base_url=upstream.base_url) as http,
    ):
        body = {"model": "m", "prompt": "go", "max_tokens": 10_000, "stream": True}
        async with http.stream("POST", "/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                break
        engine = upstream.engine
        assert engine is not None
        await until(lambda: engine.running == 0 and upstream.stats.in_flight == 0)
        assert upstream.stats.disconnects == 1
        # The batch of one is free for the next request, which completes.
        answer = await http.post("/completions", json={"model": "m", "prompt": "go"})
        assert answer.status_code == 200


async def test_a_full_batch_queues_and_reports_the_queue(until) -> None:
    settings = GpuSettings(step_ms=50, step_ms_per_seq=0, max_batch=2)
    async with (
        FakeUpstream(FakeUpstreamSettings(gpu=settings)) as upstream,
        httpx.AsyncClient(base_url=upstream.base_url, timeout=30) as http,
    ):
        engine = upstream.engine
        assert engine is not None
        body = {"model": "m", "prompt": "go", "max_tokens": 3}
        requests = [asyncio.ensure_future(http.post("/completions", json=body)) for _ in range(5)]
        await until(lambda: engine.running + engine.waiting == 5)
        assert engine.running <= 2
        metrics = await http.get(f"http://{upstream.address}/metrics")
        assert 'vllm:num_requests_running{engine="0",model_name="fake-model"} 2' in metrics.text
        answers = await asyncio.gather(*requests)
    assert [a.status_code for a in answers] == [200] * 5
    assert upstream.stats.peak_in_flight == 5


async def test_the_command_takes_the_gpu_flags_and_refuses_bad_ones() -> None:
    async with (
        spawn_fake_upstream(["--gpu", "--gpu-max-batch", "3", "--seed", "4"]) as process,
        httpx.AsyncClient() as http,
    ):
        metrics = await http.get(f"http://{process.listen}/metrics")
    assert metrics.status_code == 200
    assert "vllm:num_requests_waiting" in metrics.text
    refused = await asyncio.create_subprocess_exec(
        *iop_command(),
        *("fake-upstream", "--listen", "127.0.0.1:0", "--gpu", "--gpu-max-batch", "0"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await refused.communicate()
    assert refused.returncode == 2
    assert out == b""
    assert b"--gpu-*: max_batch must be >= 1, got 0" in err


async def test_without_gpu_there_are_no_metrics(fake_upstream: FakeUpstream) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.get(f"http://{fake_upstream.address}/metrics")
    assert response.status_code == 404


async def test_a_reset_empties_the_cache_when_idle_and_waits_otherwise() -> None:
    settings = GpuSettings(step_ms=1, step_ms_per_seq=0)
    body = {"model": "m", "prompt": SYSTEM, "max_tokens": 2}
    async with (
        FakeUpstream(FakeUpstreamSettings(gpu=settings)) as upstream,
        httpx.AsyncClient(base_url=upstream.base_url) as http,
    ):
        await http.post("/completions", json=body)
        assert upstream.engine is not None and upstream.engine.cached_blocks > 0
        slow = asyncio.ensure_future(http.post("/completions", json={**body, "max_tokens": 10_000}))
        while not upstream.stats.in_flight:
            await asyncio.sleep(0.01)
        busy = await http.post(f"http://{upstream.address}/fake/reset")
        assert busy.status_code == 409
        slow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await slow
        while upstream.stats.in_flight:
            await asyncio.sleep(0.01)
        done = await http.post(f"http://{upstream.address}/fake/reset")
        assert done.status_code == 200
        assert upstream.engine.cached_blocks == 0 and upstream.stats.completions == 0
        again = await http.post("/completions", json=body)
        assert again.status_code == 200


async def test_adapters_are_listed_served_loaded_and_reported() -> None:
    settings = GpuSettings(
        step_ms=2, step_ms_per_seq=0, lora_adapters="sql,chat", max_loras=1, lora_load_ms=1
    )
    async with (
        FakeUpstream(FakeUpstreamSettings(models=("base",), gpu=settings)) as upstream,
        openai.AsyncOpenAI(base_url=upstream.base_url, api_key="unused", max_retries=0) as client,
        httpx.AsyncClient() as http,
    ):
        listed = {model.id: model.model_dump() for model in (await client.models.list()).data}
        assert set(listed) == {"base", "sql", "chat"}
        assert listed["sql"]["parent"] == "base" and listed["sql"]["root"] == "/adapters/sql"
        assert "parent" not in listed["base"]
        for adapter in ("sql", "chat", "sql"):
            answer = await client.completions.create(model=adapter, prompt="hi", max_tokens=2)
            assert answer.model == adapter
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="law", prompt="hi", max_tokens=2)
        stats = (await http.get(f"http://{upstream.address}/fake/stats")).json()
        assert (stats["adapter_loads"], stats["adapter_swaps"]) == (3, 2)  # one slot
        metrics = (await http.get(f"http://{upstream.address}/metrics")).text
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",' in metrics


async def test_a_priority_is_refused_first_come_first_served_and_ordered_by_priority(
    gpu_upstream: FakeUpstream, until
) -> None:
    # As vLLM: a nonzero `priority` needs --scheduling-policy priority; 0 is always fine.
    async with openai.AsyncOpenAI(base_url=gpu_upstream.base_url, api_key="k") as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(
                model="served", prompt="go", max_tokens=2, extra_body={"priority": 3}
            )
        assert "Got priority 3 but Priority scheduling is not enabled." in str(refused.value)
        done = await client.completions.create(
            model="served", prompt="go", max_tokens=2, extra_body={"priority": 0}
        )
        assert done.choices[0].text
    # With it, a batch of one: a request of priority 0 sent while one of priority 1 runs is
    # answered first, the other preempted and finished after it.
    settings = GpuSettings(step_ms=20, step_ms_per_seq=0, max_batch=1, scheduling_policy="priority")
    async with (
        FakeUpstream(FakeUpstreamSettings(gpu=settings)) as upstream,
        openai.AsyncOpenAI(base_url=upstream.base_url, api_key="k") as client,
    ):
        engine = upstream.engine
        assert engine is not None
        finished: list[str] = []

        async def complete(name: str, priority: int, tokens: int) -> None:
            await client.completions.create(
                model="fake-model",
                prompt=name,
                max_tokens=tokens,
                extra_body={"priority": priority},
            )
            finished.append(name)

        background = asyncio.ensure_future(complete("batch", 1, 30))
        await until(lambda: engine.running == 1)
        await complete("urgent", 0, 2)
        await background
        assert finished == ["urgent", "batch"]
        assert engine.preemptions == 1
