"""Traces with real processes: `iop edge run`, `iop node run` and `iop fake-upstream`, exporting
with the OpenTelemetry SDK over OTLP/gRPC to a real receiver (`testkit.otlp`), driven by the
official `openai` client with a `traceparent` of its own.

One trace from the client's request to the model server's: the Edge's request span continues the
client's; its wait for a slot, its limits' refusal and its run are its children; the Node's span
of the run is the run's child across the gRPC link (or on the Edge, for a node placed there);
the model server's request names the Node's span as its parent. With tracing off the client's
context still reaches the model server unchanged; a malformed one never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from iop.processes import spawn_fake_upstream
from testkit import CLIENT_TOKEN, node_token_of, provider
from testkit.otlp import OtlpReceiver, ReceivedSpan
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: The Node's span of a run: the call of its model server, named as the conventions name it.
NODE = "chat meta/llama"


@dataclass
class Stack:
    url: str
    upstream_url: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=CLIENT_TOKEN, max_retries=0, timeout=30
        )

    async def upstream_stats(self) -> dict[str, Any]:
        root = self.upstream_url.removesuffix("/v1")
        async with httpx.AsyncClient(base_url=root) as http:
            stats: dict[str, Any] = (await http.get("/fake/stats")).json()
        return stats

    async def traceparents(self) -> list[str]:
        """The `traceparent` headers the model server received, oldest first."""
        seen: list[str] = (await self.upstream_stats())["traceparents"]
        return seen


@contextlib.asynccontextmanager
async def stack(
    document_of: Any,
    processes: Any,
    folder: Path,
    placement: str,
    env: dict[str, str],
    capacity: int = 4,
    **options: Any,
) -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as exits:
        upstream = await exits.enter_async_context(spawn_fake_upstream())
        adapter = {"type": "openai", "base_url": upstream.base_url}
        document = document_of(
            [provider("up-a", adapter, served="meta/llama", capacity=capacity)],
            {"llama": ["up-a"]},
            model_settings={"llama": {"generation": {"max_tokens": 6}}},
            placement=placement,
            **options,
        )
        (folder / "edge.yaml").write_text(yaml.safe_dump(document))
        (folder / "node.token").write_text(node_token_of("node-1"))
        _, started = await processes.edge(exits, folder / "edge.yaml", env=env)
        if placement == "node":
            await processes.node(exits, started["hub_port"], "node-1", folder / "node.token", env)
        await processes.wait_available(started["url"], ["up-a"])
        yield Stack(started["url"], upstream.base_url)


def client_context() -> tuple[str, str, str]:
    """A client's own trace: its trace id, its span id, and the `traceparent` naming them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def one(spans: list[ReceivedSpan], name: str, parent: str) -> ReceivedSpan:
    """The one span named `name` whose parent is `parent`."""
    found = [s for s in spans if s.name == name and s.parent_span_id == parent]
    assert len(found) == 1, (name, parent, spans)
    return found[0]


@pytest.mark.parametrize("placement", ["node", "edge"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
async def test_one_trace_from_the_client_to_the_model_server(
    placement, streamed, document_of, iop_processes, tmp_path
) -> None:
    trace_id, client_span, traceparent = client_context()
    async with OtlpReceiver() as receiver:
        env = receiver.environment()
        async with stack(document_of, iop_processes, tmp_path, placement, env) as edge:
            async with edge.client() as client:
                if streamed:
                    stream = await client.chat.completions.create(
                        model="llama",
                        messages=[{"role": "user", "content": "Hello"}],
                        stream=True,
                        extra_headers={"traceparent": traceparent},
                    )
                    assert [chunk async for chunk in stream]
                else:
                    answer = await client.chat.completions.create(
                        model="llama",
                        messages=[{"role": "user", "content": "Hello"}],
                        extra_headers={"traceparent": traceparent},
                    )
                    assert answer.choices[0].message.content
            upstream_context = (await edge.traceparents())[-1]
            spans = await receiver.wait_for_trace(trace_id, ("chat llama", "iop.run", NODE))

    names = [s.name for s in spans]
    assert sorted(set(names) - {"iop.limits"}) == sorted(["chat llama", "iop.run", NODE]), spans
    assert len(names) == len(set(names)), spans  # one of each
    request = one(spans, "chat llama", client_span)
    assert (request.kind, request.service) == ("server", "iop-edge")
    attributes = request.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "llama"
    assert attributes["gen_ai.response.model"] == "meta/llama"
    assert attributes["gen_ai.usage.output_tokens"] == 6  # the model's policy: max_tokens 6
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < attributes["gen_ai.server.time_to_first_token"] < 30
    assert attributes["http.response.status_code"] == 200
    assert attributes["iop.principal"] == "team-search"
    assert attributes["iop.tries"] == 1

    # The principal's limits, checked in the process's own counters: microseconds, and no span
    # of their own unless they took a millisecond (a loaded machine's pause).
    limits = [s for s in spans if s.name == "iop.limits"]
    assert attributes["iop.limits_ms"] >= (1 if limits else 0)
    assert all(s.parent_span_id == request.span_id for s in limits)
    # A slot was free at once: no queue span; the run says how it was dispatched.
    assert not [s for s in spans if s.name == "iop.queue"]
    run = one(spans, "iop.run", request.span_id)
    assert run.kind == "client"
    assert run.attributes["iop.dispatch_policy"] == "round_robin"  # the default
    assert run.attributes["iop.queue_wait_ms"] == 0
    assert run.attributes["iop.provider"] == "up-a"
    assert run.attributes["iop.node"] == "node-1"
    assert (run.attributes["iop.try"], run.attributes["iop.try_reason"]) == (1, "first")

    # The Node's call of its model server, across the gRPC link (or in the Edge's process).
    node = one(spans, NODE, run.span_id)
    assert node.kind == "client"
    assert node.service == ("iop-node" if placement == "node" else "iop-edge")
    assert node.attributes["gen_ai.provider.name"] == "openai"
    assert node.attributes["server.address"] == "127.0.0.1"
    assert node.attributes["gen_ai.usage.output_tokens"] == 6
    assert node.attributes["iop.provider"] == "up-a"
    # ... whose span the model server's request names as its parent.
    assert upstream_context == f"00-{trace_id}-{node.span_id}-01"


async def test_with_tracing_off_the_clients_context_reaches_the_model_server_unchanged(
    document_of, iop_processes, tmp_path
) -> None:
    _, _, traceparent = client_context()
    malformed = "00-" + "z" * 32 + "-" + "1" * 16 + "-01"
    async with stack(document_of, iop_processes, tmp_path, "node", {}) as edge:
        async with edge.client() as client:
            for header in (traceparent, malformed):
                await client.chat.completions.create(
                    model="llama",
                    messages=[{"role": "user", "content": "Hello"}],
                    extra_headers={"traceparent": header},
                )
        assert await edge.traceparents() == [traceparent]


async def test_a_sampler_that_drops_every_trace_exports_nothing_and_says_so_downstream(
    document_of, iop_processes, tmp_path
) -> None:
    """`OTEL_TRACES_SAMPLER` as the SDK reads it: a trace not sampled is exported by no process,
    and the model server is told so (flags 00) in the same trace."""
    trace_id, _, traceparent = client_context()
    async with OtlpReceiver() as receiver:
        env = receiver.environment(OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG="0")
        async with stack(document_of, iop_processes, tmp_path, "node", env) as edge:
            async with edge.client() as client:
                await client.chat.completions.create(
                    model="llama",
                    messages=[{"role": "user", "content": "Hello"}],
                    extra_headers={"traceparent": traceparent},
                )
            (upstream_context,) = await edge.traceparents()
    assert upstream_context.startswith(f"00-{trace_id}-") and upstream_context.endswith("-00")
    assert receiver.spans == []


async def test_a_request_that_waits_for_a_slot_has_a_queue_span(
    document_of, iop_processes, tmp_path
) -> None:
    trace_id, client_span, traceparent = client_context()
    hello: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
    async with OtlpReceiver() as receiver:
        env = receiver.environment()
        async with stack(document_of, iop_processes, tmp_path, "edge", env, capacity=1) as edge:
            async with edge.client() as client:
                holder = asyncio.create_task(
                    client.chat.completions.create(
                        model="llama",
                        messages=hello,
                        extra_body={"fake_upstream": {"latency_ms": 1500}},
                    )
                )

                async def held() -> bool:
                    return int((await edge.upstream_stats())["in_flight"]) == 1

                await wait_until(held, 20, 0.05)
                await client.chat.completions.create(
                    model="llama", messages=hello, extra_headers={"traceparent": traceparent}
                )
                await holder
            names = ("chat llama", "iop.queue", "iop.run", NODE)
            spans = await receiver.wait_for_trace(trace_id, names)

    request = one(spans, "chat llama", client_span)
    queue = one(spans, "iop.queue", request.span_id)
    assert queue.attributes["gen_ai.request.model"] == "llama"
    assert queue.attributes["iop.provider"] == "up-a"
    assert queue.attributes["iop.queue_wait_ms"] > 500  # what was left of the holder's 1.5 s
    run = one(spans, "iop.run", request.span_id)
    assert run.attributes["iop.queue_wait_ms"] == queue.attributes["iop.queue_wait_ms"]


async def test_a_request_its_limits_refuse_has_a_limits_span_with_the_error(
    document_of, iop_processes, tmp_path
) -> None:
    trace_id, client_span, traceparent = client_context()
    once = {"limits": [{"principal_ref": "team-search", "requests_per_minute": 1}]}
    async with OtlpReceiver() as receiver:
        env = receiver.environment()
        async with stack(document_of, iop_processes, tmp_path, "edge", env, openai=once) as edge:
            async with edge.client() as client:
                hello: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
                await client.chat.completions.create(model="llama", messages=hello)
                with pytest.raises(openai.RateLimitError):
                    await client.chat.completions.create(
                        model="llama", messages=hello, extra_headers={"traceparent": traceparent}
                    )
            spans = await receiver.wait_for_trace(trace_id, ("chat llama", "iop.limits"))

    request = one(spans, "chat llama", client_span)
    assert request.attributes["http.response.status_code"] == 429
    assert request.attributes["error.type"] == "429"
    limits = one(spans, "iop.limits", request.span_id)
    assert limits.status == "error"
    assert limits.attributes["error.type"] == "RateLimited"
    assert not [s for s in spans if s.name == "iop.run"]  # refused before any slot
