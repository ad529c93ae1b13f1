"""Benchmark: `max_concurrent` places in the shared limit store when the store stalls (issue 33).

    uv run --frozen python -m bench.limitstore [--wait 20] [--only stop slow-script ...]
    PYTHONPATH=OTHER/src uv run --frozen python -m bench.limitstore   # another release

Two limiters (two Edge replicas' `Limiter`s, in this process, each with its own connection)
share a real `redis-server` with `max_concurrent: 4` for one principal and the default
`timeout_ms` (250 ms), on the real clock. Each case prints the places the store holds once the
fault is over, and how long until it holds none (or that it still held them after `--wait`):

- stop: Redis stopped (SIGSTOP) while 3 requests are admitted at once, then resumed;
- slow-script: a 0.6 s script holds Redis while 4 requests are admitted at once;
- lost-ends: 4 requests end while every packet to Redis is lost, for 3.5 s;
- fallback: Redis stopped while replica A runs 3 requests through it and B 1; then each tries
  8 more: the most each replica runs at once (the bound: the limit each, N times it in all).

And the tracebacks asyncio logged ("Future exception was never retrieved") over all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any

import uvloop

from bench.limits import redis_server
from testkit import CLIENTS, edge_document

LIMIT = 4
PRINCIPAL = CLIENTS[0]
CASES = ("stop", "slow-script", "lost-ends", "fallback")


class Replica:
    def __init__(self, url: str, prefix: str) -> None:
        from iop.edge.limits.limiter import Limiter
        from iop.edge.pool.dispatching import Dispatcher
        from iop.edge.pool.snapshots import PoolSnapshot
        from iop.edgeconfig import load_data

        document = edge_document({"node-1": []}, {})
        document["openai"]["limits"] = [
            {"principal_ref": PRINCIPAL.principal_ref, "max_concurrent": LIMIT}
        ]
        document["openai"]["limit_store"] = {"url": url, "key_prefix": prefix}
        config = load_data(document)
        self.limiter = Limiter(Dispatcher(PoolSnapshot.build(config)), config)

    async def admit(self) -> Any:
        from iop.edge.authenticating import Principal
        from iop.edge.bodies import parse_request
        from iop.edge.errors import RateLimited

        principal = Principal(PRINCIPAL.principal_ref, PRINCIPAL.token_ref)
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
        request = parse_request("chat", body)
        try:
            return await self.limiter.admit(principal, "m", request)
        except RateLimited:
            return None

    async def in_store(self) -> int | None:
        status = await self.limiter.status()
        self.limiter._store_down_until = 0.0  # the bench reads the store, not the back-off
        if status["counted"] != "shared":
            return None
        in_progress: int = status["entries"][0]["use"]["in_progress"]
        return in_progress


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def until_free(replica: Replica, wait: float) -> str:
    """The places the store holds now, and how long until it holds none."""
    began = time.monotonic()
    first: int | None = None
    while time.monotonic() - began < wait:
        held = await replica.in_store()
        if held is not None and first is None:
            first = held
        if held == 0:
            return f"held {first} of {LIMIT}; none after {time.monotonic() - began:.2f} s"
        await asyncio.sleep(0.02)
    return f"held {first} of {LIMIT}; still {held} after {wait:g} s"


class LossyLink:
    """A TCP relay to Redis that drops every byte while `lost` is set."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.lost = False
        self.writers: list[asyncio.StreamWriter] = []

    async def relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers += [writer, upstream_writer]
        await asyncio.gather(
            self.pipe(reader, upstream_writer),
            self.pipe(upstream_reader, writer),
            return_exceptions=True,
        )

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if not self.lost:
                writer.write(data)
        writer.close()


async def case(name: str, url: str, pid: int, wait: float) -> str:
    prefix = f"bench{os.urandom(4).hex()}"
    port = int(url.rsplit(":", 1)[1])
    link = LossyLink(port)
    server = await asyncio.start_server(link.relay, "127.0.0.1", 0)
    relayed = f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    a = Replica(relayed if name == "lost-ends" else url, prefix)
    b = Replica(url, prefix)
    await a.limiter.start()
    await b.limiter.start()
    try:
        for replica in (a, b):  # connected, and the scripts loaded
            (await replica.admit()).finish(None, True)
            assert replica.limiter.store is not None
            await replica.limiter.store.drain()
        if name == "stop":
            with stopped(pid):
                grants = await asyncio.gather(*(a.admit() for _ in range(3)))
            for grant in grants:
                grant.finish(None, True)
            return await until_free(a, wait)
        if name == "slow-script":
            busy = "local t = redis.call('TIME'); local s = t[1] + t[2] / 1e6; " + (
                "repeat t = redis.call('TIME') until t[1] + t[2] / 1e6 - s > 0.6; return 1"
            )
            slow = subprocess.Popen(
                ["redis-cli", "-p", str(port), "EVAL", busy, "0"], stdout=subprocess.DEVNULL
            )
            await asyncio.sleep(0.05)
            grants = await asyncio.gather(*(a.admit() for _ in range(4)))
            await asyncio.to_thread(slow.wait)
            for grant in grants:
                grant.finish(None, True)
            return await until_free(a, wait)
        if name == "lost-ends":
            grants = [await a.admit() for _ in range(4)]
            link.lost = True
            for grant in grants:
                grant.finish(None, True)
            await asyncio.sleep(3.5)
            link.lost = False
            return await until_free(a, wait)
        held_a = [await a.admit() for _ in range(3)]
        held_b = [await b.admit()]
        with stopped(pid):
            more_a = [await a.admit() for _ in range(8)]
            more_b = [await b.admit() for _ in range(8)]
        runs = [
            len(held) + sum(grant is not None for grant in more)
            for held, more in ((held_a, more_a), (held_b, more_b))
        ]
        for grant in [*held_a, *held_b, *more_a, *more_b]:
            if grant is not None:
                grant.finish(None, True)
        return f"at most at once: replica A {runs[0]}, B {runs[1]} (limit {LIMIT} fleet-wide)"
    finally:
        await a.limiter.stop()
        await b.limiter.stop()
        for writer in link.writers:
            writer.close()
        server.close()


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    with redis_server() as (url, pid):
        for name in args.only:
            print(f"{name:12} {await case(name, url, pid, args.wait)}", flush=True)
    never = sum("never retrieved" in message for message in reported)
    print(f"{'tracebacks':12} {never} 'Future exception was never retrieved'")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument(
        "--wait", type=float, default=20.0, help="seconds to wait for the places to come back"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    uvloop.run(main(parse()))
