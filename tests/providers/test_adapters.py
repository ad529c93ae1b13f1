"""The adapters against a real fake upstream: events, usage handling and every failure mapped."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
import pytest

from iop.edgeconfig import FakeAdapterSettings, OpenAIAdapterSettings, parse_policy
from iop.fakes import FakeUpstream, tokens
from iop.providers import FakeAdapter, OpenAIAdapter
from iop.wire import RunChunk, RunDone, RunEvent, RunFailed, RunRequest, RunUsage, statuses

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

MESSAGES = [{"role": "user", "content": "hello"}]


def request(
    stream: bool,
    *,
    deadline: float | None = None,
    kind: str = "chat",
    sse: bool = False,
    **body: Any,
) -> RunRequest:
    document: dict[str, Any] = {"model": "served", "stream": stream, **body}
    if kind == "chat":
        document["messages"] = MESSAGES
    else:
        document["prompt"] = "hello"
    return RunRequest(
        "r1",
        "p1",
        "served",
        kind,  # type: ignore[arg-type]
        orjson.dumps(document),
        stream,
        deadline,
        sse_chunks=sse,
    )


async def collect(adapter: Any, run: RunRequest) -> list[RunEvent]:
    return [event async for event in adapter.run(run)]


def client_bytes(events: Sequence[RunEvent], include_usage: bool = False) -> bytes:
    """What the Edge writes to the client for a stream's chunks (before its `[DONE]`)."""
    return b"".join(
        event.data if event.sse else b"data: " + event.data + b"\n\n"
        for event in events
        if isinstance(event, RunChunk) and (include_usage or not event.usage_only)
    )


def same_but_ids(passed: bytes, per_event: bytes) -> bool:
    """Two streams' client bytes are the same events, framed alike, but for the ids and times
    each answer of the fake upstream gets."""

    def events(data: bytes) -> list[Any]:
        assert data.endswith(b"\n\n") and all(
            event.startswith(b"data: {") and b"\n" not in event
            for event in data[:-2].split(b"\n\n")
        )
        documents = [orjson.loads(event[6:]) for event in data[:-2].split(b"\n\n")]
        return [{k: v for k, v in d.items() if k not in ("id", "created")} for d in documents]

    return events(passed) == events(per_event)


def ends(events: Sequence[RunEvent]) -> list[RunEvent]:
    return [event for event in events if not isinstance(event, RunChunk)]


@pytest.fixture
async def adapter(fake_upstream: FakeUpstream):
    adapter = OpenAIAdapter(
        "p1", OpenAIAdapterSettings(base_url=fake_upstream.base_url, request_timeout_s=2)
    )
    yield adapter
    await adapter.aclose()


async def test_non_streaming_run(adapter: OpenAIAdapter) -> None:
    events = await collect(adapter, request(False, max_tokens=3))
    chunk, usage, done = events
    assert isinstance(chunk, RunChunk)
    body = orjson.loads(chunk.data)
    assert body["choices"][0]["message"]["content"] == "".join(tokens(3))
    assert usage == RunUsage(body["usage"]["prompt_tokens"], 3, body["usage"]["total_tokens"])
    assert done == RunDone("length")


async def test_stream_strips_the_usage_chunk_the_client_did_not_ask_for(
    adapter: OpenAIAdapter,
) -> None:
    events = await collect(adapter, request(True, max_tokens=2))
    chunks = [e for e in events if isinstance(e, RunChunk)]
    assert len(chunks) == 1 + 2 + 1
    assert not any(e.usage_only for e in chunks)
    assert all(orjson.loads(c.data)["choices"] for c in chunks)
    assert isinstance(events[-2], RunUsage) and events[-2].completion_tokens == 2
    assert events[-1] == RunDone("length")


async def test_stream_forwards_the_usage_chunk_marked_when_asked(
    adapter: OpenAIAdapter,
) -> None:
    events = await collect(
        adapter, request(True, max_tokens=2, stream_options={"include_usage": True})
    )
    usage_chunk = events[-3]
    assert isinstance(usage_chunk, RunChunk) and usage_chunk.usage_only
    assert orjson.loads(usage_chunk.data)["choices"] == []
    assert isinstance(events[-2], RunUsage)


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "hook", [{}, {"tokens_per_second": 2000}], ids=["one-burst", "a-write-per-token"]
)
async def test_a_passed_through_stream_reaches_the_client_byte_for_byte(
    adapter: OpenAIAdapter, include_usage: bool, kind: str, hook: dict[str, Any]
) -> None:
    options: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
    run = request(True, kind=kind, max_tokens=12, fake_upstream=hook, **options)
    per_event = await collect(adapter, run)
    passed = await collect(adapter, dataclasses.replace(run, sse_chunks=True))
    assert same_but_ids(client_bytes(passed, include_usage), client_bytes(per_event, include_usage))
    assert all(e.sse for e in passed if isinstance(e, RunChunk))
    assert (b'"choices":[]' in client_bytes(passed)) is include_usage
    assert ends(passed) == ends(per_event)
    usage, done = ends(passed)
    assert isinstance(usage, RunUsage) and usage.completion_tokens == 12
    assert done == RunDone("length")
    if not hook:  # one upstream write: a read or two, each one chunk of many events
        assert len(passed) - 2 <= 2


async def test_passed_through_chunks_keep_to_the_runs_bound(adapter: OpenAIAdapter) -> None:
    run = request(True, max_tokens=16, stream_options={"include_usage": True})
    bounded = dataclasses.replace(run, max_response_bytes=1024)
    per_event = await collect(adapter, bounded)
    passed = await collect(adapter, dataclasses.replace(bounded, sse_chunks=True))
    chunks = [e for e in passed if isinstance(e, RunChunk)]
    assert all(len(c.data) <= 1024 for c in chunks) and len(chunks) > 1
    assert same_but_ids(client_bytes(passed, True), client_bytes(per_event, True))
    assert ends(passed) == ends(per_event)


async def test_completions_stream(adapter: OpenAIAdapter) -> None:
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
    adapter: OpenAIAdapter,
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
    adapter = OpenAIAdapter(
        "p1", OpenAIAdapterSettings(base_url=fake_upstream.base_url, request_timeout_s=0.2)
    )
    try:
        events = await collect(adapter, request(False, fake_upstream={"latency_ms": 2000}))
    finally:
        await adapter.aclose()
    assert isinstance(events[-1], RunFailed)
    assert events[-1].code == statuses.UPSTREAM_TIMEOUT
    assert "sent nothing for 0.2s" in events[-1].message


async def test_the_run_deadline_is_enforced(adapter: OpenAIAdapter) -> None:
    run = request(True, deadline=time.time() + 0.2, fake_upstream={"tokens_per_second": 5})
    events = await collect(adapter, run)
    assert isinstance(events[-1], RunFailed)
    assert events[-1].code == statuses.UPSTREAM_TIMEOUT
    assert any(isinstance(e, RunChunk) for e in events)


async def test_an_unreachable_upstream_is_retryable() -> None:
    adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url="http://127.0.0.1:9/v1"))
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
    adapter = OpenAIAdapter(
        "p1",
        OpenAIAdapterSettings(base_url="http://127.0.0.1:9/v1", api_key_env="IOP_TEST_MISSING_KEY"),
    )
    try:
        assert not adapter.health.healthy
        assert adapter.health.detail == "environment variable IOP_TEST_MISSING_KEY is not set"
        events = await collect(adapter, request(False))
    finally:
        await adapter.aclose()
    assert isinstance(events[-1], RunFailed) and events[-1].code == statuses.PROVIDER_UNHEALTHY


async def test_sequential_runs_reuse_one_upstream_connection(
    adapter: OpenAIAdapter, fake_upstream: FakeUpstream
) -> None:
    for index in range(30):
        events = await collect(adapter, request(index % 2 == 0, max_tokens=2))
        assert isinstance(events[-1], RunDone)
    assert fake_upstream.stats.connections == 1


async def test_concurrent_runs_share_a_pool_of_connections(
    adapter: OpenAIAdapter, fake_upstream: FakeUpstream
) -> None:
    for _ in range(5):
        runs = [collect(adapter, request(index % 2 == 0, max_tokens=2)) for index in range(8)]
        for events in await asyncio.gather(*runs):
            assert isinstance(events[-1], RunDone)
    assert fake_upstream.stats.completed == 40
    assert fake_upstream.stats.connections <= 8


async def test_cancelling_a_run_closes_its_upstream_connection_at_once(
    adapter: OpenAIAdapter, fake_upstream: FakeUpstream, until
) -> None:
    first = asyncio.Event()

    async def consume() -> None:
        async for event in adapter.run(request(True, fake_upstream={"tokens_per_second": 5})):
            if isinstance(event, RunChunk):
                first.set()

    running = asyncio.create_task(consume())
    await first.wait()
    cancelled = time.monotonic()
    running.cancel()
    await asyncio.wait([running])
    await until(lambda: fake_upstream.stats.disconnects == 1, timeout=2)
    assert time.monotonic() - cancelled < 0.5
    assert fake_upstream.stats.in_flight == 0
    events = await collect(adapter, request(False))  # the pool replaced the closed connection
    assert isinstance(events[-1], RunDone)
    assert fake_upstream.stats.connections == 2


async def test_a_full_pool_is_provider_busy(fake_upstream: FakeUpstream, until) -> None:
    settings = OpenAIAdapterSettings(
        base_url=fake_upstream.base_url, max_connections=1, request_timeout_s=0.3
    )
    adapter = OpenAIAdapter("p1", settings)
    slow = request(True, max_tokens=12, fake_upstream={"tokens_per_second": 20})
    try:
        holding = asyncio.create_task(collect(adapter, slow))
        await until(lambda: fake_upstream.stats.in_flight == 1)  # the pool's one connection
        waiting = await collect(adapter, request(False))
        assert isinstance((await holding)[-1], RunDone)
    finally:
        await adapter.aclose()
    failed = waiting[-1]
    assert isinstance(failed, RunFailed)
    assert (failed.code, failed.retryable) == (statuses.PROVIDER_BUSY, True)
    assert "all 1 connections to the upstream are busy" in failed.message


async def test_a_closed_adapter_refuses_runs(adapter: OpenAIAdapter) -> None:
    assert isinstance((await collect(adapter, request(False)))[-1], RunDone)
    await adapter.aclose()
    assert not adapter.health.healthy
    events = await collect(adapter, request(False))
    assert isinstance(events[-1], RunFailed) and events[-1].code == statuses.PROVIDER_UNHEALTHY


# -- SSE framing other servers use, from a raw upstream that sends prepared bytes ----------------


class RawUpstream:
    """Answers every request with `pieces`, written one at a time; keeps the request heads and
    counts the connections."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = pieces
        self.heads: list[bytes] = []
        self.connections = 0

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            length = next(
                int(line.split(b":")[1])
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            await reader.readexactly(length)
            for piece in self.pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.005)  # separate reads on the client's side
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def raw_upstream(pieces: Sequence[bytes]) -> AsyncIterator[tuple[RawUpstream, str]]:
    upstream = RawUpstream(pieces)
    server = await asyncio.start_server(upstream.answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield upstream, f"http://127.0.0.1:{port}/v1"
    finally:
        server.close()
        await server.wait_closed()


def sse_response(body: bytes, *, split_at: Sequence[int] = ()) -> list[bytes]:
    """An HTTP/1.1 SSE response closed by the server, its body cut at `split_at`."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    cuts = [0, *split_at, len(body)]
    return [head, *(body[a:b] for a, b in itertools.pairwise(cuts))]


def chunk(content: str, finish: str | None = None) -> bytes:
    delta = {"content": content}
    return orjson.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


USAGE = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}'


@pytest.mark.parametrize(
    ("body", "split_at"),
    [
        pytest.param(
            b"data: %s\n\ndata: %s\n\ndata: %s\n\ndata: [DONE]\n\n"
            % (chunk("a"), chunk("b", "stop"), USAGE),
            (),
            id="lf",
        ),
        pytest.param(
            b"data: %s\r\n\r\ndata: %s\r\n\r\ndata: %s\r\n\r\ndata: [DONE]\r\n\r\n"
            % (chunk("a"), chunk("b", "stop"), USAGE),
            (len(b"data: ") + 10, len(b"data: ") + len(chunk("a")) + 3),
            id="crlf-split-mid-event-and-mid-crlf",
        ),
        pytest.param(
            b"data: %s\r\n\r\ndata: %s\r\n\r\ndata: %s\r\n\r\ndata: [DONE]\r\n\r\n"
            % (chunk("a"), chunk("b", "stop"), USAGE),
            tuple(range(1, 300, 3)),
            id="crlf-in-pieces-of-three-bytes",
        ),
        pytest.param(
            b": keep-alive\n\nevent: message\nid: 1\ndata:%s\n\nretry: 5\n\ndata: %s\n\n"
            b"data: %s\n\ndata: [DONE]\n\n" % (chunk("a"), chunk("b", "stop"), USAGE),
            (7,),
            id="comments-and-other-fields",
        ),
        pytest.param(
            b"data: %s\n\ndata: %s\n\ndata: %s" % (chunk("a"), chunk("b", "stop"), USAGE),
            (),
            id="no-done-no-final-blank-line",
        ),
    ],
)
async def test_sse_framings_are_read_alike(body: bytes, split_at: Sequence[int]) -> None:
    async with raw_upstream(sse_response(body, split_at=split_at)) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            events = await collect(adapter, request(True))
        finally:
            await adapter.aclose()
    assert events == [
        RunChunk(chunk("a")),
        RunChunk(chunk("b", "stop")),
        RunUsage(3, 2, 5),
        RunDone("stop"),
    ]
    async with raw_upstream(sse_response(body, split_at=split_at)) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            passed = await collect(adapter, request(True, sse=True))
        finally:
            await adapter.aclose()
    assert client_bytes(passed) == b"data: %s\n\ndata: %s\n\n" % (chunk("a"), chunk("b", "stop"))
    assert ends(passed) == [RunUsage(3, 2, 5), RunDone("stop")]


@pytest.mark.parametrize("sse", [False, True], ids=["per-event", "passed-through"])
async def test_multi_line_data_is_joined_and_goes_out_on_one_line(sse: bool) -> None:
    # Framed as it came (a newline inside), the object would reach the client cut in two lines.
    body = b'data: {"choices":\ndata: [{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    async with raw_upstream(sse_response(body)) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            events = await collect(adapter, request(True, sse=sse))
        finally:
            await adapter.aclose()
    one_line = b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
    assert client_bytes(events[:-1]) == b"data: %s\n\n" % one_line
    assert events[-1] == RunDone("stop")


@pytest.mark.parametrize(
    ("event", "refused"),
    [
        # SSE ends a line at a lone CR: the client would read fields the upstream slipped in.
        pytest.param(
            b'data: {"choices":[]}\revent: error\rdata: {"error":{"message":"injected"}}',
            True,
            id="fields-after-a-cr",
        ),
        pytest.param(b'data: {"choices":\r[]}', False, id="cr-between-json-tokens"),
    ],
)
@pytest.mark.parametrize("sse", [False, True], ids=["per-event", "passed-through"])
async def test_a_lone_cr_in_a_data_line_never_reaches_the_client(
    event: bytes, refused: bool, sse: bool
) -> None:
    # Events after it, so that it is not among the last a read parses anyway.
    after = (chunk("b"), chunk("c"), chunk("d", "stop"))
    body = b"data: %s\n\n%s\n\ndata: %s\n\ndata: %s\n\ndata: %s\n\n" % (chunk("a"), event, *after)
    async with raw_upstream(sse_response(body)) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            events = await collect(adapter, request(True, sse=sse))
        finally:
            await adapter.aclose()
    assert b"\r" not in client_bytes([e for e in events if isinstance(e, RunChunk)])
    if refused:
        assert client_bytes(events[:1]) == b"data: %s\n\n" % chunk("a")
        failed = events[-1]
        assert isinstance(failed, RunFailed) and failed.code == statuses.UPSTREAM_ERROR
    else:
        assert events[-1] == RunDone("stop")


async def test_a_redirect_with_a_json_body_is_an_upstream_error() -> None:
    answer = b'{"choices":[{"index":0,"message":{"content":"moved"}}]}'
    head = b"HTTP/1.1 301 Moved Permanently\r\nlocation: http://elsewhere/\r\n"
    head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(answer)
    async with raw_upstream([head + answer]) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            events = await collect(adapter, request(False))
        finally:
            await adapter.aclose()
    assert len(events) == 1
    failed = events[0]
    assert isinstance(failed, RunFailed) and failed.code == statuses.UPSTREAM_ERROR
    assert failed.message.startswith("upstream answered HTTP 301")
    assert statuses.http_status(failed) == 502


@pytest.mark.parametrize("first", [False, True], ids=["before-any-event", "after-one"])
async def test_a_stream_of_comments_only_times_out_as_silence_does(first: bool) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    events = [b"data: %s\n\n" % chunk("a")] if first else []
    # Far more comments than the read timeout lets through (each a separate read).
    async with raw_upstream([head, *events, *[b": ping\n\n"] * 2000]) as (_, url):
        settings = OpenAIAdapterSettings(base_url=url, request_timeout_s=0.3)
        adapter = OpenAIAdapter("p1", settings)
        try:
            run = await asyncio.wait_for(collect(adapter, request(True, sse=True)), 5)
        finally:
            await adapter.aclose()
    failed = run[-1]
    assert isinstance(failed, RunFailed) and failed.code == statuses.UPSTREAM_TIMEOUT
    assert "no event for 0.3s, only comments" in failed.message


@pytest.mark.parametrize(
    "bad", [b"<html>oops</html>", b'{"choices": [], "usage": {"prompt_tokens": oops'], ids=str
)
@pytest.mark.parametrize("sse", [False, True], ids=["per-event", "passed-through"])
async def test_a_stream_that_is_not_json_is_an_upstream_error(bad: bytes, sse: bool) -> None:
    body = b"data: %s\n\ndata: %s\n\n" % (chunk("a"), bad)
    async with raw_upstream(sse_response(body)) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            events = await collect(adapter, request(True, sse=sse))
        finally:
            await adapter.aclose()
    assert client_bytes(events[:1]) == b"data: %s\n\n" % chunk("a")
    failed = events[-1]
    assert isinstance(failed, RunFailed) and failed.code == statuses.UPSTREAM_ERROR
    assert "not JSON" in failed.message


async def test_an_api_key_with_a_line_break_is_refused_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IOP_TEST_BROKEN_KEY", "sk-1\r\nx-injected: yes")
    settings = OpenAIAdapterSettings(
        base_url="http://127.0.0.1:9/v1", api_key_env="IOP_TEST_BROKEN_KEY"
    )
    adapter = OpenAIAdapter("p1", settings)
    try:
        assert (
            adapter.health.detail == "environment variable IOP_TEST_BROKEN_KEY holds a line break"
        )
        events = await collect(adapter, request(False))
    finally:
        await adapter.aclose()
    assert isinstance(events[-1], RunFailed) and events[-1].code == statuses.PROVIDER_UNHEALTHY


async def test_the_api_key_comes_from_the_named_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IOP_TEST_UPSTREAM_KEY", "sk-upstream-secret")
    body = orjson.dumps({"choices": [{"index": 0, "message": {}, "finish_reason": "stop"}]})
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    async with raw_upstream([answer]) as (upstream, url):
        settings = OpenAIAdapterSettings(base_url=url, api_key_env="IOP_TEST_UPSTREAM_KEY")
        adapter = OpenAIAdapter("p1", settings)
        try:
            events = await collect(adapter, request(False))
        finally:
            await adapter.aclose()
    assert events == [RunChunk(body), RunDone("stop")]
    (head,) = upstream.heads
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nauthorization: bearer sk-upstream-secret\r\n" in head.lower()


async def test_the_fake_adapter_answers_like_the_fake_upstream(adapter: OpenAIAdapter) -> None:
    fake = FakeAdapter("p1", FakeAdapterSettings(completion_tokens=5))
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
    fake = FakeAdapter(
        "p1", FakeAdapterSettings(latency_ms=50, tokens_per_second=100, completion_tokens=5)
    )
    start = time.perf_counter()
    events = await collect(fake, request(False))
    assert time.perf_counter() - start >= 0.09
    assert isinstance(events[-1], RunDone)


@pytest.mark.parametrize(
    "pieces",
    [
        pytest.param(
            [
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: 100000000\r\n\r\n",
                b"{" * 70_000,
            ],
            id="a-body-whose-length-says-too-much",
        ),
        pytest.param(
            [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"]
            + [b"[" * 16_384] * 8,
            id="a-body-without-a-length-that-grows-too-much",
        ),
    ],
)
async def test_an_answer_past_the_runs_bound_is_refused_without_being_read_whole(
    pieces: list[bytes],
) -> None:
    async with raw_upstream(pieces) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            bounded = dataclasses.replace(request(False), max_response_bytes=64 * 1024)
            events = await collect(adapter, bounded)
        finally:
            await adapter.aclose()
    assert len(events) == 1 and isinstance(events[0], RunFailed)
    assert events[0].code == statuses.RESPONSE_TOO_LARGE and not events[0].retryable


@pytest.mark.parametrize("sse", [False, True], ids=["per-event", "passed-through"])
async def test_a_stream_event_past_the_runs_bound_is_refused(sse: bool) -> None:
    body = b'data: %s\n\ndata: {"choices": "%s' % (chunk("a"), b"x" * 200_000)
    async with raw_upstream(sse_response(body, split_at=range(100, 200_000, 4096))) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            bounded = dataclasses.replace(request(True, sse=sse), max_response_bytes=64 * 1024)
            events = await collect(adapter, bounded)
        finally:
            await adapter.aclose()
    assert client_bytes(events[:1]) == b"data: %s\n\n" % chunk("a")
    assert isinstance(events[-1], RunFailed) and events[-1].code == statuses.RESPONSE_TOO_LARGE


async def test_only_the_head_of_a_huge_error_body_is_read() -> None:
    message = b'{"error": {"message": "' + b"m" * 1_000_000 + b'"}}'
    head = b"HTTP/1.1 500 X\r\ncontent-length: %d\r\n\r\n" % len(message)
    async with raw_upstream([head, message]) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            events = await collect(adapter, request(False))
        finally:
            await adapter.aclose()
    assert isinstance(events[0], RunFailed) and events[0].code == statuses.UPSTREAM_ERROR
    assert len(events[0].message) < 1024


# -- the upstream policy (iop.edgeconfig.upstreampolicy) ----------------------------------------


async def test_a_key_bound_to_another_host_is_never_read_nor_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The provider may not send the key: it reports why and calls nothing."""
    monkeypatch.setenv("IOP_TEST_UPSTREAM_KEY", "sk-upstream-secret")
    async with raw_upstream([]) as (upstream, url):
        policy = parse_policy(
            "allow: [127.0.0.1/32]\nkeys: [{env: IOP_TEST_UPSTREAM_KEY, hosts: ['vllm.svc:8000']}]"
        )
        settings = OpenAIAdapterSettings(base_url=url, api_key_env="IOP_TEST_UPSTREAM_KEY")
        adapter = OpenAIAdapter("p1", settings, policy)
        try:
            events = await collect(adapter, request(False))
        finally:
            await adapter.aclose()
    assert "may go only to hosts vllm.svc:8000" in adapter.problem
    assert adapter.upstream is None  # so it is never probed either
    assert isinstance(events[-1], RunFailed) and events[-1].code == statuses.PROVIDER_UNHEALTHY
    assert upstream.heads == []


async def test_an_address_the_policy_denies_is_never_dialled() -> None:
    """`localhost` is listed by name; it resolves to loopback, which only a CIDR lets in."""
    async with raw_upstream([]) as (upstream, url):
        by_name = url.replace("127.0.0.1", "localhost")
        adapter = OpenAIAdapter(
            "p1", OpenAIAdapterSettings(base_url=by_name), parse_policy("allow: [localhost]")
        )
        try:
            events = await collect(adapter, request(False))
        finally:
            await adapter.aclose()
    assert adapter.problem == ""  # the name is allowed: its addresses are judged when dialled
    (failed,) = events
    assert isinstance(failed, RunFailed) and failed.code == statuses.UPSTREAM_UNAVAILABLE
    assert "localhost (127.0.0.1) is in a range the upstream policy denies" in failed.message
    assert upstream.connections == 0


async def test_a_2xx_answer_that_is_not_an_openai_answer_is_not_passed_on() -> None:
    """What a server that is not a model server answers 2xx (an API server's JSON) never
    reaches the client."""
    body = b'{"kind": "APIVersions", "serverAddressByClientCIDRs": [{"serverAddress": "x"}]}'
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    async with raw_upstream([answer]) as (_, url):
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=url))
        try:
            events = await collect(adapter, request(False))
        finally:
            await adapter.aclose()
    (failed,) = events
    assert isinstance(failed, RunFailed) and failed.code == statuses.UPSTREAM_ERROR
    assert "no choices list" in failed.message and b"serverAddress" not in failed.message.encode()
