"""Retries before the first byte and fallback models with real processes: `iop edge run`,
`iop node run` and `iop fake-upstream` with injected faults (`--fail-rate`, each `--fail-mode`),
driven by the official `openai` client (its own retries off) over real sockets.

The upstreams count the completion requests they received (`/fake/stats`), so the tests count
every try the Edge made, retries included.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from iop.processes import UpstreamProcess, spawn_fake_upstream
from testkit import CLIENT_TOKEN, Placement, edge_document, node_token_of, provider

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


@dataclass
class Pool:
    """An Edge process, its Node processes and the upstreams they call."""

    url: str
    metrics_url: str
    upstreams: Mapping[str, UpstreamProcess]
    nodes: dict[str, asyncio.subprocess.Process]
    owners: Mapping[str, contextlib.AsyncExitStack]

    async def stop_upstream(self, name: str) -> None:
        """Stop upstream `name` (SIGTERM): its port refuses connections from then on."""
        await self.owners[name].aclose()

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=CLIENT_TOKEN, max_retries=0, timeout=30
        )

    async def completions(self, name: str) -> int:
        """Completion requests upstream `name` received so far."""
        async with httpx.AsyncClient() as http:
            stats = await http.get(f"http://{self.upstreams[name].listen}/fake/stats")
        return int(stats.json()["completions"])

    async def stats(self, name: str) -> dict[str, int]:
        async with httpx.AsyncClient() as http:
            document: dict[str, int] = (
                await http.get(f"http://{self.upstreams[name].listen}/fake/stats")
            ).json()
        return document

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of metric `name` whose labels include `labels`."""
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{self.metrics_url}/metrics")).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(
                f'{key}="{value}"' in line for key, value in labels.items()
            ):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextlib.asynccontextmanager
async def pool(
    folder: Path,
    iop_processes: Any,
    tls: Any,
    *,
    upstreams: Mapping[str, Sequence[str]],
    nodes: Mapping[str, Mapping[str, str]],
    models: Mapping[str, Sequence[str]] | None = None,
    model_settings: Mapping[str, Mapping[str, Any]] | None = None,
    retries: Mapping[str, Any] | None = None,
    adapters: Mapping[str, Mapping[str, Any]] | None = None,
    health: Mapping[str, Mapping[str, Any]] | None = None,
    placement: Placement = "node",
) -> AsyncIterator[Pool]:
    """Fake upstreams (name -> their flags), nodes (node id -> provider id -> upstream name, each
    provider serving `<upstream>-served`; `adapters` adds settings to a provider's adapter,
    `health` sets its health policy), models over them (default: `m` on every provider), an Edge
    over them, and the nodes connected (or, with `placement="edge"`, placed on the Edge: no Node
    process)."""
    async with contextlib.AsyncExitStack() as stack:
        owners = {name: stack.enter_context(_nested(stack)) for name in upstreams}
        started = {
            name: await owners[name].enter_async_context(spawn_fake_upstream(list(args)))
            for name, args in upstreams.items()
        }
        config = edge_document(
            {
                node_id: [
                    provider(
                        provider_id,
                        {
                            "type": "openai",
                            "base_url": started[upstream].base_url,
                            **(adapters or {}).get(provider_id, {}),
                        },
                        served=f"{upstream}-served",
                        capacity=16,
                        health=dict((health or {}).get(provider_id, {})),
                    )
                    for provider_id, upstream in providers.items()
                ]
                for node_id, providers in nodes.items()
            },
            models,
            model_settings=model_settings,
            placement=placement,
            edge_id="edge-retries",
            tls=tls.edge_section(),
            admin=True,
            metrics=True,
            openai={"retries": dict(retries or {})},
        )
        (folder / "edge.yaml").write_text(yaml.safe_dump(config))
        _, edge = await iop_processes.edge(stack, folder / "edge.yaml")
        processes = {}
        for node_id in nodes if placement == "node" else ():
            (folder / f"{node_id}.token").write_text(node_token_of(node_id))
            processes[node_id] = await iop_processes.node(
                stack, edge["hub_port"], node_id, folder / f"{node_id}.token"
            )
        every = sorted(pid for providers in nodes.values() for pid in providers)
        await iop_processes.wait_available(edge["url"], every)
        yield Pool(edge["url"], edge["metrics_url"], started, processes, owners)


@contextlib.contextmanager
def _nested(outer: contextlib.AsyncExitStack) -> Iterator[contextlib.AsyncExitStack]:
    """An exit stack closed with `outer`, or earlier by its owner."""
    inner = contextlib.AsyncExitStack()
    outer.push_async_callback(inner.aclose)
    yield inner


async def answers(
    client: openai.AsyncOpenAI, model: str, count: int, *, stream: bool, concurrency: int = 8
) -> list[str | BaseException]:
    """`count` requests, `concurrency` at a time: each one's text, or what it raised."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> str:
        async with gate:
            if not stream:
                response = await client.chat.completions.create(
                    model=model, messages=HELLO, max_tokens=4
                )
                return response.choices[0].message.content or ""
            chunks = await client.chat.completions.create(
                model=model, messages=HELLO, max_tokens=4, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    return list(await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True))


def errors(results: list[str | BaseException]) -> list[BaseException]:
    return [r for r in results if isinstance(r, BaseException)]


TWO_PROVIDERS = {"node-1": {"p-good": "good", "p-flaky": "flaky"}}


@pytest.mark.parametrize(
    ("mode", "placement"),
    [
        ("status", "node"),
        ("drop", "node"),
        ("drop-mid-stream", "node"),
        ("drop", "edge"),
        ("drop-mid-stream", "edge"),
    ],
)
async def test_one_provider_failing_30_percent_costs_clients_no_error(
    tmp_path, iop_processes, tls, mode, placement
) -> None:
    flaky = ["--fail-rate", "0.3", "--fail-mode", mode, "--seed", "15"]
    async with pool(
        tmp_path,
        iop_processes,
        tls,
        upstreams={"good": [], "flaky": flaky},
        nodes=TWO_PROVIDERS,
        placement=placement,
    ) as stack:
        async with stack.client() as client:
            whole = await answers(client, "m", 150, stream=False)
            assert errors(whole) == []
            flaky_stats, good_stats = await stack.stats("flaky"), await stack.stats("good")
            injected = flaky_stats["failures_injected"]
            assert injected >= 5
            # Each failure was retried once, on the other provider (never on the same one).
            assert await stack.metric("iop_edge_retries_total", model="m") == injected
            assert flaky_stats["completions"] + good_stats["completions"] == 150 + injected

            before = {name: await stack.stats(name) for name in ("good", "flaky")}
            streams = await answers(client, "m", 150, stream=True)
            after = {name: await stack.stats(name) for name in ("good", "flaky")}
        injected = after["flaky"]["failures_injected"] - before["flaky"]["failures_injected"]
        tries = sum(after[n]["completions"] - before[n]["completions"] for n in after)
        assert injected >= 5
        if mode != "drop-mid-stream":
            # Each stream failed before its first byte: retried, and the client saw nothing.
            assert errors(streams) == []
            assert tries == 150 + injected
        else:
            # Each failed after its first byte: the stream's error event, never a retry.
            assert len(errors(streams)) == injected
            assert all(isinstance(e, openai.APIError) for e in errors(streams))
            assert tries == 150


@pytest.mark.parametrize(
    ("model_settings", "adapters"),
    [
        # the Node gives up on an upstream that sends nothing for 0.3 s: upstream_timeout
        pytest.param({}, {"p-flaky": {"request_timeout_s": 0.3}}, id="node-adapter"),
        # the Edge cancels a try with no first byte after 0.3 s (the model's live setting)
        pytest.param({"m": {"first_byte_timeout_ms": 300}}, {}, id="edge-model"),
    ],
)
@pytest.mark.parametrize("placement", ["node", "edge"])
async def test_a_provider_that_sends_no_first_byte_in_time_is_retried_elsewhere(
    placement, tmp_path, iop_processes, tls, until, model_settings, adapters
) -> None:
    async with pool(
        tmp_path,
        iop_processes,
        tls,
        upstreams={"good": [], "flaky": ["--latency-ms", "5000"]},
        nodes=TWO_PROVIDERS,
        model_settings=model_settings,
        adapters=adapters,
        placement=placement,
    ) as stack:
        async with stack.client() as client:
            whole = await answers(client, "m", 10, stream=False, concurrency=2)
            streams = await answers(client, "m", 10, stream=True, concurrency=2)
        assert errors(whole) == errors(streams) == []
        timeouts = await stack.metric("iop_edge_retries_total", reason="upstream_timeout")
        assert timeouts == await stack.completions("flaky") >= 1

        # Each abandoned try was cancelled up to the upstream: it saw the client leave, and
        # nothing is left running there.
        async def all_cancelled() -> bool:
            flaky = await stack.stats("flaky")
            return (flaky["disconnects"], flaky["in_flight"]) == (timeouts, 0)

        await until(all_cancelled, timeout=5)


@pytest.mark.parametrize("placement", ["node", "edge"])
async def test_a_provider_too_slow_for_the_first_byte_deadline_leaves_dispatch(
    placement, tmp_path, iop_processes, tls, until
) -> None:
    """The Edge's cancels for a late first byte count on the Node as the provider's upstream
    timeouts: after `request_failure_threshold` of them in a row it is out of dispatch (the
    upstream's probes still pass: it answers /v1/models at once), and requests stop paying the
    deadline. The same holds for a node placed on the Edge."""
    async with pool(
        tmp_path,
        iop_processes,
        tls,
        upstreams={"good": [], "flaky": ["--latency-ms", "5000"]},
        nodes=TWO_PROVIDERS,
        model_settings={"m": {"first_byte_timeout_ms": 200}},
        health={"p-flaky": {"request_failure_threshold": 3}},
        placement=placement,
    ) as stack:
        async with stack.client() as client, httpx.AsyncClient(base_url=stack.url) as http:

            async def flaky_health() -> dict[str, Any] | None:
                providers = (await http.get("/readyz")).json()["providers"]
                health: dict[str, Any] = providers["p-flaky"]
                return None if health["healthy"] else health

            # One at a time, each tries p-flaky first (same priority, its id sorts first), once
            # it no longer sits out the moment that follows a failed try.
            for _ in range(3):
                assert errors(await answers(client, "m", 1, stream=False)) == []
                await asyncio.sleep(0.2)
            out = await until(flaky_health, timeout=10)
            assert out["reason"] == "request_failures", out
            tried = await stack.completions("flaky")
            assert tried == 3
            assert errors(await answers(client, "m", 10, stream=False, concurrency=2)) == []
            assert await stack.completions("flaky") == tried  # no try went there any more


async def test_the_budget_bounds_retries_when_the_whole_pool_fails(
    tmp_path, iop_processes, tls
) -> None:
    down = ["--fail-rate", "1", "--fail-mode", "status"]
    requests = 100
    async with pool(
        tmp_path,
        iop_processes,
        tls,
        upstreams={"good": down, "flaky": down},
        nodes=TWO_PROVIDERS,
        retries={"budget_percent": 20, "budget_min_per_second": 0, "budget_window_ms": 600_000},
    ) as stack:
        async with stack.client() as client:
            results = await answers(client, "m", requests, stream=False, concurrency=4)
        assert len(errors(results)) == requests
        assert all(isinstance(e, openai.InternalServerError) for e in errors(results))
        hits = await stack.completions("good") + await stack.completions("flaky")
        # At most (1 + 20%) x the requests, where two retries each would have made it 3x; and
        # the budget is used, not merely unused.
        assert requests * 1.15 <= hits <= requests * 1.2
        assert await stack.metric("iop_edge_retries_refused_total", model="m") >= requests * 0.8


async def test_fallback_models_answer_when_the_models_providers_fail_or_leave(
    tmp_path, iop_processes, tls, until
) -> None:
    async with pool(
        tmp_path,
        iop_processes,
        tls,
        upstreams={"main": [], "spare": []},
        nodes={"node-1": {"p-main": "main"}, "node-2": {"p-spare": "spare"}},
        models={"m": ["p-main"], "spare": ["p-spare"]},
        model_settings={"m": {"fallbacks": ["spare"]}},
    ) as stack:
        async with stack.client() as client:
            answer = await client.chat.completions.create(model="m", messages=HELLO)
            assert answer.model == "main-served"

            # The main upstream dies: every provider of `m` fails (connection refused).
            await stack.stop_upstream("main")
            answer = await client.chat.completions.create(model="m", messages=HELLO)
            assert answer.model == "spare-served"  # the model that served
            streamed = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
            assert {c.model async for c in streamed} == {"spare-served"}
            assert (
                await stack.metric("iop_edge_fallbacks_total", fallback="spare", reason="failed")
                == 2
            )

            # node-1 leaves: no provider of `m` is in dispatch, the fallback answers at once.
            stack.nodes["node-1"].terminate()
            await stack.nodes["node-1"].wait()
            async with httpx.AsyncClient(base_url=stack.url) as http:

                async def only_spare() -> bool:
                    ready = (await http.get("/readyz")).json()
                    return bool(ready["providers_available"] == ["p-spare"])

                await until(only_spare, timeout=20, interval=0.05)
            answers_now = await answers(client, "m", 5, stream=False)
            assert errors(answers_now) == []
            labels = {"fallback": "spare", "reason": "unavailable"}
            assert await stack.metric("iop_edge_fallbacks_total", **labels) == 5
