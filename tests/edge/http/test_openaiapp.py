"""The OpenAI API surface: the official `openai` client (and raw HTTP for malformed input)
against a real uvicorn server on port 0, with a fake node hub at the request path's seam.

One Edge serves the whole module; after every test, nothing may be left in flight, waiting or
running on the hub.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletionMessageParam

from iop.edge import EdgeServer
from iop.wire import RunChunk, RunDone, RunEvent, RunFailed, RunRequest, RunUsage

MAX_BYTES = 64 * 1024
THRESHOLD = 1000  # tokens: 4,000 bytes of message content


@pytest_asyncio.fixture
async def server(config_of, provider, fake_hub) -> AsyncIterator[EdgeServer]:
    config = config_of(
        [
            provider("a", capacity=4, priority=1, long_context_slots=1),
            provider("b", capacity=4, priority=2),
            provider("t", capacity=1, max_queue=1, queue_timeout_ms=300),
        ],
        {"m": ["a", "b"], "tiny": ["t"]},
        threshold=THRESHOLD,
        openai={"max_request_bytes": MAX_BYTES},
        model_settings={"m": {"generation": {"max_tokens": 100, "temperature": 0.5}}},
    )
    edge = EdgeServer(
        config,
        hub=fake_hub,
        openai_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        shutdown_grace_s=1,
    )
    await edge.start()
    fake_hub.connect("a", "b", "t")
    yield edge
    await edge.stop()


@pytest_asyncio.fixture
async def edge(server, fake_hub, until) -> AsyncIterator[EdgeServer]:
    fake_hub.reset()
    yield server

    def idle() -> bool:
        counts = server.dispatcher.in_flight_counts().values()
        return all(n == (0, 0) for n in counts) and not server.dispatcher.waiting

    await until(lambda: idle() and not fake_hub.active, timeout=2)
    assert server.dispatcher.in_flight_counts() == {"a": (0, 0), "b": (0, 0), "t": (0, 0)}
    assert server.dispatcher.waiting == 0
    assert not fake_hub.active


@pytest_asyncio.fixture
async def client(edge, tokens) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{edge.url}/v1", api_key=tokens["search-chat"], max_retries=0
    ) as client:
        yield client


@pytest_asyncio.fixture
async def http(edge, tokens) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=edge.url,
        headers={"authorization": f"Bearer {tokens['search-chat']}"},
        timeout=10,
    ) as http:
        yield http


@pytest_asyncio.fixture
async def metrics(edge) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the Edge's metrics listener (apart from the OpenAI API)."""
    async with httpx.AsyncClient(base_url=edge.metrics_url, timeout=10) as metrics:
        yield metrics


def forwarded(fake_hub):
    return orjson.loads(fake_hub.requests[-1].body)


HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


# -- the catalog and the plain endpoints ---------------------------------------------------------


async def test_models_lists_the_catalog(client) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["m", "tiny"]
    assert (await client.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("nope")
    assert caught.value.code == "model_not_found"


async def test_health_readiness_and_metrics(http, metrics) -> None:
    assert (await http.get("/healthz")).json() == {"status": "ok"}
    ready = await http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["providers_available"] == ["a", "b", "t"]
    scraped = await metrics.get("/metrics")
    assert scraped.status_code == 200
    assert "iop_edge_in_flight" in scraped.text
    assert scraped.headers["content-type"].startswith("text/plain")


async def test_the_public_listener_serves_no_metrics(http) -> None:
    """They name every principal and token ref: only the metrics listener serves them."""
    answer = await http.get("/metrics")
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "unknown_url"
    assert "principal_ref" not in answer.text


# -- completions -------------------------------------------------------------------------------


async def test_chat_completion_runs_on_the_preferred_provider(client, fake_hub) -> None:
    response = await client.chat.completions.create(model="m", messages=HELLO)
    assert response.choices[0].message.content == "Hello from a"
    assert response.usage is not None and response.usage.total_tokens == 8
    sent = fake_hub.requests[-1]
    assert (sent.provider_id, sent.served_model, sent.kind, sent.stream) == (
        "a",
        "a-served",
        "chat",
        False,
    )
    body = forwarded(fake_hub)
    # The served name, and the model's generation policy as defaults.
    assert body == {"model": "a-served", "messages": HELLO, "max_tokens": 100, "temperature": 0.5}


async def test_generation_policy_caps_and_keeps_what_the_client_set(client, fake_hub) -> None:
    await client.chat.completions.create(
        model="m", messages=HELLO, max_tokens=5000, temperature=1.5, extra_body={"top_k": 3}
    )
    body = forwarded(fake_hub)
    assert (body["max_tokens"], body["temperature"], body["top_k"]) == (100, 1.5, 3)
    await client.chat.completions.create(model="m", messages=HELLO, max_completion_tokens=20)
    body = forwarded(fake_hub)
    assert body["max_completion_tokens"] == 20 and "max_tokens" not in body


async def test_chat_stream_without_usage(client) -> None:
    stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "Hello from a"
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(chunk.usage is None for chunk in chunks)


async def test_chat_stream_with_include_usage_ends_with_the_usage_chunk(client) -> None:
    stream = await client.chat.completions.create(
        model="m", messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 8


async def test_sse_framing_is_openais(http) -> None:
    async with http.stream(
        "POST", "/v1/chat/completions", json={"model": "m", "messages": HELLO, "stream": True}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.aread()).decode()
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])


@pytest.mark.parametrize("include_usage", [False, True], ids=["plain", "with-usage"])
async def test_a_stream_reads_the_same_when_its_events_arrive_at_once(
    http, fake_hub, include_usage
) -> None:
    # A Node's one message often carries a run's every event; the Edge then writes them in one go.
    body: dict[str, Any] = {"model": "m", "messages": HELLO, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    answers = []
    for at_once in (False, True):
        fake_hub.at_once = at_once
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            text = await response.aread()
        answers.append(re.sub(rb'"id":"run-[^"]+"', b'"id":"run"', text))
    assert answers[0] == answers[1]
    assert answers[1].endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("include_usage", [False, True], ids=["plain", "with-usage"])
@pytest.mark.parametrize("at_once", [False, True], ids=["event-by-event", "all-at-once"])
async def test_a_stream_of_whole_sse_events_reads_the_same_as_one_of_objects(
    http, fake_hub, include_usage, at_once
) -> None:
    # A Node passes a stream through: each upstream read's events as one chunk of SSE bytes.
    body: dict[str, Any] = {"model": "m", "messages": HELLO, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}

    per_event = fake_hub.script  # the fake's own answers, one object per chunk

    async def passed_through(request: RunRequest) -> AsyncIterator[RunEvent]:
        events = [event async for event in per_event(request)]
        chunks = [e for e in events if isinstance(e, RunChunk)]
        framed = [b"data: " + c.data + b"\n\n" for c in chunks if not c.usage_only]
        if include_usage:  # the Node keeps the usage-only chunk only for a client that asked
            framed += [b"data: " + c.data + b"\n\n" for c in chunks if c.usage_only]
        yield RunChunk(framed[0], sse=True)  # a read of one event, then one of all the rest
        yield RunChunk(b"".join(framed[1:]), sse=True)
        for event in events:
            if not isinstance(event, RunChunk):
                yield event

    fake_hub.at_once = at_once
    answers = []
    for script in (per_event, passed_through):
        fake_hub.script = script
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            text = await response.aread()
        answers.append(re.sub(rb'"id":"run-[^"]+"', b'"id":"run"', text))
        assert fake_hub.requests[-1].sse_chunks  # the Edge asks every stream's Node for it
    assert answers[0] == answers[1]
    assert answers[1].endswith(b"data: [DONE]\n\n")
    assert (b'"choices":[]' in answers[1]) is include_usage


async def test_a_whole_answer_is_never_asked_for_sse_chunks(client, fake_hub) -> None:
    await client.chat.completions.create(model="m", messages=HELLO)
    assert not fake_hub.requests[-1].sse_chunks


async def test_text_completion_streaming_and_not(client, fake_hub) -> None:
    response = await client.completions.create(model="m", prompt="Say hi")
    assert response.choices[0].text == "Hello from a"
    assert fake_hub.requests[-1].kind == "completion"
    stream = await client.completions.create(model="m", prompt=["a", "b"], stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == "Hello from a"


async def test_long_context_requests_take_a_long_slot(client, fake_hub) -> None:
    big: list[ChatCompletionMessageParam] = [{"role": "user", "content": "x" * (THRESHOLD * 4)}]
    await client.chat.completions.create(model="m", messages=big)
    assert fake_hub.requests[-1].long_context
    await client.chat.completions.create(model="m", messages=HELLO)
    assert not fake_hub.requests[-1].long_context


async def test_usage_is_metered_by_principal_token_model_and_provider(
    client, metrics, tokens
) -> None:
    await client.chat.completions.create(model="m", messages=HELLO)
    text = (await metrics.get("/metrics")).text
    assert (
        'iop_edge_total_tokens_total{model="m",principal_ref="team-search",provider="a",'
        'token_ref="search-chat"}'
    ) in text
    assert 'status="200"' in text
    assert all(token not in text for token in tokens.values())


async def test_many_concurrent_requests_all_complete(client) -> None:
    responses = await asyncio.gather(
        *(client.chat.completions.create(model="m", messages=HELLO) for _ in range(64))
    )
    assert {r.choices[0].message.content for r in responses} <= {"Hello from a", "Hello from b"}


# -- bad input ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("content", "status", "param", "code"),
    [
        pytest.param(b'{"model": "m", "messages": [', 400, None, "invalid_request", id="bad-json"),
        pytest.param(b"[1, 2]", 400, None, "invalid_request", id="not-an-object"),
        pytest.param(b'{"model": "m"}', 400, "messages", "invalid_request", id="no-messages"),
        pytest.param(
            b'{"model": "m", "messages": []}', 400, "messages", "invalid_request", id="empty"
        ),
        pytest.param(
            b'{"model": "m", "messages": [{"content": "hi"}]}',
            400,
            "messages[0].role",
            "invalid_request",
            id="no-role",
        ),
        pytest.param(
            b'{"model": "m", "messages": [{"role": "user", "content": 5}]}',
            400,
            "messages[0].content",
            "invalid_request",
            id="bad-content",
        ),
        pytest.param(
            b'{"model": "m", "messages": [], "max_tokens": "12"}',
            400,
            "messages",
            "invalid_request",
            id="several-problems",
        ),
        pytest.param(
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "12"}',
            400,
            "max_tokens",
            "invalid_request",
            id="string-max-tokens",
        ),
        pytest.param(
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}',
            400,
            "temperature",
            "invalid_request",
            id="temperature-out-of-range",
        ),
        pytest.param(
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
            400,
            "stream",
            "invalid_request",
            id="string-stream",
        ),
        pytest.param(
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            400,
            "model",
            "invalid_request",
            id="no-model",
        ),
        pytest.param(
            b'{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}',
            404,
            "model",
            "model_not_found",
            id="unknown-model",
        ),
    ],
)
async def test_bad_requests_get_a_clear_openai_error(http, content, status, param, code) -> None:
    response = await http.post(CHAT, content=content)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"
    if param:
        assert param in error["message"]


async def test_bad_completion_prompt_is_named(http) -> None:
    response = await http.post("/v1/completions", json={"model": "m", "prompt": [1, "a"]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        pytest.param({}, "missing_api_key", id="missing"),
        pytest.param({"authorization": "Bearer sk-wrong"}, "invalid_api_key", id="unknown"),
        pytest.param({"authorization": "Basic Zm9vOmJhcg=="}, "invalid_api_key", id="basic"),
    ],
)
async def test_bad_or_missing_auth_is_401(edge, headers, code) -> None:
    async with httpx.AsyncClient(base_url=edge.url) as bare:
        for request in (
            bare.post(CHAT, json={"model": "m", "messages": HELLO}, headers=headers),
            bare.get("/v1/models", headers=headers),
        ):
            response = await request
            assert response.status_code == 401
            assert response.json()["error"]["code"] == code
            assert response.headers["www-authenticate"] == "Bearer"


async def test_the_openai_client_sees_auth_errors(edge) -> None:
    async with openai.AsyncOpenAI(
        base_url=f"{edge.url}/v1", api_key="sk-wrong", max_retries=0
    ) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=HELLO)


async def test_oversized_body_is_refused_from_its_content_length(http) -> None:
    response = await http.post(CHAT, content=b"x" * (MAX_BYTES + 1))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


async def test_oversized_chunked_body_is_refused_while_it_arrives(http) -> None:
    async def parts() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b"x" * 8192

    response = await http.post(CHAT, content=parts())
    assert response.status_code == 413


async def test_wrong_method_and_unknown_path(http) -> None:
    response = await http.get(CHAT)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    response = await http.post("/v1/images/generations", json={})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Invalid URL (POST /v1/images/generations)"
    response = await http.get("/v1/embeddings")
    assert response.status_code == 405 and response.headers["allow"] == "POST"


# -- queueing, disconnects, retries and failures -----------------------------------------------


def gated(gate: asyncio.Event):
    async def script(request: RunRequest) -> AsyncIterator[RunEvent]:
        await gate.wait()
        yield RunChunk(b'{"id": "x", "object": "chat.completion", "choices": []}')
        yield RunDone("stop")

    return script


async def test_queue_full_is_429_and_queue_timeout_is_503(http, edge, fake_hub, until) -> None:
    gate = asyncio.Event()
    fake_hub.script = gated(gate)
    body = {"model": "tiny", "messages": HELLO}
    running = asyncio.create_task(http.post(CHAT, json=body))
    await until(lambda: edge.dispatcher.in_flight("t") == 1)
    waiting = asyncio.create_task(http.post(CHAT, json=body))
    await until(lambda: edge.dispatcher.queue_depth("tiny") == 1)
    full = await http.post(CHAT, json=body)
    assert full.status_code == 429
    assert full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "queue_full"
    timed_out = await waiting  # queue_timeout_ms 300
    assert timed_out.status_code == 503
    assert timed_out.headers["retry-after"] == "1"
    assert timed_out.json()["error"]["code"] == "queue_timeout"
    gate.set()
    assert (await running).status_code == 200


async def test_a_client_that_disconnects_cancels_its_run_and_frees_its_slot(
    edge, fake_hub, tokens, until
) -> None:
    gate = asyncio.Event()
    fake_hub.script = gated(gate)
    async with httpx.AsyncClient(
        base_url=edge.url, headers={"authorization": f"Bearer {tokens['search-chat']}"}
    ) as leaving:
        request = asyncio.create_task(
            leaving.post(CHAT, json={"model": "tiny", "messages": HELLO, "stream": True})
        )
        await until(lambda: bool(fake_hub.active))
        (run_id,) = fake_hub.active
        queued = asyncio.create_task(leaving.post(CHAT, json={"model": "tiny", "messages": HELLO}))
        await until(lambda: edge.dispatcher.queue_depth("tiny") == 1)
        request.cancel()
        queued.cancel()
        for task in (request, queued):
            with pytest.raises(asyncio.CancelledError):
                await task
    # The clients' connections are closed: the run is cancelled and the slot and queue are free.
    await until(lambda: edge.dispatcher.in_flight("t") == 0)
    await until(lambda: edge.dispatcher.queue_depth("tiny") == 0)
    assert fake_hub.ended[run_id] == "cancelled"
    gate.set()


async def test_provider_busy_retries_another_candidate(client, fake_hub) -> None:
    echo = fake_hub.script

    async def busy_a(request: RunRequest) -> AsyncIterator[RunEvent]:
        if request.provider_id == "a":
            yield RunFailed("provider_busy", "at capacity on its node", True, None)
            return
        async for event in echo(request):
            yield event

    fake_hub.script = busy_a
    response = await client.chat.completions.create(model="m", messages=HELLO)
    assert response.choices[0].message.content == "Hello from b"
    assert [r.provider_id for r in fake_hub.requests] == ["a", "b"]


async def test_upstream_failure_is_a_502_with_the_wire_code(client, fake_hub) -> None:
    async def broken(request: RunRequest) -> AsyncIterator[RunEvent]:
        yield RunFailed("upstream_error", "upstream answered HTTP 500", False, 500)

    fake_hub.script = broken
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model="m", messages=HELLO)
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_error"


async def test_upstream_refusal_keeps_its_4xx(client, fake_hub) -> None:
    async def refused(request: RunRequest) -> AsyncIterator[RunEvent]:
        yield RunFailed("bad_request", "context length exceeded", False, 400)

    fake_hub.script = refused
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="m", messages=HELLO)
    assert "context length exceeded" in caught.value.message


@pytest.mark.parametrize("at_once", [False, True], ids=["event-by-event", "all-at-once"])
async def test_a_failure_mid_stream_is_an_sse_error_event(client, fake_hub, at_once) -> None:
    fake_hub.at_once = at_once

    async def dies(request: RunRequest) -> AsyncIterator[RunEvent]:
        yield RunChunk(
            b'{"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}'
        )
        yield RunUsage(1, 1, 2)
        yield RunFailed("node_disconnected", "the node went away", False, None)

    fake_hub.script = dies
    stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk)
    assert len(received) == 1
    assert "the node went away" in caught.value.message
