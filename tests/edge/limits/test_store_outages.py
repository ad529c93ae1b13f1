"""Issue 33: `max_concurrent` places in the shared store come back whatever happens on the way.

A real `redis-server` of each test's own, stopped (SIGSTOP) or held by a slow script while
admissions and request ends are on their way; limiters in this process count in it, as Edge
replicas do. Every place must come back (the store's count returns to 0, and the principal is
admitted again), and a replica that falls back to its own counters must count what it already
runs through the store, so that N replicas never hold more than N times a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from iop.edge.errors import RateLimited
from iop.edge.limits.limiter import Grant
from iop.edge.limits.redisclient import RedisClient, RedisError
from iop.edge.limits.rediscounters import LEASE_S
from tests.conftest import redis_server
from tests.edge.limits.test_rules import Clock, Edge, config
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)

LIMIT = 4
#: The store's timeout (the default): each stalled call costs this.
TIMEOUT_MS = 250
#: How long the places taken during a stall may take to come back once the store answers:
#: the request ends and cancels are tried every SETTLE_RETRY_S (0.25 s), each try failing
#: TIMEOUT_MS after it was sent while the store does not answer.
BACK_WITHIN_S = 3.0


@pytest.fixture
def server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    with redis_server() as started:
        yield started


@pytest.fixture
async def replicas(
    server: tuple[str, subprocess.Popen[bytes]], document_of: Callable[..., dict[str, Any]]
) -> AsyncIterator[Callable[..., Any]]:
    """`await replicas(clock[, url])`: an Edge replica's limiter on the test's Redis (or
    through `url` to it; started, and stopped at the end), holding max_concurrent LIMIT for
    team-search. Each admits and ends a request through the store first, so that it is
    connected and Redis has its scripts, as in a replica that has been running a while."""
    prefix = f"t{os.urandom(4).hex()}"
    limits = [{"principal_ref": "team-search", "max_concurrent": LIMIT}]
    async with contextlib.AsyncExitStack() as stack:

        async def make(clock: Clock, url: str = server[0]) -> Edge:
            store = {"url": url, "timeout_ms": TIMEOUT_MS, "key_prefix": prefix}
            edge = Edge(config(document_of, limits, store), clock)
            await edge.limiter.start()
            stack.push_async_callback(edge.limiter.stop)
            (await edge.admit()).finish(None, True)
            assert edge.limiter.store is not None
            await edge.limiter.store.drain()
            return edge

        yield make


async def in_store(edge: Edge) -> int | None:
    """The requests in progress the shared store counts for team-search; None when the call
    failed (right after a stall, a call that timed out may close the connection under it)."""
    status = await edge.limiter.status()
    if status["counted"] != "shared":
        back_to_store(edge)
        return None
    (entry,) = status["entries"]
    in_progress: int = entry["use"]["in_progress"]
    return in_progress


async def admit_all(edge: Edge, count: int) -> tuple[list[Grant], int]:
    """Up to `count` admissions, one after the other: the grants, and how many were refused."""
    grants: list[Grant] = []
    refused = 0
    for _ in range(count):
        try:
            grants.append(await edge.admit())
        except RateLimited:
            refused += 1
    return grants, refused


def back_to_store(*edges: Edge) -> None:
    """The limiters' back-off after a failure (a second), over at once."""
    for edge in edges:
        edge.limiter._store_down_until = 0.0


async def every_place_comes_back(edge: Edge) -> None:
    """The store's count back to 0 within BACK_WITHIN_S, then LIMIT requests admitted by it."""

    async def empty() -> bool:
        return await in_store(edge) == 0

    await wait_until(empty, BACK_WITHIN_S, 0.02, what="the store's places to come back")
    back_to_store(edge)
    grants, refused = await admit_all(edge, LIMIT + 1)
    assert (len(grants), refused) == (LIMIT, 1)
    assert await in_store(edge) == LIMIT
    for grant in grants:
        grant.finish(None, True)


async def test_admissions_that_timed_out_while_the_store_was_stopped_take_no_place(
    replicas: Any, server: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """Seen: Redis stopped for a moment during 3 requests left 3 of 4 places taken for good (it
    ran the admissions when it woke); every request of the principal was refused from then on."""
    edge = await replicas(Clock(1_800_000_000.0))
    _, process = server
    process.send_signal(signal.SIGSTOP)
    try:
        # At once, as concurrent requests are: all three calls wait on the stopped store.
        grants = await asyncio.gather(*(edge.admit() for _ in range(3)))
    finally:
        process.send_signal(signal.SIGCONT)
    for grant in grants:  # counted in this process, and ended there
        grant.finish(None, True)
    await every_place_comes_back(edge)


async def test_a_slow_script_past_the_timeout_leaves_no_place_taken(
    replicas: Any, server: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """Seen: a 0.6 s slow script left 4 of 4 places taken. Here 1 s, so that the admissions
    certainly wait past the timeout after the script is seen to hold the server."""
    url, _ = server
    edge = await replicas(Clock(1_800_000_000.0))
    kept = await edge.admit()  # one place taken through the store
    slow, probe = RedisClient(url, timeout=5), RedisClient(url, timeout=0.2)
    busy = "local t = redis.call('TIME'); local s = t[1] + t[2] / 1e6; " + (
        "repeat t = redis.call('TIME') until t[1] + t[2] / 1e6 - s > 1; return 1"
    )

    async def busy_now() -> bool:
        try:
            await probe.call("PING")
        except RedisError:
            return True
        return False

    try:
        blocking = asyncio.create_task(slow.call("EVAL", busy, 0))
        await wait_until(busy_now, 2, 0, what="the slow script to hold the server")
        held = await asyncio.gather(*(edge.admit() for _ in range(3)))
        assert await blocking == 1
    finally:
        await slow.close()
        await probe.close()
    for grant in held:
        grant.finish(None, True)

    async def one_left() -> bool:
        return await in_store(edge) == 1

    await wait_until(one_left, BACK_WITHIN_S, 0.02, what="the late admissions' places to go")
    kept.finish(None, True)


class LossyLink:
    """A TCP relay to Redis that loses every byte either way while `lost` is set, as a network
    that drops packets does (a stopped Redis still receives: its kernel buffers what comes)."""

    def __init__(self, url: str) -> None:
        self._target = url.removeprefix("redis://").rsplit(":", 1)
        self.lost = False
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self._target
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        self._writers += [writer, upstream_writer]
        await asyncio.gather(
            self._pipe(reader, upstream_writer),
            self._pipe(upstream_reader, writer),
            return_exceptions=True,
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if not self.lost:
                writer.write(data)
        writer.close()


async def test_request_ends_that_failed_to_reach_the_store_land_later(
    replicas: Any, server: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """Seen: request ends that failed to reach Redis were dropped ("N request ends could not be
    counted"): 3.5 s of lost packets left 4 of 4 places taken for good."""
    link = LossyLink(server[0])
    async with link as url:
        edge = await replicas(Clock(1_800_000_000.0), url)
        grants, _ = await admit_all(edge, LIMIT)
        assert await in_store(edge) == LIMIT
        store = edge.limiter.store
        assert store is not None
        link.lost = True
        for grant in grants:
            grant.finish(None, True)
        await store.drain()  # one try, lost
        link.lost = False
        await every_place_comes_back(edge)


async def test_a_replica_that_falls_back_counts_what_it_runs_through_the_store(
    replicas: Any, server: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """Seen: one replica ran 8 at once against a limit of 4 while the store was down (its own
    counters knew nothing of the 3 it had admitted through the store). The bound: each replica
    runs at most the limit, so N replicas at most N times it, while the store fails and until
    what they admitted on their own ends."""
    clock = Clock(1_800_000_000.0)
    a, b = await replicas(clock), await replicas(clock)
    _, process = server
    shared_a, _ = await admit_all(a, 3)
    shared_b, _ = await admit_all(b, 1)
    process.send_signal(signal.SIGSTOP)
    try:
        local_a, refused_a = await admit_all(a, 6)
        local_b, refused_b = await admit_all(b, 6)
    finally:
        process.send_signal(signal.SIGCONT)
    assert (len(shared_a) + len(local_a), len(shared_b) + len(local_b)) == (LIMIT, LIMIT)
    assert (refused_a, refused_b) == (5, 3)
    # What Redis ran late of the admissions that timed out is given back (their cancels).

    async def only_the_shared() -> bool:
        return await in_store(a) == 4

    back_to_store(a, b)
    await wait_until(only_the_shared, BACK_WITHIN_S, 0.02, what="the late admissions to go")

    # The store back: A's requests through it end; what A admitted on its own still holds a
    # place in A's view of the store, so A runs LIMIT at most again.
    for grant in shared_a:
        grant.finish(None, True)
    assert a.limiter.store is not None
    await a.limiter.store.drain()

    async def only_b() -> bool:
        return await in_store(a) == 1

    await wait_until(only_b, BACK_WITHIN_S, 0.02, what="A's ends to land")
    again_a, refused = await admit_all(a, 3)
    assert (len(local_a) + len(again_a), refused) == (LIMIT - 1, 1)  # 1 + 1 + 2 = LIMIT in all
    assert await in_store(a) == 3
    await b.refused()  # 3 in the store, and B's 3 of its own
    for grant in [*local_a, *again_a, *shared_b, *local_b]:
        grant.finish(None, True)
    assert b.limiter.store is not None
    await b.limiter.store.drain()
    await every_place_comes_back(a)


async def test_a_place_held_past_its_lease_is_reclaimed_by_the_store(replicas: Any) -> None:
    """A replica that stops giving its places back (it died, or lost the store for good) holds
    them LEASE_S past its last renewal at most: the store prunes them by itself."""
    now = 1_800_000_000.0
    a_clock, b_clock = Clock(now), Clock(now)
    a, b = await replicas(a_clock), await replicas(b_clock)
    held, _ = await admit_all(a, LIMIT)
    await b.refused()
    b_clock.now = now + LEASE_S - 1
    await b.refused()
    a_clock.now = now + LEASE_S - 2  # A renews its leases (every few seconds while it runs)
    assert a.limiter.store is not None
    await a.limiter.store._renew_leases()
    b_clock.now = now + 2 * LEASE_S - 3
    await b.refused()  # renewed: still held
    b_clock.now = now + 2 * LEASE_S - 2  # the last renewal's lease is over
    grants, refused = await admit_all(b, LIMIT + 1)
    assert (len(grants), refused) == (LIMIT, 1)
    for grant in [*held, *grants]:
        grant.finish(None, True)


@pytest.mark.parametrize("fault", ["connection-lost", "timeout"])
async def test_a_pipeline_that_fails_in_flight_logs_no_traceback(fault: str) -> None:
    """Seen: three "Future exception was never retrieved" tracebacks each time the store's
    connection was lost with a pipeline in flight (the replies nobody awaited any more)."""

    ended = asyncio.Event()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        if fault == "timeout":
            await reader.read()  # never answers; the client hangs up at its timeout
        writer.close()
        await writer.wait_closed()
        ended.set()

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    client = RedisClient(f"redis://127.0.0.1:{port}", timeout=0.1)

    async def failure() -> str:
        try:
            await client.pipeline([("PING",), ("PING",), ("PING",)])
        except RedisError as error:
            return str(error)
        return "answered"

    try:
        message = await failure()
        assert message.startswith("connection lost" if fault != "timeout" else "no answer")
        for _ in range(3):  # the connection's end is called soon after its close
            gc.collect()  # the futures nobody awaited, and their exception's cycle with them
            await asyncio.sleep(0)
        assert reported == []
    finally:
        loop.set_exception_handler(None)
        await client.close()
        await ended.wait()
        server.close()
        await server.wait_closed()
