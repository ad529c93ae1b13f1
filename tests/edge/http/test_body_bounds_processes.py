"""Authenticated bodies within the byte limit whose structure would stall the Edge are refused
before they are parsed, with an OpenAI 400 naming the bound; /healthz keeps answering while they
arrive, and bodies a real client sends still pass.

One `iop edge run` and one `iop node run` (a fake adapter) serve the module. The hostile bodies
go as raw bytes over httpx (the official client takes seconds to encode them); the rest through
the official `openai` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest
import pytest_asyncio
import yaml
from openai.types.chat import ChatCompletionUserMessageParam

from testkit import CLIENT_TOKEN, node_token_of, provider

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

HI: ChatCompletionUserMessageParam = {"role": "user", "content": "hi"}
#: Far past what any client waits for a liveness probe, far under the seconds a body held it.
HEALTHZ_BOUND_S = 1.5


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def edge_url(
    tmp_path_factory: pytest.TempPathFactory,
    iop_processes: Any,
    document_of: Callable[..., dict[str, Any]],
) -> AsyncIterator[str]:
    folder = tmp_path_factory.mktemp("bodies")
    document = document_of(
        [provider("p1", {"type": "fake", "completion_tokens": 4}, served="m", capacity=8)],
        {"m": ["p1"]},
        threshold=10_000_000,
    )
    config = folder / "edge.yaml"
    config.write_text(yaml.safe_dump(document))
    token = folder / "node.token"
    token.write_text(node_token_of("node-1"))
    async with contextlib.AsyncExitStack() as stack:
        _, started = await iop_processes.edge(stack, config)
        await iop_processes.node(stack, started["hub_port"], "node-1", token)
        await iop_processes.wait_available(started["url"], ["p1"])
        yield started["url"]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=CLIENT_TOKEN, max_retries=0)


async def worst_healthz(url: str, stop: asyncio.Event) -> float:
    """The slowest /healthz answer until `stop` is set."""
    worst = 0.0
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            started = time.perf_counter()
            assert (await http.get("/healthz")).status_code == 200
            worst = max(worst, time.perf_counter() - started)
            await asyncio.sleep(0.01)
    return worst


def tiny_messages() -> bytes:
    """600,000 messages in 7.8 MB, within the 8 MiB limit."""
    return b'{"model":"m","messages":[' + b'{"role":"u"},' * 600_000 + HI_BYTES + b"]}"


HI_BYTES = orjson.dumps(HI)


@pytest.mark.parametrize(
    ("path", "raw", "words"),
    [
        pytest.param(
            "/v1/chat/completions",
            tiny_messages(),
            "JSON items, at most 500000",
            id="600k-messages",
        ),
        pytest.param(
            "/v1/embeddings",
            b'{"model":"m","input":[' + b"[1]," * 2_000_000 + b"[1]]}",
            "2000003 JSON objects and arrays, at most 50000",
            id="2m-lists",
        ),
        pytest.param(
            "/v1/completions",
            b'{"model":"m","prompt":[' + b"1," * 4_000_000 + b"1]}",
            "4000003 JSON items, at most 500000",
            id="4m-token-ids",
        ),
    ],
)
async def test_a_body_of_millions_of_values_is_refused_before_it_is_parsed(
    edge_url: str, path: str, raw: bytes, words: str
) -> None:
    stop = asyncio.Event()
    probe = asyncio.create_task(worst_healthz(edge_url, stop))
    headers = {"authorization": f"Bearer {CLIENT_TOKEN}", "content-type": "application/json"}
    try:
        async with httpx.AsyncClient(base_url=edge_url, headers=headers, timeout=60) as http:
            # Four at once, as the attack ran.
            answers = await asyncio.gather(*(http.post(path, content=raw) for _ in range(4)))
    finally:
        stop.set()
        worst = await probe
    for answer in answers:
        assert answer.status_code == 400, answer.text[:200]
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert words in error["message"], error["message"]
    assert worst < HEALTHZ_BOUND_S, f"/healthz took {worst:.2f} s while the bodies arrived"


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("call", "param", "words"),
    [
        pytest.param(
            lambda c: c.chat.completions.create(model="m", messages=[HI] * 10_001),
            "messages",
            "10001 items, at most 10000",
            id="messages",
        ),
        pytest.param(
            lambda c: c.chat.completions.create(
                model="m",
                messages=[HI, {"role": "user", "content": [{"type": "text", "text": "a"}] * 1_001}],
            ),
            "messages[1].content",
            "1001 items, at most 1000",
            id="content-parts",
        ),
        pytest.param(
            lambda c: c.embeddings.create(model="m", input=["a"] * 2_049),
            "input",
            "2049 items, at most 2048",
            id="inputs",
        ),
        pytest.param(
            lambda c: c.chat.completions.create(
                model="m", messages=[HI], extra_body={"metadata": {"a": deep(70)}}
            ),
            "metadata.a" + "[0]" * 62,
            "nested deeper than 64 levels",
            id="depth",
        ),
    ],
)
async def test_a_field_past_its_bound_is_named(
    edge_url: str, call: Callable[[openai.AsyncOpenAI], Any], param: str, words: str
) -> None:
    async with client(edge_url) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await call(api)
    error = caught.value
    assert error.param == param
    assert words in error.message


async def test_bodies_a_real_client_sends_still_pass(edge_url: str) -> None:
    """A long conversation, and a 2 MB prompt of code whose strings hold 300,000 brackets."""
    code = "if (x) { y[1] = {a: 2, b: [3, 4]}; }\n" * 55_000
    async with client(edge_url) as api:
        answer = await api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": code}, HI], max_tokens=2
        )
        assert answer.choices[0].message.content
        answer = await api.chat.completions.create(model="m", messages=[HI] * 2_000, max_tokens=2)
        assert answer.choices[0].message.content
        vectors = await api.embeddings.create(model="m", input=["a b"] * 2_048)
        assert len(vectors.data) == 2_048
