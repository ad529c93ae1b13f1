"""The adapters against a real fake upstream: events, usage handling and every failure mapped."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from iop.edgeconfig import FakeAdapter, OpenAIAdapter
from iop.node import FakeGenerator, OpenAIHttpAdapter
from iop.upstream import FakeUpstream, tokens
from iop.wire import RunChunk, RunDone, RunEvent, RunFailed, RunRequest, RunUsage, statuses

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

MESSAGES = [{"role": "user", "content": "hello"}]


def request(
    stream: bool, *, deadline: float | None = None, kind: str = "chat", **body: Any
) -> RunRequest:
    document: dict[str, Any] = {"model": "served", "stream": stream, **body}
    if kind == "chat":
        document["messages"] = MESSAGES
    else:
        document["prompt"] = "hello"
    return RunRequest("r1", "p1", "served", kind, orjson.dumps(document), stream, deadline)  # type: ignore[arg-type]


async def collect(adapter: Any, run: RunRequest) -> list[RunEvent]:
    return [event async for event in adapter.run(run)]


@pytest.fixture
async def adapter(fake_upstream: FakeUpstream):
    adapter = OpenAIHttpAdapter(
        "p1", OpenAIAdapter(base_url=fake_upstream.base_url, request_timeout_s=2)
    )
    yield adapter
    await adapter.aclose()


async def test_non_streaming_run(adapter: OpenAIHttpAdapter) -> None:
    events = await collect(adapter, request(False, max_tokens=3))
    chunk, usage, done = events
    assert isinstance(chunk, RunChunk)
    body = orjson.loads(chunk.data)
    assert body["choices"][0]["message"]["content"] == "".join(tokens(3))
    assert usage == RunUsage(body["usage"]["prompt_tokens"], 3, body["usage"]["total_tokens"])
    assert done == RunDone("length")


async def test_stream_strips_the_usage_chunk_the_client_did_not_ask_for(
    adapter: OpenAIHttpAdapter,
) -> None:
    events = await collect(adapter, request(True, max_tokens=2))
    chunks = [e for e in events if isinstance(e, RunChunk)]
    assert len(chunks) == 1 + 2 + 1
    assert not any(e.usage_only for e in chunks)
    assert all(orjson.loads(c.data)["choices"] for c in chunks)
    assert isinstance(events[-2], RunUsage) and events[-2].completion_tokens == 2
    assert events[-1] == RunDone("length")


async def test_stream_forwards_the_usage_chunk_marked_when_asked(
    adapter: OpenAIHttpAdapter,
) -> None:
    events = await collect(
        adapter, request(True, max_tokens=2, stream_options={"include_usage": True})
    )
    usage_chunk = events[-3]
    assert isinstance(usage_chunk, RunChunk) and usage_chunk.usage_only
    assert orjson.loads(usage_chunk.data)["choices"] == []
    assert isinstance(events[-2], RunUsage)


async def test_completions_stream(adapter: OpenAIHttpAdapter) -> None:
    events = await collect(adapter, request(True, kind="completion", max_tokens=2))
    texts = [orjson.loads(e.data)["choices"][0]["text"] for e in events if isinstance(e, RunChunk)]
    assert "".join(texts) == "".join(tokens(2))


@pytest.mark.parametrize(
    ("hook", "code", "retryable", "words"),
    [
        pytest.param(
            {"fail": "status", "status": 500}, "upstream_error", False, "HTTP 500", id="500"
        ),
        pytest.param(
            {"fail": "status", "status": 429}, "upstream_rate_limited", True, "HTTP 429", id="429"
        ),
        pytest.param({"fail": "drop"}, "upstream_error", False, "dropped", id="drop"),
        pytest.param(
            {"fail": "drop-mid-stream"}, "upstream_error", False, "dropped", id="drop-mid"
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_upstream_failures_become_clear_run_errors(
    adapter: OpenAIHttpAdapter,
    hook: dict[str, Any],
    code: str,
    retryable: bool,
    words: str,
    stream: bool,
) -> None:
    events = await collect(adapter, request(stream, fake_upstream=hook))
    failed = events[-1]
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.retryable) == (code, retryable)
    assert words in failed.message


async def test_an_upstream_that_goes_silent_times_out(fake_upstream: FakeUpstream) -> None:
    adapter = OpenAIHttpAdapter(
        "p1", OpenAIAdapter(base_url=fake_upstream.base_url, request_timeout_s=0.2)
    )
    try:
        events = await collect(adapter, request(False, fake_upstream={"latency_ms": 2000}))
    finally:
        await adapter.aclose()
    assert isinstance(events[-1], RunFailed)
    assert events[-1].code == statuses.UPSTREAM_TIMEOUT
    assert "sent nothing for 0.2s" in events[-1].message


async def test_the_run_deadline_is_enforced(adapter: OpenAIHttpAdapter) -> None:
    run = request(True, deadline=time.time() + 0.2, fake_upstream={"tokens_per_second": 5})
    events = await collect(adapter, run)
    assert isinstance(events[-1], RunFailed)
    assert events[-1].code == statuses.UPSTREAM_TIMEOUT
    assert any(isinstance(e, RunChunk) for e in events)


async def test_an_unreachable_upstream_is_retryable() -> None:
    adapter = OpenAIHttpAdapter("p1", OpenAIAdapter(base_url="http://127.0.0.1:9/v1"))
    try:
        events = await collect(adapter, request(False))
    finally:
        await adapter.aclose()
    assert isinstance(events[-1], RunFailed)
    assert (events[-1].code, events[-1].retryable) == (statuses.UPSTREAM_UNAVAILABLE, True)


async def test_a_missing_api_key_variable_makes_the_provider_unhealthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("IOP_TEST_MISSING_KEY", raising=False)
    adapter = OpenAIHttpAdapter(
        "p1", OpenAIAdapter(base_url="http://127.0.0.1:9/v1", api_key_env="IOP_TEST_MISSING_KEY")
    )
    try:
        assert not adapter.health.healthy
        assert adapter.health.detail == "environment variable IOP_TEST_MISSING_KEY is not set"
        events = await collect(adapter, request(False))
    finally:
        await adapter.aclose()
    assert isinstance(events[-1], RunFailed) and events[-1].code == statuses.PROVIDER_UNHEALTHY


async def test_the_fake_adapter_answers_like_the_fake_upstream(adapter: OpenAIHttpAdapter) -> None:
    fake = FakeGenerator("p1", FakeAdapter(completion_tokens=5))
    run = request(True, stream_options={"include_usage": True})
    local = await collect(fake, run)
    remote = await collect(adapter, run)

    def shape(events: list[RunEvent]) -> list[Any]:
        out: list[Any] = []
        for event in events:
            if isinstance(event, RunChunk):
                document = orjson.loads(event.data)
                out.append((document["choices"], event.usage_only))
            elif not isinstance(event, RunUsage):
                out.append(event)
        return out

    assert shape(local) == shape(remote)[:1] + shape(remote)[1:6] + shape(remote)[-3:]
    assert len(shape(local)) == 1 + 5 + 1 + 1 + 1


async def test_the_fake_adapter_paces_tokens() -> None:
    fake = FakeGenerator(
        "p1", FakeAdapter(latency_ms=50, tokens_per_second=100, completion_tokens=5)
    )
    start = time.perf_counter()
    events = await collect(fake, request(False))
    assert time.perf_counter() - start >= 0.09
    assert isinstance(events[-1], RunDone)
