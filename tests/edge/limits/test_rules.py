"""The limits of `openai.limits[]`, counted in process and in a real Redis, on a clock the test
moves: each limit refuses at its count and frees when it should, a budget resets at its time,
a live change keeps what was used, and both stores give the same verdicts."""

from __future__ import annotations

import calendar
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
import uvloop
from prometheus_client import CollectorRegistry

from iop.edge.authenticating import Principal
from iop.edge.bodies import ParsedRequest, parse_request
from iop.edge.errors import RateLimited
from iop.edge.limits.limiter import Grant, Limiter, duration
from iop.edge.limits.redisclient import RedisClient, ReplyError
from iop.edge.limits.rules import budget_period
from iop.edge.pool.dispatching import Dispatcher
from iop.edge.pool.snapshots import PoolSnapshot
from iop.edgeconfig import EdgeConfig, TokenBudget
from iop.edgeconfig.loading import load_data
from iop.processes import free_port
from tests.conftest import redis_server

CHAT = Principal("team-search", "search-chat")
BATCH = Principal("team-search", "search-batch")


class Clock:
    """Unix time the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def utc(year: int, month: int, day: int, hour: int, minute: int) -> float:
    return float(calendar.timegm((year, month, day, hour, minute, 0)))


#: The year the tests' clocks run in: next year, so that the expiry a real Redis gives a period's
#: keys (its end plus a day, in Unix time) is never already past when the tests run.
YEAR = time.gmtime().tm_year + 1


def request(words: int = 4) -> ParsedRequest:
    """A chat request whose prompt estimate is `words` * 4 bytes / 4 = `words` tokens."""
    text = " ".join(["abc"] * words)  # 4 bytes a word with its space (the last one 3)
    body = {"model": "m", "messages": [{"role": "user", "content": text + " "}]}
    return parse_request("chat", orjson.dumps(body))


class Edge:
    """A limiter over a config, with a dispatcher to swap configs into (a live refresh)."""

    def __init__(
        self, config: EdgeConfig, clock: Clock, registry: CollectorRegistry | None = None
    ) -> None:
        self.dispatcher = Dispatcher(PoolSnapshot.build(config))
        self.limiter = Limiter(self.dispatcher, config, clock=clock, registry=registry)
        self.generation = 1

    async def admit(self, principal: Principal = CHAT, words: int = 4, model: str = "m") -> Grant:
        return await self.limiter.admit(principal, model, request(words))

    async def refused(self, principal: Principal = CHAT, words: int = 4) -> RateLimited:
        with pytest.raises(RateLimited) as caught:
            await self.admit(principal, words)
        return caught.value

    def swap(self, config: EdgeConfig) -> None:
        self.generation += 1
        self.dispatcher.swap(PoolSnapshot.build(config, self.generation))


@pytest.fixture(params=["local", "redis"])
def store(request: pytest.FixtureRequest) -> dict[str, Any]:
    """`openai.limit_store` of each store: this process, or the session's real Redis (under a
    key prefix of the test's own)."""
    if request.param == "local":
        return {}
    url = request.getfixturevalue("redis_url")
    return {"url": url, "key_prefix": f"t{os.urandom(6).hex()}"}


@pytest.fixture
async def edge_of(
    store: dict[str, Any], document_of: Callable[..., dict[str, Any]]
) -> AsyncIterator[Callable[..., Any]]:
    """`await edge_of(limits, clock)`: an `Edge` holding `limits`, started (and stopped)."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(limits: list[dict[str, Any]], clock: Clock) -> Edge:
            edge = Edge(config(document_of, limits, store), clock)
            await edge.limiter.start()
            stack.push_async_callback(edge.limiter.stop)
            return edge

        yield make


def config(
    document_of: Callable[..., dict[str, Any]],
    limits: list[dict[str, Any]],
    store: dict[str, Any] | None = None,
) -> EdgeConfig:
    provider = {"id": "p1", "adapter": {"type": "fake"}, "served_models": ["s"], "capacity": 4}
    openai: dict[str, Any] = {"limits": limits}
    if store:
        openai["limit_store"] = store
    return load_data(document_of([provider], openai=openai))


def header(error_or_grant: RateLimited | Grant, name: str) -> str | None:
    for key, value in error_or_grant.headers:
        if key == name.encode():
            return value.decode()
    return None


async def test_requests_per_minute_refuses_at_its_count_and_refills(edge_of: Any) -> None:
    clock = Clock(1_800_000_000.0)
    edge = await edge_of([{"principal_ref": "team-search", "requests_per_minute": 3}], clock)
    remaining = []
    for _ in range(3):
        grant = await edge.admit()
        remaining.append(header(grant, "x-ratelimit-remaining-requests"))
        grant.finish(None, answered=True)
    assert remaining == ["2", "1", "0"]
    assert header(grant, "x-ratelimit-limit-requests") == "3"
    assert header(grant, "x-ratelimit-reset-requests") == "1m0s"  # 3 taken, one back per 20 s
    error = await edge.refused(BATCH)  # the principal's every token counts together
    assert error.kind == "requests"
    assert "requests per minute (openai.limits[team-search|*|*].requests_per_minute)" in (
        error.message
    )
    assert "Limit 3, Used 3, Requested 1. Please try again in 20s." in error.message
    assert (header(error, "retry-after"), header(error, "retry-after-ms")) == ("20", "20000")
    clock.now += 19.9
    await edge.refused()
    clock.now += 0.1  # one request's worth is back
    (await edge.admit()).finish(None, True)
    await edge.refused()


async def test_tokens_per_minute_takes_the_estimate_then_the_reported_usage(edge_of: Any) -> None:
    clock = Clock(1_800_000_000.0)
    edge = await edge_of(
        [{"principal_ref": "team-search", "token_ref": "search-chat", "tokens_per_minute": 60}],
        clock,
    )
    grant = await edge.admit(words=10)  # takes its 10-token estimate
    assert header(grant, "x-ratelimit-remaining-tokens") == "50"
    assert header(grant, "x-ratelimit-limit-tokens") == "60"
    grant.finish(40, answered=True)  # the upstream reported 40: 30 more
    await settled(edge)
    error = await edge.refused(words=21)  # 20 left
    assert error.kind == "tokens"
    assert "Limit 60, Used 40, Requested 21. Please try again in 1s." in error.message
    other = await edge.admit(BATCH, words=30)  # another token: not held by this entry
    assert header(other, "x-ratelimit-limit-tokens") is None
    other.finish(None, True)
    grant = await edge.admit(words=20)
    grant.finish(None, answered=False)  # no usage and no answer: its estimate comes back
    await settled(edge)
    (await edge.admit(words=20)).finish(None, True)


async def test_a_request_too_large_for_a_limit_is_told_it_never_passes(edge_of: Any) -> None:
    edge = await edge_of(
        [{"principal_ref": "team-search", "tokens_per_minute": 50}], Clock(1_800_000_000.0)
    )
    error = await edge.refused(words=51)
    assert header(error, "x-should-retry") == "false"
    assert header(error, "retry-after") is None
    assert error.message.startswith("Request too large for principal team-search on tokens per")


async def test_max_concurrent_counts_requests_until_they_end(edge_of: Any) -> None:
    edge = await edge_of(
        [{"principal_ref": "team-search", "max_concurrent": 2}], Clock(1_800_000_000.0)
    )
    first, second = await edge.admit(), await edge.admit(BATCH)
    error = await edge.refused()
    assert "Too many requests at once for principal team-search" in error.message
    assert "Limit 2, In progress 2." in error.message
    assert header(error, "retry-after") == "1"
    first.finish(None, True)
    first.finish(None, True)  # a second finish gives nothing back twice
    await settled(edge)
    third = await edge.admit()
    await edge.refused()
    second.finish(None, True)
    third.finish(None, True)


async def test_a_budget_resets_at_its_time(edge_of: Any) -> None:
    clock = Clock(utc(YEAR, 12, 1, 23, 0))
    budget = {"tokens": 100, "period": "day", "reset_at": "06:30"}
    edge = await edge_of([{"principal_ref": "team-search", "budget": budget}], clock)
    grant = await edge.admit(words=10)
    grant.finish(95, True)
    await settled(edge)
    error = await edge.refused(words=10)
    assert error.kind == "tokens"
    assert "daily token budget" in error.message and "Used 95, Requested 10" in error.message
    assert f"It resets at {YEAR}-12-02T06:30:00Z." in error.message
    assert header(error, "retry-after") == str(7 * 3600 + 30 * 60)  # the client will not wait
    (await edge.admit(words=5)).finish(5, True)  # exactly what is left
    await settled(edge)
    await edge.refused(words=1)
    clock.now = utc(YEAR, 12, 2, 6, 29) + 59.9
    await edge.refused(words=1)
    clock.now = utc(YEAR, 12, 2, 6, 30)  # a new period: the whole budget again
    (await edge.admit(words=100)).finish(100, True)
    await settled(edge)
    await edge.refused(words=1)


async def test_a_monthly_budget_and_a_rule_for_every_principal(edge_of: Any) -> None:
    clock = Clock(utc(YEAR, 12, 31, 12, 0))
    budget = {"tokens": 10, "period": "month"}
    edge = await edge_of([{"principal_ref": "*", "budget": budget}], clock)
    (await edge.admit(words=10)).finish(None, True)
    await edge.refused(words=1)
    (await edge.admit(Principal("anonymous", "anonymous"), words=10)).finish(None, True)
    clock.now = utc(YEAR + 1, 1, 1, 0, 0)
    (await edge.admit(words=10)).finish(None, True)


async def test_an_entry_for_a_model_holds_only_that_model(edge_of: Any) -> None:
    edge = await edge_of(
        [{"principal_ref": "team-search", "model": "m", "requests_per_minute": 1}],
        Clock(1_800_000_000.0),
    )
    (await edge.admit()).finish(None, True)
    await edge.refused()
    other = await edge.limiter.admit(CHAT, "other", request())
    assert other.headers == []


async def test_a_live_change_keeps_what_was_used(
    edge_of: Any, store: dict[str, Any], document_of: Callable[..., dict[str, Any]]
) -> None:
    clock = Clock(1_800_000_000.0)
    rule = {"principal_ref": "team-search", "requests_per_minute": 2, "max_concurrent": 5}
    edge = await edge_of([rule], clock)
    held = [await edge.admit(), await edge.admit()]
    await edge.refused()
    edge.swap(config(document_of, [{**rule, "requests_per_minute": 5}], store))
    held.append(await edge.admit())  # 3 more at once: 2 of 5 were used
    assert header(held[-1], "x-ratelimit-remaining-requests") == "2"
    edge.swap(config(document_of, [{**rule, "max_concurrent": 3}], store))
    await edge.refused()  # 3 in progress, and the minute's requests down to 2 again
    for grant in held:
        grant.finish(None, True)


async def test_both_stores_say_the_same(
    document_of: Callable[..., dict[str, Any]], redis_url: str
) -> None:
    """The Lua script and the Python rules, side by side on one sequence of requests."""
    clock = Clock(1_800_000_000.0)
    limits = [
        {"principal_ref": "team-search", "requests_per_minute": 5, "tokens_per_minute": 100},
        {"principal_ref": "*", "max_concurrent": 3, "budget": {"tokens": 300, "period": "day"}},
    ]
    local = Edge(config(document_of, limits), clock)
    shared_store = {"url": redis_url, "key_prefix": f"t{os.urandom(6).hex()}"}
    shared = Edge(config(document_of, limits, shared_store), clock)
    await shared.limiter.start()
    try:
        held: list[tuple[Grant, Grant]] = []
        for step in range(40):
            words = (step * 7) % 45
            outcomes: list[tuple[str, list[tuple[bytes, bytes]], Grant | None]] = []
            for edge in (local, shared):
                try:
                    grant = await edge.admit(words=words)
                except RateLimited as error:
                    outcomes.append((error.message, sorted(error.headers), None))
                else:
                    outcomes.append(("admitted", sorted(grant.headers), grant))
            assert outcomes[0][:2] == outcomes[1][:2], f"step {step}"
            first, second = outcomes[0][2], outcomes[1][2]
            if first is not None and second is not None:
                held.append((first, second))
            if len(held) >= 2 or step % 5 == 4:
                for grants in held:
                    for grant in grants:
                        grant.finish(words * 2, True)
                held = []
                await settled(shared)
            clock.now += 1.7
    finally:
        await shared.limiter.stop()


async def test_status_shows_each_principals_use(edge_of: Any) -> None:
    clock = Clock(utc(YEAR, 12, 1, 12, 0))
    edge = await edge_of(
        [
            {"principal_ref": "team-search", "requests_per_minute": 10, "max_concurrent": 4},
            {"principal_ref": "*", "budget": {"tokens": 1000, "period": "month"}},
        ],
        clock,
    )
    grant = await edge.admit(words=8)
    status = await edge.limiter.status()
    entries = {(e["selector"], e["principal_ref"]): e for e in status["entries"]}
    mine = entries[("team-search|*|*", "team-search")]
    assert mine["limits"] == {"requests_per_minute": 10, "max_concurrent": 4}
    assert mine["use"] == {"requests_available": 9, "in_progress": 1}
    budget = entries[("*|*|*", "team-search")]
    assert budget["use"] == {"budget_used": 8, "budget_resets_at": f"{YEAR + 1}-01-01T00:00:00Z"}
    assert entries[("*|*|*", "anonymous")]["use"]["budget_used"] == 0
    assert status["counted"] == ("shared" if edge.limiter.store else "local")
    grant.finish(None, True)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.0201, "21ms"), (1, "1s"), (1.5, "1.5s"), (360, "6m0s"), (3723, "1h2m3s")],
)
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text


@pytest.mark.parametrize(
    ("period", "reset_at", "now", "start", "end"),
    [
        ("day", "00:00", (2026, 12, 1, 12, 0), (2026, 12, 1, 0, 0), (2026, 12, 2, 0, 0)),
        ("day", "06:30", (2026, 12, 1, 6, 0), (2026, 11, 30, 6, 30), (2026, 12, 1, 6, 30)),
        ("month", "00:00", (2026, 12, 31, 23, 0), (2026, 12, 1, 0, 0), (2027, 1, 1, 0, 0)),
        ("month", "08:00", (2027, 1, 1, 7, 0), (2026, 12, 1, 8, 0), (2027, 1, 1, 8, 0)),
        ("month", "00:00", (2028, 2, 29, 1, 0), (2028, 2, 1, 0, 0), (2028, 3, 1, 0, 0)),
    ],
)
def test_budget_periods(
    period: str, reset_at: str, now: tuple[int, ...], start: tuple[int, ...], end: tuple[int, ...]
) -> None:
    budget = TokenBudget.model_validate({"tokens": 1, "period": period, "reset_at": reset_at})
    assert budget_period(budget, utc(*now)) == (int(utc(*start)), int(utc(*end)))


async def settled(edge: Edge) -> None:
    """Until the shared store has counted every request that ended (its settlements queue)."""
    store = edge.limiter.store
    if store is not None:
        await store.drain()


async def test_an_unreachable_store_falls_back_to_this_process(
    document_of: Callable[..., dict[str, Any]],
) -> None:
    """Redis down: the limits still hold, in this process, and the metrics and status say so."""
    store = {"url": f"redis://127.0.0.1:{free_port()}", "timeout_ms": 200}
    registry = CollectorRegistry()
    limits = [{"principal_ref": "team-search", "requests_per_minute": 2}]
    edge = Edge(config(document_of, limits, store), Clock(1_800_000_000.0), registry=registry)
    await edge.limiter.start()
    try:
        for _ in range(2):
            (await edge.admit()).finish(None, True)
        await edge.refused()
        assert registry.get_sample_value("iop_edge_limit_store_fallbacks_total") == 3
        assert (
            registry.get_sample_value(
                "iop_edge_limited_requests_total",
                {
                    "principal_ref": "team-search",
                    "limit": "requests_per_minute",
                    "selector": "team-search|*|*",
                },
            )
            == 1
        )
        status = await edge.limiter.status()
        assert status["counted"] == "local"
        assert status["entries"][0]["use"] == {"requests_available": 0}
    finally:
        await edge.limiter.stop()


async def test_a_store_that_stops_answering_is_shown_disconnected_at_once(
    document_of: Callable[..., dict[str, Any]],
) -> None:
    """Issue 38: with the store stopped, `GET /status` said `counted: local` and also
    `store_connected: true` (the heartbeat had not noticed yet). A failed call says it now, and a
    call that succeeds again says connected."""
    with redis_server() as (url, server):
        store = {"url": url, "timeout_ms": 200}
        limits = [{"principal_ref": "team-search", "requests_per_minute": 100}]
        edge = Edge(config(document_of, limits, store), Clock(1_800_000_000.0))
        await edge.limiter.start()
        try:
            (await edge.admit()).finish(None, True)
            status = await edge.limiter.status()
            assert (status["counted"], status["store_connected"]) == ("shared", True)
            server.send_signal(signal.SIGSTOP)
            (await edge.admit()).finish(None, True)  # counted here, after 200 ms
            status = await edge.limiter.status()
            assert (status["counted"], status["store_connected"]) == ("local", False)
            server.send_signal(signal.SIGCONT)
            edge.limiter._store_down_until = 0.0  # the back-off's second, over at once
            (await edge.admit()).finish(None, True)
            status = await edge.limiter.status()
            assert (status["counted"], status["store_connected"]) == ("shared", True)
        finally:
            server.send_signal(signal.SIGCONT)
            await edge.limiter.stop()


async def test_the_budget_gauge_shows_what_is_left(
    document_of: Callable[..., dict[str, Any]],
) -> None:
    registry = CollectorRegistry()
    limits = [{"principal_ref": "*", "budget": {"tokens": 100, "period": "day"}}]
    edge = Edge(config(document_of, limits), Clock(1_800_000_000.0), registry=registry)
    (await edge.admit(words=10)).finish(30, True)
    labels = {"principal_ref": "team-search", "selector": "*|*|*"}
    assert registry.get_sample_value("iop_edge_limit_budget_remaining_tokens", labels) == 70


async def test_the_store_loads_its_scripts_again_after_redis_forgot_them(
    document_of: Callable[..., dict[str, Any]], redis_url: str
) -> None:
    """A Redis that restarted (or was flushed) has no scripts: admissions and request ends
    load them again and go on counting."""
    store = {"url": redis_url, "key_prefix": f"t{os.urandom(6).hex()}"}
    limits = [{"principal_ref": "team-search", "tokens_per_minute": 100, "max_concurrent": 1}]
    edge = Edge(config(document_of, limits, store), Clock(1_800_000_000.0))
    await edge.limiter.start()
    admin = RedisClient(redis_url)
    try:
        grant = await edge.admit(words=10)
        assert await admin.call("SCRIPT", "FLUSH") == b"OK"
        await edge.refused()  # max_concurrent: counted in Redis, through a reloaded script
        await admin.call("SCRIPT", "FLUSH")
        grant.finish(60, True)
        await settled(edge)
        grant = await edge.admit(words=10)
        assert header(grant, "x-ratelimit-remaining-tokens") == "30"  # 100 - 60 - 10
        grant.finish(None, True)
    finally:
        await admin.close()
        await edge.limiter.stop()


def test_the_store_client_runs_on_uvloop(redis_url: str) -> None:
    """The Edge runs on uvloop, whose transports are no asyncio.Transport subclass."""

    async def main() -> list[Any]:
        client = RedisClient(redis_url)
        try:
            return await client.pipeline([("PING",), ("ECHO", "limits"), ("NOSUCHCOMMAND",)])
        finally:
            await client.close()

    pong, echo, error = uvloop.run(main())
    assert (pong, echo) == (b"PONG", b"limits")
    assert isinstance(error, ReplyError) and "unknown command" in str(error)
