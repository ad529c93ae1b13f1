"""The product's request path with real processes: `iop edge run`, `iop node run` and
`iop fake-upstream`, driven by the official `openai` client over real sockets.

Every test runs twice: with the providers in a Node (`placement: node`, the Edge's runs cross
the gRPC link) and placed on the Edge (`placement: edge`, no Node process: the Edge runs them
itself); the client cannot tell the two apart."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import yaml

from iop.processes import spawn_fake_upstream
from testkit import CLIENT_TOKEN, CLIENTS, node_token_of, provider

pytestmark = pytest.mark.asyncio(loop_scope="module")


@dataclass(frozen=True)
class Stack:
    url: str
    upstream_url: str
    metrics_url: str


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=["node", "edge"])
async def stack(request, tmp_path_factory, iop_processes, document_of) -> AsyncIterator[Stack]:
    placement: str = request.param
    folder: Path = tmp_path_factory.mktemp("e2e")
    async with contextlib.AsyncExitStack() as stack:
        upstream = await stack.enter_async_context(spawn_fake_upstream())
        llama = {"type": "openai", "base_url": upstream.base_url}
        echo = {"type": "fake", "completion_tokens": 4}
        config = document_of(
            [
                provider("up-a", llama, served="meta/llama", capacity=4, long_context_slots=1),
                provider("up-b", llama, served="meta/llama", capacity=4),
                provider("builtin", echo, served="echo", capacity=2),
            ],
            {"llama": ["up-a", "up-b"], "echo": ["builtin"]},
            model_settings={"llama": {"generation": {"max_tokens": 6}}},
            placement=placement,
            edge_id="edge-e2e",
            # never the default admin port: test runs may share the machine
            admin=True,
            metrics=True,
        )
        (folder / "edge.yaml").write_text(yaml.safe_dump(config))
        (folder / "node.token").write_text(node_token_of("node-1"))

        _, started = await iop_processes.edge(stack, folder / "edge.yaml")
        if placement == "node":
            await iop_processes.node(stack, started["hub_port"], "node-1", folder / "node.token")
        await iop_processes.wait_available(started["url"], ["builtin", "up-a", "up-b"])
        yield Stack(started["url"], upstream.base_url, started["metrics_url"])


@pytest_asyncio.fixture(loop_scope="module")
async def client(stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key=CLIENT_TOKEN, max_retries=0
    ) as client:
        yield client


async def in_flight(stack: Stack) -> str:
    async with httpx.AsyncClient(base_url=stack.metrics_url) as http:
        text = (await http.get("/metrics")).text
    return "\n".join(line for line in text.splitlines() if line.startswith("iop_edge_in_flight{"))


async def test_models_list(client) -> None:
    assert [m.id for m in (await client.models.list()).data] == ["llama", "echo"]


async def test_chat_completion_through_edge_node_and_upstream(client) -> None:
    response = await client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Hello"}]
    )
    assert response.choices[0].message.content
    assert response.choices[0].finish_reason == "length"  # the policy's max_tokens: 6
    assert response.usage is not None and response.usage.completion_tokens == 6


async def test_chat_stream_with_usage(client) -> None:
    stream = await client.chat.completions.create(
        model="llama",
        messages=[{"role": "user", "content": "Hello"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


async def test_chat_stream_without_usage_has_no_usage_chunk(client) -> None:
    stream = await client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "Hello"}], stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert chunks and all(chunk.choices for chunk in chunks)


async def test_text_completions_on_the_builtin_fake_adapter(client) -> None:
    response = await client.completions.create(model="echo", prompt="Say something")
    assert response.choices[0].text
    stream = await client.completions.create(model="echo", prompt="Say something", stream=True)
    assert [c async for c in stream]


async def test_errors_reach_the_client_in_openai_shape(client, stack) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "Hi"}]
        )
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"max_tokens": "many"},
        )
    assert caught.value.param == "max_tokens"
    async with openai.AsyncOpenAI(
        base_url=f"{stack.url}/v1", api_key="sk-wrong", max_retries=0
    ) as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()


async def test_usage_is_metered_and_nothing_stays_in_flight(client, stack, until) -> None:
    await asyncio.gather(
        *(
            client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "Hello"}]
            )
            for _ in range(16)
        )
    )
    async with httpx.AsyncClient(base_url=stack.metrics_url) as http:
        text = (await http.get("/metrics")).text
    chat = CLIENTS[0]  # the client's: its key is CLIENT_TOKEN
    assert f'principal_ref="{chat.principal_ref}"' in text
    assert f'token_ref="{chat.token_ref}"' in text
    assert CLIENT_TOKEN not in text

    async def idle() -> bool:
        gauges = await in_flight(stack)
        return all(line.endswith(" 0.0") for line in gauges.splitlines())

    await until(idle, timeout=2)


async def test_a_client_that_leaves_mid_stream_cancels_the_upstream_request(
    client, stack, until
) -> None:
    async with httpx.AsyncClient(base_url=stack.upstream_url.removesuffix("/v1")) as http:
        before = (await http.get("/fake/stats")).json()
        stream = await client.chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": "Hello"}],
            stream=True,
            max_tokens=4,  # under the cap; the upstream goes slowly on request
            extra_body={"fake_upstream": {"tokens_per_second": 4}},
        )
        async for _ in stream:
            break
        await stream.close()

        async def cancelled() -> dict[str, Any] | None:
            after: dict[str, Any] = (await http.get("/fake/stats")).json()
            done = after["disconnects"] > before["disconnects"] and after["in_flight"] == 0
            return after if done else None

        after = await until(cancelled, timeout=4)
        assert after["disconnects"] == before["disconnects"] + 1
        assert after["in_flight"] == 0
