"""Limits per principal through real processes, driven by the official `openai` client.

One `iop edge run` and one `iop node run` (fake adapters: model "fast" answers at once, "slow"
generates 40 tokens a second) serve every test of the module; each test has a principal of its
own, so their counters never meet. The fake answers report prompt_tokens = 8 for the one-word
message used here, and completion_tokens = max_tokens.

Then two Edge replicas sharing a real Redis (`openai.limit_store`) hold one fleet-wide limit
while a client alternates between them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import yaml
from openai.types.chat import ChatCompletionMessageParam

from iop.processes import spawn_iop, terminate
from testkit import Client, node_token_of, provider
from tests.waiting import wait_until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PRINCIPALS = ["p-rpm", "p-tpm", "p-conc", "p-budget", "p-retry", "p-live", "p-large", "p-embed"]
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def key(principal: str) -> str:
    return f"sk-{principal}-key"


def limits(reset_at: str) -> list[dict[str, Any]]:
    return [
        {"principal_ref": "p-rpm", "requests_per_minute": 3},
        {"principal_ref": "p-tpm", "tokens_per_minute": 100},
        {"principal_ref": "p-conc", "max_concurrent": 2},
        {
            "principal_ref": "p-budget",
            "budget": {"tokens": 60, "period": "day", "reset_at": reset_at},
        },
        {"principal_ref": "p-retry", "tokens_per_minute": 1200},
        {"principal_ref": "p-live", "max_concurrent": 1},
        {"principal_ref": "p-large", "tokens_per_minute": 20},
        {"principal_ref": "p-embed", "requests_per_minute": 2},
    ]


def document(document_of: Callable[..., dict[str, Any]], **openai_extra: Any) -> dict[str, Any]:
    providers = [
        provider("fast", {"type": "fake", "completion_tokens": 4000}, served="fast", capacity=16),
        provider(
            "slow",
            {"type": "fake", "tokens_per_second": 40, "completion_tokens": 4000},
            served="slow",
            capacity=16,
        ),
    ]
    # A budget that resets two hours from now: its Retry-After is far beyond what clients wait.
    reset = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=2)
    return document_of(
        providers,
        {"fast": ["fast"], "slow": ["slow"]},
        admin=True,
        metrics=True,
        clients=[Client(f"{p}-app", key(p), p) for p in PRINCIPALS],
        limits=limits(reset.strftime("%H:%M")),
        openai=openai_extra,
    )


@dataclass
class Edge:
    url: str
    admin_url: str
    metrics_url: str
    config_path: Path
    document: dict[str, Any]

    def client(self, principal: str, max_retries: int = 0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=key(principal), max_retries=max_retries, timeout=30
        )

    async def limited(self, principal: str) -> float:
        """iop_edge_limited_requests_total of `principal`, all limits together."""
        async with httpx.AsyncClient(base_url=self.metrics_url) as http:
            text = (await http.get("/metrics")).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("iop_edge_limited_requests_total{")
            and f'principal_ref="{principal}"' in line
        )

    async def apply(self, document: dict[str, Any]) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=self.admin_url, timeout=30) as http:
            response = await http.post("/refresh", json={"mode": "apply", "config": document})
        assert response.status_code == 200, response.text
        report: dict[str, Any] = response.json()
        return report

    async def status(self) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=self.admin_url, timeout=30) as http:
            limits: dict[str, Any] = (await http.get("/status")).json()["limits"]
        return limits


async def start_edges(
    stack: contextlib.AsyncExitStack,
    iop_processes: Any,
    folder: Path,
    doc: dict[str, Any],
    replicas: int = 1,
) -> list[Edge]:
    config_path = folder / "edge.yaml"
    config_path.write_text(yaml.safe_dump(doc))
    (folder / "node.token").write_text(node_token_of("node-1"))
    hubs: list[str] = []

    # One Node dials every replica (as Nodes do behind a headless Service): fewer processes to
    # start on a loaded machine.
    edges = []
    for _ in range(replicas):
        _, started = await iop_processes.edge(stack, config_path)
        edges.append(
            Edge(started["url"], started["admin_url"], started["metrics_url"], config_path, doc)
        )
        hubs.append(f"127.0.0.1:{started['hub_port']}")
    node = await spawn_iop(
        *("node", "run", "--node-id", "node-1", "--token-file", str(folder / "node.token")),
        *(arg for hub in hubs for arg in ("--edge", hub)),
        *iop_processes.tls.node_args(),
        "--log-level",
        "WARNING",
    )
    stack.push_async_callback(terminate, node)
    for edge in edges:
        await iop_processes.wait_available(edge.url, ["fast", "slow"])
    return edges


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def edge(
    tmp_path_factory: pytest.TempPathFactory,
    iop_processes: Any,
    document_of: Callable[..., dict[str, Any]],
) -> AsyncIterator[Edge]:
    async with contextlib.AsyncExitStack() as stack:
        folder = tmp_path_factory.mktemp("limits")
        (edge,) = await start_edges(stack, iop_processes, folder, document(document_of))
        yield edge


async def test_requests_per_minute_refuses_the_fourth_request(edge: Edge) -> None:
    client = edge.client("p-rpm")
    remaining = []
    for _ in range(3):
        raw = await client.chat.completions.with_raw_response.create(
            model="fast", messages=HI, max_tokens=2
        )
        raw.parse()
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(raw.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["2", "1", "0"]
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="fast", messages=HI, max_tokens=2)
    error = caught.value
    assert error.status_code == 429
    assert error.code == "rate_limit_exceeded"
    assert "requests per minute (openai.limits[p-rpm|*|*].requests_per_minute)" in error.message
    assert 1 <= int(error.response.headers["retry-after"]) <= 20
    assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
    # A stream is refused the same way, before it takes a slot.
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="fast", messages=HI, stream=True)
    await client.close()


async def test_embeddings_pass_the_same_admission(edge: Edge) -> None:
    client = edge.client("p-embed")
    before = await edge.limited("p-embed")
    raw = await client.embeddings.with_raw_response.create(model="fast", input=["hi", "there"])
    assert len(raw.parse().data) == 2
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    await client.chat.completions.create(model="fast", messages=HI, max_tokens=2)
    # The principal's second request of the minute was a chat: its embeddings are refused now,
    # before they take a slot, exactly as its chats are.
    with pytest.raises(openai.RateLimitError) as caught:
        await client.embeddings.create(model="fast", input="hi")
    error = caught.value
    assert error.status_code == 429
    assert error.code == "rate_limit_exceeded"
    assert "requests per minute (openai.limits[p-embed|*|*].requests_per_minute)" in error.message
    assert int(error.response.headers["retry-after"]) >= 1
    assert await edge.limited("p-embed") == before + 1
    await client.close()


async def test_tokens_per_minute_count_the_reported_usage(edge: Edge) -> None:
    client = edge.client("p-tpm")
    for _ in range(3):  # 48 tokens each: 96 < 100 after two, so the third still starts
        answer = await client.chat.completions.create(model="fast", messages=HI, max_tokens=40)
        assert answer.usage is not None and answer.usage.total_tokens == 48
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="fast", messages=HI, max_tokens=40)
    assert "tokens per minute (openai.limits[p-tpm|*|*].tokens_per_minute)" in caught.value.message
    assert caught.value.response.headers["x-ratelimit-limit-tokens"] == "100"
    await client.close()


async def test_a_request_too_large_for_its_limit_is_not_retried(edge: Edge) -> None:
    client = edge.client("p-large", max_retries=2)
    before = await edge.limited("p-large")
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(
            model="fast", messages=[{"role": "user", "content": "word " * 40}], max_tokens=2
        )
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "Request too large" in caught.value.message
    assert await edge.limited("p-large") == before + 1  # the client sent it once
    await client.close()


async def test_max_concurrent_holds_requests_in_progress(edge: Edge) -> None:
    client = edge.client("p-conc")
    async with contextlib.AsyncExitStack() as streams:
        for _ in range(2):  # admitted once their first chunk arrives; 10 s of tokens each
            stream = await streams.enter_async_context(
                await client.chat.completions.create(
                    model="slow", messages=HI, max_tokens=400, stream=True
                )
            )
            await anext(aiter(stream))
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="fast", messages=HI, max_tokens=2)
        assert "Too many requests at once for principal p-conc" in caught.value.message
        assert "Limit 2, In progress 2" in caught.value.message

    # Both streams closed by their client: their places come back as the Edge sees them go.
    async def served() -> bool:
        try:
            await client.chat.completions.create(model="fast", messages=HI, max_tokens=2)
        except openai.RateLimitError:
            return False
        return True

    await wait_until(served, 10, 0.05, what="the closed streams' places to come back")
    await client.close()


async def test_a_budget_refuses_until_its_reset_and_the_client_does_not_wait(edge: Edge) -> None:
    client = edge.client("p-budget", max_retries=2)
    for _ in range(2):  # 48 each: after the first, 48 + 1 <= 60 still starts
        await client.chat.completions.create(model="fast", messages=HI, max_tokens=40)
    before = await edge.limited("p-budget")
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="fast", messages=HI, max_tokens=40)
    assert "Token budget used up for principal p-budget" in caught.value.message
    assert "Limit 60, Used 96, Requested 1. It resets at" in caught.value.message
    assert int(caught.value.response.headers["retry-after"]) > 3600
    assert await edge.limited("p-budget") == before + 1  # too far off: not retried
    status = {e["principal_ref"]: e for e in (await edge.status())["entries"]}
    assert status["p-budget"]["use"]["budget_used"] == 96
    await client.close()


async def test_the_openai_client_backs_off_on_the_headers_and_gets_through(edge: Edge) -> None:
    """tokens_per_minute 1,200 refills 20 a second; an answer of 1,300 tokens leaves the
    bucket about 100 in debt: the next request waits ~5 s, which the client reads from
    retry-after-ms."""
    once = edge.client("p-retry")
    await once.chat.completions.create(model="fast", messages=HI, max_tokens=1292)
    with pytest.raises(openai.RateLimitError) as caught:
        await once.chat.completions.create(model="fast", messages=HI, max_tokens=2)
    headers = caught.value.response.headers
    assert 1 <= int(headers["retry-after-ms"]) <= 6000
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    refused = await edge.limited("p-retry")
    patient = edge.client("p-retry", max_retries=3)
    answer = await patient.chat.completions.create(model="fast", messages=HI, max_tokens=2)
    assert answer.choices[0].finish_reason is not None
    assert await edge.limited("p-retry") >= refused + 1  # refused first, then let through
    await once.close()
    await patient.close()


async def test_a_live_change_applies_at_once_and_loses_no_request(edge: Edge) -> None:
    client = edge.client("p-live")
    async with await client.chat.completions.create(
        model="slow", messages=HI, max_tokens=120, stream=True
    ) as held:
        chunks = [await anext(aiter(held))]
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="fast", messages=HI, max_tokens=2)
        changed = {**edge.document, "openai": {**edge.document["openai"]}}
        changed["openai"]["limits"] = [
            {**entry, "max_concurrent": 2} if entry["principal_ref"] == "p-live" else entry
            for entry in edge.document["openai"]["limits"]
        ]
        report = await edge.apply(changed)
        assert report["live_paths"] == ["openai.limits[p-live|*|*].max_concurrent"]
        await client.chat.completions.create(model="fast", messages=HI, max_tokens=2)
        chunks += [chunk async for chunk in held]
    assert chunks[-1].choices[0].finish_reason == "length"  # the held stream ended whole
    entry = next(e for e in (await edge.status())["entries"] if e["principal_ref"] == "p-live")
    assert entry["limits"] == {"max_concurrent": 2}
    await client.close()


# -- two replicas, one Redis --------------------------------------------------------------------


@pytest.mark.slow
async def test_two_replicas_hold_one_fleet_wide_limit(
    tmp_path: Path,
    iop_processes: Any,
    document_of: Callable[..., dict[str, Any]],
    redis_url: str,
) -> None:
    store = {"url": redis_url, "key_prefix": f"fleet{os.urandom(4).hex()}"}
    doc = document(document_of, limit_store=store)
    doc["openai"]["limits"] = [
        {"principal_ref": "p-rpm", "requests_per_minute": 30},
        {"principal_ref": "p-conc", "max_concurrent": 3},
    ]
    async with contextlib.AsyncExitStack() as stack:
        edges = await start_edges(stack, iop_processes, tmp_path, doc, replicas=2)
        clients = [edge.client("p-rpm") for edge in edges]
        admitted = [0, 0]
        refused = 0
        started = time.monotonic()
        for attempt in range(60):  # alternating replicas, as a Service's connections would
            replica = attempt % 2
            try:
                await clients[replica].chat.completions.create(
                    model="fast", messages=HI, max_tokens=2
                )
            except openai.RateLimitError:
                refused += 1
            else:
                admitted[replica] += 1
        elapsed = time.monotonic() - started
        # Exactly the bucket, plus what refilled meanwhile (one request per 2 s): the stated
        # error of the shared store is none beyond the limit's own refill.
        assert 30 <= sum(admitted) <= 30 + int(elapsed / 2) + 1, (admitted, elapsed)
        assert min(admitted) > 0 and refused == 60 - sum(admitted)

        conc = [edge.client("p-conc") for edge in edges]
        async with contextlib.AsyncExitStack() as streams:
            for replica in (0, 1, 0):
                stream = await streams.enter_async_context(
                    await conc[replica].chat.completions.create(
                        model="slow", messages=HI, max_tokens=400, stream=True
                    )
                )
                await anext(aiter(stream))
            for replica in (0, 1):
                with pytest.raises(openai.RateLimitError) as caught:
                    await conc[replica].chat.completions.create(
                        model="fast", messages=HI, max_tokens=2
                    )
                assert "Limit 3, In progress 3" in caught.value.message
        for client in (*clients, *conc):
            await client.close()
        status = await edges[1].status()
        assert status["counted"] == "shared" and status["store"] == redis_url
