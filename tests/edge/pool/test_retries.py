"""Retries before the first byte, the retry budget and fallback models (docs/edge.md, "Retries and
fallbacks"): the official `openai` client against a real uvicorn server, with a fake node hub at
the request path's seam whose script decides which provider fails how.

Models: `m` on providers a (priority 1) and b (priority 2), falling back to `backup` (provider c);
`solo` on provider s alone, with no fallback.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from typing import Any

import openai
import orjson
import pytest
import pytest_asyncio
from openai.types.chat import ChatCompletionMessageParam

from iop.edge import EdgeServer
from iop.edge.pool import CANDIDATE, Split
from iop.verdicts import Figures
from iop.wire import RunChunk, RunEvent, RunFailed, RunRequest
from iop.wire import statuses as wire_statuses

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


@pytest_asyncio.fixture
async def start(
    config_of, provider, fake_hub, tokens, until
) -> AsyncIterator[Callable[..., Awaitable[tuple[EdgeServer, openai.AsyncOpenAI]]]]:
    """`await start(retries={...})`: an Edge over the fake hub, and a client of it."""
    started: list[tuple[EdgeServer, openai.AsyncOpenAI]] = []

    async def run(
        first_byte_timeout_ms: Mapping[str, int] | None = None, **retries: Any
    ) -> tuple[EdgeServer, openai.AsyncOpenAI]:
        config = config_of(
            [
                provider("a", priority=1),
                provider("b", priority=2),
                provider("c"),
                provider("s"),
            ],
            {"m": ["a", "b"], "backup": ["c"], "solo": ["s"]},
            openai={"retries": retries},
            model_settings={
                "m": {"generation": {"max_tokens": 100, "temperature": 0.5}},
                "backup": {"generation": {"max_tokens": 10}},
            },
        )
        document = config.model_dump(mode="json")
        document["models"][0]["fallbacks"] = ["backup"]
        for model in document["models"]:
            model["first_byte_timeout_ms"] = (first_byte_timeout_ms or {}).get(model["id"])
        config = type(config).model_validate(document)
        edge = EdgeServer(config, hub=fake_hub, openai_listen="127.0.0.1:0", shutdown_grace_s=1)
        await edge.start()
        fake_hub.connect("a", "b", "c", "s")
        client = openai.AsyncOpenAI(
            base_url=f"{edge.url}/v1", api_key=tokens["search-chat"], max_retries=0
        )
        started.append((edge, client))
        return edge, client

    yield run
    for edge, client in started:
        await client.close()

        def idle(edge: EdgeServer = edge) -> bool:
            counts = edge.dispatcher.in_flight_counts().values()
            return all(n == (0, 0) for n in counts) and not edge.dispatcher.waiting

        await until(idle, timeout=2)
        await edge.stop()
    assert not fake_hub.active


def failing(
    fake_hub: Any,
    providers: Collection[str],
    code: str = wire_statuses.UPSTREAM_ERROR,
    times: int = -1,
) -> None:
    """Make `providers` fail their runs before the first byte (`times` times, -1: always)."""
    echo = fake_hub.script
    left = {pid: times for pid in providers}

    async def script(request: RunRequest) -> AsyncIterator[RunEvent]:
        if left.get(request.provider_id, 0) != 0:
            left[request.provider_id] -= 1
            yield wire_statuses.failure(code, f"{request.provider_id} failed", status=500)
            return
        async for event in echo(request):
            yield event

    fake_hub.script = script


def silent(fake_hub: Any, providers: Collection[str], seconds: float = 30) -> None:
    """Make `providers` send nothing for `seconds` before they answer."""
    echo = fake_hub.script

    async def script(request: RunRequest) -> AsyncIterator[RunEvent]:
        if request.provider_id in providers:
            await asyncio.sleep(seconds)
        async for event in echo(request):
            yield event

    fake_hub.script = script


def tried(fake_hub: Any) -> list[str]:
    return [request.provider_id for request in fake_hub.requests]


def metric(edge: EdgeServer, name: str, **labels: str) -> float:
    """The value of one sample of the Edge's metrics (0 when absent)."""
    wanted = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    for line in edge.metrics.render().decode().splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _labels(model: str, provider: str, status: int) -> dict[str, str]:
    return {
        "principal_ref": "team-search",
        "token_ref": "search-chat",
        "model": model,
        "provider": provider,
        "status": str(status),
    }


async def test_a_failure_before_the_first_byte_is_retried_on_another_provider(
    start, fake_hub, until
) -> None:
    edge, client = await start()
    failing(fake_hub, {"a"})
    response = await client.chat.completions.create(model="m", messages=HELLO)
    assert response.choices[0].message.content == "Hello from b"
    assert tried(fake_hub) == ["a", "b"]
    assert metric(edge, "iop_edge_retries_total", model="m", reason="upstream_error") == 1
    # Counted once the answer is out, so perhaps just after the client has it.
    await until(lambda: metric(edge, "iop_edge_requests_total", **_labels("m", "b", 200)) == 1)


async def test_a_stream_that_fails_before_its_first_byte_is_retried(start, fake_hub) -> None:
    _, client = await start()
    failing(fake_hub, {"a"}, wire_statuses.UPSTREAM_UNAVAILABLE)
    stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == "Hello from b"
    assert tried(fake_hub) == ["a", "b"]


async def test_after_the_first_byte_nothing_is_retried(start, fake_hub) -> None:
    _, client = await start()

    async def dies(request: RunRequest) -> AsyncIterator[RunEvent]:
        yield RunChunk(
            b'{"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}'
        )
        yield RunFailed(wire_statuses.UPSTREAM_ERROR, "the upstream dropped it", False, None)

    fake_hub.script = dies
    stream = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk)
    assert len(received) == 1 and "the upstream dropped it" in caught.value.message
    assert tried(fake_hub) == ["a"]


async def test_a_request_the_provider_refused_is_not_retried(start, fake_hub) -> None:
    _, client = await start()
    failing(fake_hub, {"a"}, wire_statuses.BAD_REQUEST)
    with pytest.raises(openai.APIStatusError):
        await client.chat.completions.create(model="m", messages=HELLO)
    assert tried(fake_hub) == ["a"]


async def test_with_one_provider_the_retry_goes_to_it_again(start, fake_hub) -> None:
    _, client = await start()
    failing(fake_hub, {"s"}, times=1)
    response = await client.chat.completions.create(model="solo", messages=HELLO)
    assert response.choices[0].message.content == "Hello from s"
    assert tried(fake_hub) == ["s", "s"]


async def test_retries_stop_at_the_limit_per_request(start, fake_hub) -> None:
    _, client = await start(max_per_request=2)
    failing(fake_hub, {"s"})
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model="solo", messages=HELLO)
    assert caught.value.status_code == 502 and caught.value.code == "upstream_error"
    assert tried(fake_hub) == ["s", "s", "s"]


async def test_zero_retries_per_request_turns_retries_off(start, fake_hub) -> None:
    edge, client = await start(max_per_request=0)
    failing(fake_hub, {"a"})
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="m", messages=HELLO)
    assert tried(fake_hub) == ["a"]
    assert metric(edge, "iop_edge_retries_refused_total", model="m", reason="upstream_error") == 0


async def test_the_budget_refuses_a_retry_and_the_failure_is_the_answer(start, fake_hub) -> None:
    edge, client = await start(budget_percent=0, budget_min_per_second=0)
    failing(fake_hub, {"a"})
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model="m", messages=HELLO)
    assert "a failed" in caught.value.message
    assert tried(fake_hub) == ["a"]
    assert metric(edge, "iop_edge_retries_refused_total", model="m", reason="upstream_error") == 1
    assert metric(edge, "iop_edge_retries_total", model="m", reason="upstream_error") == 0


async def test_provider_busy_is_retried_outside_the_budget(start, fake_hub) -> None:
    edge, client = await start(budget_percent=0, budget_min_per_second=0)
    failing(fake_hub, {"a"}, wire_statuses.PROVIDER_BUSY, times=1)
    response = await client.chat.completions.create(model="m", messages=HELLO)
    assert response.choices[0].message.content == "Hello from b"
    assert metric(edge, "iop_edge_retries_total", model="m", reason="provider_busy") == 1


async def test_when_every_provider_failed_the_fallback_model_answers_with_its_policy(
    start, fake_hub, until
) -> None:
    edge, client = await start()
    failing(fake_hub, {"a", "b"})
    response = await client.chat.completions.create(model="m", messages=HELLO, max_tokens=50)
    assert response.choices[0].message.content == "Hello from c"
    assert response.model == "c-served"  # the name the answering provider serves
    assert tried(fake_hub) == ["a", "b", "c"]
    first, last = (orjson.loads(fake_hub.requests[i].body) for i in (0, -1))
    assert (first["max_tokens"], first["temperature"]) == (50, 0.5)  # m's policy
    # backup's policy over what the client sent: its cap, and no temperature of m's
    assert last["model"] == "c-served" and last["max_tokens"] == 10 and "temperature" not in last
    labels = {"model": "m", "fallback": "backup", "reason": "failed"}
    assert metric(edge, "iop_edge_fallbacks_total", **labels) == 1
    await until(lambda: metric(edge, "iop_edge_requests_total", **_labels("backup", "c", 200)) == 1)


async def test_when_no_provider_of_the_model_is_in_dispatch_the_fallback_answers(
    start, fake_hub
) -> None:
    edge, client = await start()
    fake_hub.disconnect("a", "b")
    response = await client.chat.completions.create(model="m", messages=HELLO, max_tokens=50)
    assert response.choices[0].message.content == "Hello from c"
    assert tried(fake_hub) == ["c"]
    assert orjson.loads(fake_hub.requests[0].body)["max_tokens"] == 10
    labels = {"model": "m", "fallback": "backup", "reason": "unavailable"}
    assert metric(edge, "iop_edge_fallbacks_total", **labels) == 1
    assert metric(edge, "iop_edge_retries_total", model="m", reason="upstream_error") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_try_with_no_first_byte_in_time_is_cancelled_and_retried_elsewhere(
    start, fake_hub, stream
) -> None:
    edge, client = await start(first_byte_timeout_ms={"m": 200})
    silent(fake_hub, {"a"})
    if stream:
        chunks = await client.chat.completions.create(model="m", messages=HELLO, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in chunks])
    else:
        response = await client.chat.completions.create(model="m", messages=HELLO)
        text = response.choices[0].message.content or ""
    assert text == "Hello from b"
    assert tried(fake_hub) == ["a", "b"]
    # The silent try was cancelled as too slow (its Node counts it against the provider).
    assert fake_hub.ended[fake_hub.requests[0].run_id] == "first byte timeout"
    assert metric(edge, "iop_edge_retries_total", model="m", reason="upstream_timeout") == 1


async def test_with_no_retry_left_a_late_first_byte_is_a_504_that_names_the_setting(
    start, fake_hub
) -> None:
    edge, client = await start(first_byte_timeout_ms={"solo": 150}, max_per_request=0)
    silent(fake_hub, {"s"})
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model="solo", messages=HELLO)
    assert (caught.value.status_code, caught.value.code) == (504, "upstream_timeout")
    assert "models[solo].first_byte_timeout_ms" in caught.value.message
    assert "within 150 ms" in caught.value.message
    assert tried(fake_hub) == ["s"] and not fake_hub.active
    assert edge.dispatcher.in_flight_counts()["s"] == (0, 0)  # its slot is free at once


async def test_a_first_byte_just_in_time_is_the_answer(start, fake_hub) -> None:
    _, client = await start(first_byte_timeout_ms={"solo": 2_000})
    silent(fake_hub, {"s"}, seconds=0.2)
    response = await client.chat.completions.create(model="solo", messages=HELLO)
    assert response.choices[0].message.content == "Hello from s"
    assert tried(fake_hub) == ["s"]


def gated(fake_hub: Any, gates: Mapping[str, asyncio.Event]) -> None:
    """Runs on the providers of `gates` hold their slot until their gate opens."""
    echo = fake_hub.script

    async def script(request: RunRequest) -> AsyncIterator[RunEvent]:
        gate = gates.get(request.provider_id)
        if gate is not None:
            await gate.wait()
        async for event in echo(request):
            yield event

    fake_hub.script = script


async def holding(client: openai.AsyncOpenAI, model: str, count: int) -> list[asyncio.Task[Any]]:
    """`count` requests for `model`, in flight (each holds a slot until its gate opens)."""
    return [
        asyncio.create_task(client.chat.completions.create(model=model, messages=HELLO))
        for _ in range(count)
    ]


async def test_a_model_whose_providers_are_all_busy_hands_the_request_to_a_free_fallback(
    start, fake_hub, until
) -> None:
    edge, client = await start()
    gates = {"a": asyncio.Event(), "b": asyncio.Event()}
    gated(fake_hub, gates)
    holders = await holding(client, "m", 8)  # a and b: 4 slots each
    await until(lambda: edge.dispatcher.in_flight("a") + edge.dispatcher.in_flight("b") == 8)
    response = await client.chat.completions.create(model="m", messages=HELLO)
    assert response.model == "c-served"  # at once, not after m's queue timeout
    assert (
        metric(edge, "iop_edge_fallbacks_total", model="m", fallback="backup", reason="busy") == 1
    )
    for gate in gates.values():
        gate.set()
    await asyncio.gather(*holders)


@pytest.mark.parametrize(
    ("freed", "served", "spilled"),
    [
        pytest.param("c", "c-served", 1, id="fallback-first"),
        pytest.param("a", "a-served", 0, id="own-first"),
    ],
)
async def test_a_request_waits_for_its_model_and_its_fallback_and_takes_the_first_slot_freed(
    start, fake_hub, until, freed: str, served: str, spilled: int
) -> None:
    edge, client = await start()
    gates = {pid: asyncio.Event() for pid in "abc"}
    gated(fake_hub, gates)
    holders = await holding(client, "m", 8) + await holding(client, "backup", 4)
    busy = ("a", "b", "c")
    await until(lambda: sum(edge.dispatcher.in_flight(pid) for pid in busy) == 12)
    waiting = asyncio.create_task(client.chat.completions.create(model="m", messages=HELLO))
    await until(lambda: edge.dispatcher.queue_depth("m") == 1)
    assert edge.dispatcher.queue_depth("backup") == 1  # in both queues at once
    gates[freed].set()
    response = await waiting
    assert response.model == served
    assert edge.dispatcher.waiting == 0  # the other place in line was given up
    labels = {"model": "m", "fallback": "backup", "reason": "busy"}
    assert metric(edge, "iop_edge_fallbacks_total", **labels) == spilled
    for gate in gates.values():
        gate.set()
    await asyncio.gather(*holders)


async def test_a_spill_to_a_fallback_is_paid_from_the_retry_budget(start, fake_hub, until) -> None:
    edge, client = await start(budget_percent=0, budget_min_per_second=0)
    gates = {"a": asyncio.Event(), "b": asyncio.Event()}
    gated(fake_hub, gates)
    holders = await holding(client, "m", 8)
    await until(lambda: edge.dispatcher.in_flight("a") + edge.dispatcher.in_flight("b") == 8)
    waiting = asyncio.create_task(client.chat.completions.create(model="m", messages=HELLO))
    await until(lambda: edge.dispatcher.queue_depth("m") == 1)
    assert edge.dispatcher.queue_depth("backup") == 0  # no budget: it waits for its own model
    gates["a"].set()
    response = await waiting
    assert response.model == "a-served"
    assert "c" not in tried(fake_hub)
    gates["b"].set()
    await asyncio.gather(*holders)


async def test_a_candidate_request_retried_twice_counts_once_against_the_candidate_at_its_end(
    start, fake_hub, until
) -> None:
    """m on trial, all of it on the candidate: its try on a fails and goes back to the stable
    revision (`_back_to_stable`), whose try on a fails and is retried on b. The tally counts
    nothing while b answers, then one retried request of the candidate's, with its two tries."""
    edge, client = await start()
    dispatcher = edge.dispatcher
    snapshot = dispatcher.snapshot
    dispatcher.swap(snapshot, Split(snapshot, frozenset({"m"}), frozenset({"m"}), 100))
    failing(fake_hub, {"a"})
    gate = asyncio.Event()
    gated(fake_hub, {"b": gate})
    asking = asyncio.create_task(client.chat.completions.create(model="m", messages=HELLO))
    await until(lambda: tried(fake_hub) == ["a", "a", "b"] and len(fake_hub.active) == 1)
    assert metric(edge, "iop_edge_retries_total", model="m", reason="upstream_error") == 2
    in_flight = edge.metrics.outcomes.reading()
    assert in_flight.of(["m"], CANDIDATE) == Figures()  # nothing until the request ends
    assert in_flight.of(["m"]) == Figures()
    gate.set()
    assert (await asking).choices[0].message.content == "Hello from b"
    await until(lambda: edge.metrics.outcomes.reading().of(["m"], CANDIDATE).requests == 1)
    ended = edge.metrics.outcomes.reading()
    candidate = ended.of(["m"], CANDIDATE)
    assert (candidate.requests, candidate.failed, candidate.retried, candidate.retries) == (
        1,
        0,
        1,
        2,
    )
    assert candidate.failure_rate == 1.0  # one request of one, not two
    assert ended.of(["m"]) == Figures()  # the stable revision answered it, for the candidate
    revision = {"model": "m", "revision": "candidate"}
    assert metric(edge, "iop_edge_revision_requests_total", **revision) == 1
    assert metric(edge, "iop_edge_revision_retried_requests_total", **revision) == 1
    assert metric(edge, "iop_edge_revision_retries_total", **revision) == 2
    assert metric(edge, "iop_edge_revision_failed_requests_total", **revision) == 0
