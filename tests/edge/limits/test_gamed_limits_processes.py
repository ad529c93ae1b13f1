"""Budgets and tokens per minute that a client cannot game, through real processes and the
official `openai` client: a stream the client cuts before its usage chunk is charged what it
delivered, and tokens in `tools` count at admission, so a burst cannot overdraw a bucket.

One `iop edge run` and one `iop node run` serve the module (fake adapters: "slow" streams 200
tokens a second, "late" answers after 2 s, so that a burst is admitted before any of it ends).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import yaml
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from testkit import Client, node_token_of, provider
from tests.waiting import wait_until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
TPM = 4_000


def key(principal: str) -> str:
    return f"sk-{principal}-key"


@dataclass
class Edge:
    url: str
    admin_url: str
    metrics_url: str

    def client(self, principal: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=key(principal), max_retries=0, timeout=30
        )

    async def budget_used(self, principal: str) -> int:
        async with httpx.AsyncClient(base_url=self.admin_url, timeout=30) as http:
            entries = (await http.get("/status")).json()["limits"]["entries"]
        used: int = next(e for e in entries if e["principal_ref"] == principal)["use"][
            "budget_used"
        ]
        return used

    async def completion_tokens(self, principal: str) -> float:
        async with httpx.AsyncClient(base_url=self.metrics_url) as http:
            text = (await http.get("/metrics")).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("iop_edge_completion_tokens_total{")
            and f'principal_ref="{principal}"' in line
        )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def edge(
    tmp_path_factory: pytest.TempPathFactory,
    iop_processes: Any,
    document_of: Callable[..., dict[str, Any]],
) -> AsyncIterator[Edge]:
    folder = tmp_path_factory.mktemp("gamed")
    providers = [
        provider(
            "slow",
            {"type": "fake", "tokens_per_second": 200, "completion_tokens": 4000},
            served="slow",
            capacity=32,
        ),
        provider(
            "late",
            {"type": "fake", "latency_ms": 2000, "completion_tokens": 4},
            served="late",
            capacity=32,
        ),
    ]
    document = document_of(
        providers,
        {"slow": ["slow"], "late": ["late"]},
        admin=True,
        metrics=True,
        threshold=10_000_000,
        clients=[Client(f"{p}-app", key(p), p) for p in ("p-cut", "p-tools")],
        limits=[
            {"principal_ref": "p-cut", "budget": {"tokens": 1_000_000, "period": "day"}},
            {"principal_ref": "p-tools", "tokens_per_minute": TPM},
        ],
    )
    config = folder / "edge.yaml"
    config.write_text(yaml.safe_dump(document))
    token = folder / "node.token"
    token.write_text(node_token_of("node-1"))
    async with contextlib.AsyncExitStack() as stack:
        _, started = await iop_processes.edge(stack, config)
        await iop_processes.node(stack, started["hub_port"], "node-1", token)
        await iop_processes.wait_available(started["url"], ["late", "slow"])
        yield Edge(started["url"], started["admin_url"], started["metrics_url"])


async def test_a_stream_cut_before_its_usage_is_charged_what_it_delivered(edge: Edge) -> None:
    """Before: each cut stream gave its estimate back, and the budget moved by 0."""
    streams, events = 5, 40
    async with edge.client("p-cut") as api:
        for _ in range(streams):
            stream = await api.chat.completions.create(
                model="slow",
                messages=HI,
                stream=True,
                stream_options={"include_usage": True},
            )
            received = 0
            async for _chunk in stream:
                received += 1
                if received == events:
                    break
            await stream.close()  # the client leaves, long before the 4,000th token

    async def charged() -> bool:
        return await edge.budget_used("p-cut") >= streams * events

    await wait_until(charged, 20, 0.05, what="the cut streams to be charged")
    # The delivered events, one token each (a few more reached the Edge than the client read),
    # never the 4,000 tokens the answers would have had.
    assert await edge.budget_used("p-cut") < streams * 400
    assert streams * events <= await edge.completion_tokens("p-cut") < streams * 400


def tools(characters: int) -> list[ChatCompletionToolParam]:
    return [
        {
            "type": "function",
            "function": {
                "name": "search",
                "description": "x" * characters,
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]


async def test_tokens_in_tools_count_and_a_burst_cannot_overdraw_the_bucket(edge: Edge) -> None:
    """Before: only message text was estimated, so all twenty were admitted (26x the limit)."""
    async with edge.client("p-tools") as api:
        # 20 KB of tools is more than the whole minute's 4,000 tokens: it can never pass.
        with pytest.raises(openai.RateLimitError) as caught:
            await api.chat.completions.create(
                model="late", messages=HI, tools=tools(20_000), max_tokens=2
            )
        assert "Request too large" in caught.value.message
        assert caught.value.response.headers["x-should-retry"] == "false"

        async def one() -> bool:
            try:
                await api.chat.completions.create(
                    model="late", messages=HI, tools=tools(2_000), max_tokens=2
                )
            except openai.RateLimitError:
                return False
            return True

        # Twenty at once, each about 530 tokens: at most 4,000 of them are admitted together.
        admitted = sum(await asyncio.gather(*(one() for _ in range(20))))
    assert 1 <= admitted <= TPM // 530, admitted
