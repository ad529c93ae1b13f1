"""The fake upstream answers as OpenAI does, checked with the official openai client."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from iop.fakes import FakeUpstream, FakeUpstreamSettings, tokens
from iop.processes import spawn_fake_upstream

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "say something"}]


@pytest.fixture
async def client(fake_upstream: FakeUpstream):
    async with openai.AsyncOpenAI(
        base_url=fake_upstream.base_url, api_key="unused", max_retries=0
    ) as client:
        yield client


async def test_models_are_listed(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]


async def test_chat_completion_is_deterministic(client: openai.AsyncOpenAI) -> None:
    response = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert response.object == "chat.completion"
    assert response.model == "m"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == "".join(tokens(4))
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None and response.usage.completion_tokens == 4
    assert response.usage.total_tokens == response.usage.prompt_tokens + 4


async def test_chat_stream_with_usage_is_framed_like_openai(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(
        tokens(3)
    )
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


async def test_chat_stream_without_usage_has_no_usage_chunk(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len(chunks) == 1 + 16 + 1


async def test_text_completions_stream_and_not(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model="m", prompt="hello there", max_tokens=2)
    assert whole.object == "text_completion"
    assert whole.choices[0].text == "".join(tokens(2))
    stream = await client.completions.create(model="m", prompt="hi", max_tokens=2, stream=True)
    texts = [chunk.choices[0].text async for chunk in stream]
    assert "".join(texts) == "".join(tokens(2))


async def test_raw_sse_bytes(fake_upstream: FakeUpstream) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{fake_upstream.base_url}/chat/completions",
            json={"model": "m", "messages": MESSAGES, "max_tokens": 1, "stream": True},
        )
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = response.content.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert len(events[:-2]) == 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_plain_requests_answered_at_once_match_the_general_path(
    fake_upstream: FakeUpstream, stream: bool
) -> None:
    """A request with no test hook is answered from the parser's callback; a request with a
    no-op hook takes the general path. Both must send the same bytes, but for the ids."""
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "stream": stream}
    async with httpx.AsyncClient(base_url=fake_upstream.base_url) as http:
        plain = await http.post("/chat/completions", json=body)
        hooked = await http.post(
            "/chat/completions", json={**body, "fake_upstream": {"latency_ms": 0}}
        )

    def without_ids(content: bytes) -> list[Any]:
        parts = content.split(b"\n\n") if stream else [content]
        documents = [p.removeprefix(b"data: ") for p in parts if p and p != b"data: [DONE]"]
        return [{**orjson.loads(d), "id": None, "created": None} for d in documents]

    assert plain.status_code == hooked.status_code == 200
    assert plain.headers["content-type"] == hooked.headers["content-type"]
    assert without_ids(plain.content) == without_ids(hooked.content)
    assert plain.content.endswith(b"data: [DONE]\n\n") is stream
    assert fake_upstream.stats.requests == fake_upstream.stats.completed == 2
    assert fake_upstream.stats.completions == 2


@pytest.mark.parametrize(
    ("status", "error"),
    [
        pytest.param(500, openai.InternalServerError, id="500"),
        pytest.param(429, openai.RateLimitError, id="429"),
        pytest.param(503, openai.InternalServerError, id="503"),
    ],
)
async def test_injected_error_status(
    client: openai.AsyncOpenAI, status: int, error: type[Exception]
) -> None:
    with pytest.raises(error) as caught:
        await client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            extra_body={"fake_upstream": {"fail": "status", "status": status}},
        )
    assert isinstance(caught.value, openai.APIStatusError)
    assert caught.value.status_code == status
    assert "server had an error" in caught.value.message


async def test_injected_drop(client: openai.AsyncOpenAI, fake_upstream: FakeUpstream) -> None:
    with pytest.raises(openai.APIConnectionError):
        await client.chat.completions.create(
            model="m", messages=MESSAGES, extra_body={"fake_upstream": {"fail": "drop"}}
        )
    stream = await client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        stream=True,
        extra_body={"fake_upstream": {"fail": "drop-mid-stream"}},
    )
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    await client.models.list()  # not a completion
    assert fake_upstream.stats.failures_injected == fake_upstream.stats.completions == 2


async def test_bad_requests_get_openai_error_bodies(fake_upstream: FakeUpstream) -> None:
    async with httpx.AsyncClient(base_url=fake_upstream.base_url) as http:
        bad_json = await http.post("/chat/completions", content=b"{nope")
        no_messages = await http.post("/chat/completions", json={"model": "m"})
        unknown = await http.get("/nowhere")
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"
    assert no_messages.status_code == 400
    assert no_messages.json()["error"]["param"] == "messages"
    assert unknown.status_code == 404


async def test_unknown_model_when_models_are_listed() -> None:
    async with FakeUpstream(FakeUpstreamSettings(models=("a",))) as upstream:
        async with openai.AsyncOpenAI(
            base_url=upstream.base_url, api_key="x", max_retries=0
        ) as client:
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="b", messages=MESSAGES)


async def test_client_disconnect_is_counted(fake_upstream: FakeUpstream, until) -> None:
    async with httpx.AsyncClient(base_url=fake_upstream.base_url) as http:
        body = {
            "model": "m",
            "messages": MESSAGES,
            "stream": True,
            "fake_upstream": {"tokens_per_second": 20},
        }
        async with http.stream("POST", "/chat/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                break
    await until(lambda: fake_upstream.stats.disconnects == 1)
    assert fake_upstream.stats.in_flight == 0


async def test_command_reports_its_address_on_stdout() -> None:
    async with spawn_fake_upstream(["--completion-tokens", "2"]) as process:
        assert process.base_url == f"http://{process.listen}/v1"
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{process.base_url}/completions", json={"model": "m", "prompt": "x"}
            )
            stats = await http.get(f"http://{process.listen}/fake/stats")
    assert orjson.loads(response.content)["usage"]["completion_tokens"] == 2
    assert stats.json()["completed"] == 1
