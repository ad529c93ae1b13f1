"""Dispatch policies and embeddings with real processes: `iop edge run` (two replicas where it
matters), `iop node run`, and `iop fake-upstream --gpu` servers whose prefix caches tell where a
conversation's turns went (a turn served where the previous one was finds it cached), driven by
the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml

from iop.fakes import EMBEDDING_DIMENSIONS, embedding_vector
from iop.processes import UpstreamProcess, spawn_fake_upstream, spawn_iop, terminate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: Fast simulated servers: the tests read their caches, not their timings.
GPU = ["--gpu", "--gpu-step-ms", "2", "--gpu-step-ms-per-seq", "0.1"]
GPU += ["--gpu-prefill-tokens-per-s", "500000", "--model", "served"]
SYSTEM = "You answer questions about the Apollo programme, briefly and exactly. " * 6


@dataclass
class Fleet:
    upstreams: list[UpstreamProcess]
    urls: list[str]
    admin_urls: list[str]
    folder: Path
    document: dict[str, Any]


@dataclass
class Setup:
    """What every test here needs from the conftest: its config builder, keys and processes."""

    document_of: Any
    client_token: str
    node_token: str
    processes: Any


@pytest.fixture
def setup(document_of: Any, tokens: dict[str, str], node_token: str, iop_processes: Any) -> Setup:
    return Setup(document_of, tokens["search-chat"], node_token, iop_processes)


def fleet_document(
    setup: Setup, upstreams: list[UpstreamProcess], policy: str, capacity: int = 8, **extra: Any
) -> dict[str, Any]:
    providers = [
        {
            "id": f"gpu-{i}",
            "adapter": {"type": "openai", "base_url": upstream.base_url},
            "served_models": ["served"],
            "capacity": capacity,
            "health": {"interval_ms": 200},
            **extra,
        }
        for i, upstream in enumerate(upstreams, start=1)
    ]
    document: dict[str, Any] = setup.document_of(
        providers,
        {"m": [p["id"] for p in providers]},
        model_settings={"m": {"dispatch": {"policy": policy}}},
        edge={"admin": {"listen": "127.0.0.1:0"}},
    )
    return document


@contextlib.asynccontextmanager
async def fleet(
    setup: Setup,
    folder: Path,
    policy: str,
    *,
    edges: int = 1,
    servers: int = 4,
    capacity: int = 8,
    upstream_args: list[str] | None = None,
) -> AsyncIterator[Fleet]:
    """`servers` fake upstreams (simulated GPUs), one Node over them, `edges` Edge replicas."""
    processes = setup.processes
    async with contextlib.AsyncExitStack() as stack:
        upstreams = [
            await stack.enter_async_context(spawn_fake_upstream(upstream_args or GPU))
            for _ in range(servers)
        ]
        document = fleet_document(setup, upstreams, policy, capacity)
        (folder / "edge.yaml").write_text(yaml.safe_dump(document))
        started = [(await processes.edge(stack, folder / "edge.yaml"))[1] for _ in range(edges)]
        (folder / "node.token").write_text(setup.node_token)
        hubs = [arg for s in started for arg in ("--edge", f"127.0.0.1:{s['hub_port']}")]
        node = await spawn_iop(
            *("node", "run", *hubs, "--node-id", "node-1", "--token-file"),
            *(str(folder / "node.token"), "--log-level", "WARNING", *processes.tls.node_args()),
        )
        stack.push_async_callback(terminate, node)
        ids = [f"gpu-{i}" for i in range(1, servers + 1)]
        for s in started:
            await processes.wait_available(s["url"], ids)
        yield Fleet(
            upstreams,
            [str(s["url"]) for s in started],
            [str(s["admin_url"]) for s in started],
            folder,
            document,
        )


def client(setup: Setup, url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=setup.client_token, max_retries=0, timeout=60
    )


async def converse(
    clients: list[openai.AsyncOpenAI], name: str, turns: int
) -> list[tuple[int, int]]:
    """One conversation, its turns sent to the clients in turn; (prompt, cached) tokens each."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    seen = []
    for turn, api in zip(range(turns), itertools.cycle(clients), strict=False):
        messages.append({"role": "user", "content": f"{name} asks question number {turn}."})
        stream = await api.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        seen.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages.append({"role": "assistant", "content": text})
    return seen


def followed(seen: list[tuple[int, int]]) -> list[bool]:
    """For each turn after the first: did it find the whole turn before it (prompt, but for its
    last partial block) in its server's cache, that is, did it go where that turn went?"""
    return [cached >= before - 16 for (before, _), (_, cached) in itertools.pairwise(seen)]


async def test_a_conversation_stays_on_one_server_across_two_edge_replicas(
    setup: Setup, tmp_path: Path
) -> None:
    # Capacity to spare: no home reaches its load bound, which would move a conversation on one
    # replica only (bounded load is tested in tests/edge/pool/test_choosing.py). With a capacity of
    # 8 a home keeps at most 5 requests at once, and on a busy machine the turns of the eight
    # conversations overlapped past that.
    async with fleet(setup, tmp_path, "prefix_affinity", edges=2, capacity=64) as running:
        clients = [client(setup, url) for url in running.urls]
        try:
            conversations = await asyncio.gather(
                *(converse(clients, f"user-{i}", 4) for i in range(8))
            )
        finally:
            for api in clients:
                await api.close()
        async with httpx.AsyncClient() as http:
            stats = [
                orjson.loads((await http.get(f"http://{u.listen}/fake/stats")).content)
                for u in running.upstreams
            ]
            status = [(await http.get(f"{url}/status")).json() for url in running.admin_urls]
    # Every turn after the first went where the turn before it went, whichever replica sent it.
    assert all(all(followed(seen)) for seen in conversations), conversations
    # ...and the conversations spread over the servers rather than piling on one.
    assert sum(s["completed"] for s in stats) == 32
    assert sum(1 for s in stats if s["completed"]) >= 2, stats
    for document in status:
        choices = document["dispatch"]["m"]["choices"]
        assert document["dispatch"]["m"]["policy"] == "prefix_affinity"
        assert set(choices) == {"prefix_affinity/affinity"}, choices
        assert sum(choices.values()) == 16  # each replica sent half the turns


async def test_round_robin_scatters_a_conversation_over_the_servers(
    setup: Setup, tmp_path: Path
) -> None:
    """The control of the test above: what it checks does fail without affinity."""
    async with fleet(setup, tmp_path, "round_robin", servers=3) as running:
        api = client(setup, running.urls[0])
        try:
            seen = await converse([api], "wanderer", 4)
        finally:
            await api.close()
    assert not any(followed(seen)), seen


async def test_a_live_policy_change_under_load_loses_no_request(
    setup: Setup, tmp_path: Path
) -> None:
    # Decoding at 20 ms a step: a 16-token answer streams for over 300 ms, across an apply.
    slower = [*GPU[:2], "20", *GPU[3:]]
    async with fleet(setup, tmp_path, "round_robin", servers=3, upstream_args=slower) as running:
        statuses: list[int] = []
        held_ends: list[str | None] = []
        stop = asyncio.Event()

        async def load(api: openai.AsyncOpenAI, worker: int) -> None:
            for turn in itertools.count():
                if stop.is_set():
                    return
                messages: Any = [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"worker {worker} turn {turn}"},
                ]
                try:
                    if turn % 2:
                        stream = await api.chat.completions.create(
                            model="m", messages=messages, max_tokens=4, stream=True
                        )
                        async for _ in stream:
                            pass
                    else:
                        await api.chat.completions.create(
                            model="m", messages=messages, max_tokens=4
                        )
                    statuses.append(200)
                except openai.APIStatusError as error:
                    statuses.append(error.status_code)

        api = client(setup, running.urls[0])
        admin = httpx.AsyncClient(base_url=running.admin_urls[0], timeout=30)
        try:
            workers = [asyncio.ensure_future(load(api, n)) for n in range(12)]
            policies = ["least_load", "prefix_affinity", "round_robin"] * 3
            for policy in policies:
                # A run that certainly started under the old policy and ends under the new one.
                held = await api.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"held across {policy}"}],
                    max_tokens=16,
                    stream=True,
                )
                chunks = [await anext(aiter(held))]
                document = running.document
                document["models"][0]["dispatch"] = {"policy": policy, "load_factor": 1.5}
                answer = await admin.post("/refresh", json={"mode": "apply", "config": document})
                assert answer.status_code == 200, answer.text
                assert answer.json()["outcome"] == "applied"
                chunks += [chunk async for chunk in held]
                held_ends.append(chunks[-1].choices[0].finish_reason)
                served = len(statuses)
                while len(statuses) < served + 10:  # some load on each policy
                    await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*workers)
            status = (await admin.get("/status")).json()
        finally:
            await admin.aclose()
            await api.close()
    assert statuses and set(statuses) == {200}
    assert held_ends == ["length"] * len(policies)  # every held stream ended whole
    assert status["dispatch"]["m"]["policy"] == "round_robin"
    policies_seen = {key.split("/")[0] for key in status["dispatch"]["m"]["choices"]}
    assert policies_seen == {"round_robin", "least_load", "prefix_affinity"}


async def test_least_load_sees_the_servers_queue_through_the_node(
    setup: Setup, tmp_path: Path, until: Any
) -> None:
    slow = ["--gpu", "--gpu-max-batch", "1", "--gpu-step-ms", "200", "--model", "served"]
    async with fleet(setup, tmp_path, "least_load", servers=2, upstream_args=slow) as running:
        # Requests from outside IOP fill the first server: one runs, two wait.
        async with httpx.AsyncClient(timeout=60) as http:
            outside = [
                asyncio.ensure_future(
                    http.post(
                        f"{running.upstreams[0].base_url}/completions",
                        json={"model": "served", "prompt": "x", "max_tokens": 50},
                    )
                )
                for _ in range(3)
            ]

            async def reported() -> Any:
                status = (await http.get(f"{running.admin_urls[0]}/status")).json()
                load = status["nodes"][0]["providers"][0]["load"]
                return load if load["server"] and load["server"]["waiting"] == 2 else None

            await until(reported, 20)
            load = await reported()
            assert load["server"]["running"] == 1
            assert load["load"] == 3 and load["edge_in_flight"] == 0
            # So this Edge's requests go to the other server while the first one is busy.
            api = client(setup, running.urls[0])
            try:
                for _ in range(3):
                    await api.completions.create(model="m", prompt="hello", max_tokens=2)
            finally:
                await api.close()
            second = orjson.loads(
                (await http.get(f"http://{running.upstreams[1].listen}/fake/stats")).content
            )
            assert second["completed"] == 3
            for request in outside:
                request.cancel()
            await asyncio.gather(*outside, return_exceptions=True)
            status = (await http.get(f"{running.admin_urls[0]}/status")).json()
            assert status["dispatch"]["m"]["choices"] == {"least_load/least_load": 3}


async def test_embeddings_go_through_the_pool_with_the_official_client(
    setup: Setup, tmp_path: Path
) -> None:
    failing = ["--fail-rate", "1", "--model", "served"]  # every request fails with a 500
    processes = setup.processes
    async with contextlib.AsyncExitStack() as stack:
        good = await stack.enter_async_context(spawn_fake_upstream(["--model", "served"]))
        bad = await stack.enter_async_context(spawn_fake_upstream(failing))
        # Probes pass on the failing one (it fails completions only): retries must save it.
        document = fleet_document(setup, [bad, good], "round_robin")
        document["edge"]["metrics"] = {"listen": "127.0.0.1:0"}
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        _, started = await processes.edge(stack, tmp_path / "edge.yaml")
        (tmp_path / "node.token").write_text(setup.node_token)
        await processes.node(stack, started["hub_port"], "node-1", tmp_path / "node.token")
        await processes.wait_available(started["url"], ["gpu-1", "gpu-2"])
        api = client(setup, str(started["url"]))
        try:
            texts = ["first input", "a second, longer input"]
            default = await api.embeddings.create(model="m", input=texts)  # base64 on the wire
            floats = await api.embeddings.create(model="m", input=texts, encoding_format="float")
            single = await api.embeddings.create(model="m", input="alone", dimensions=4)
            ids = await api.embeddings.create(model="m", input=[[1, 2, 3], [4, 5]])
            with pytest.raises(openai.BadRequestError) as refused:
                await api.embeddings.create(model="m", input=[])
        finally:
            await api.close()
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{started['metrics_url']}/metrics")).text
            bad_stats = orjson.loads((await http.get(f"http://{bad.listen}/fake/stats")).content)
    for answer in (default, floats):
        assert [item.index for item in answer.data] == [0, 1]
        for item, text in zip(answer.data, texts, strict=True):
            assert item.embedding == pytest.approx(embedding_vector(text, EMBEDDING_DIMENSIONS))
        assert answer.model == "served"
        assert answer.usage.prompt_tokens == 6 and answer.usage.total_tokens == 6
    assert len(single.data[0].embedding) == 4
    assert len(ids.data) == 2
    assert "input" in str(refused.value)
    # Half the tries met the failing server and were retried on the good one.
    assert bad_stats["embeddings"] > 0
    prompt_lines = [
        line
        for line in metrics.splitlines()
        if line.startswith("iop_edge_prompt_tokens_total") and 'provider="gpu-2"' in line
    ]
    assert prompt_lines and float(prompt_lines[0].split()[-1]) == 6 + 6 + 1 + 5
