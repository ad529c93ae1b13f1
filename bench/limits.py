"""Benchmark: what the limits of `openai.limits[]` cost a request, counted in process (each
replica on its own, which is also what a per-replica share of each limit costs) or in a shared
Redis, against the commit before them.

    uv run --frozen python -m bench.limits --baseline /tmp/base/.venv/bin/python \
        [--parts admission relay processes] [--rounds 3] [--seconds 3] [--concurrency 1 32]

A real `redis-server` (Debian's package, on PATH) is started on loopback for the runs that need
it. Variants, all holding the principal of testkit's CLIENT_TOKEN (bench/benchkit.py's config)
with limits it never reaches: `none` (no limits configured), `local` (one entry with requests
and tokens per minute, requests at once and a daily budget, counted in the Edge's process) and
`redis` (the same entry in Redis, `openai.limit_store`); `baseline` is the commit before the
limits, by its own interpreter.

`admission`: `Limiter.admit()` and `Grant.finish()` alone, in this process, 40 batches of 500
(the collector off): the limiter's own cost per request, and for `redis` its round trip.
Both parts report wall time and this process's CPU time per request (on a loaded machine the
wall time of `redis` is mostly waiting for redis-server to be scheduled).

`relay`: the Edge's request path in one process without HTTP (parse, policy, admission, `Relay`
through dispatch and metering to bench/edge.py's stub hub, the end of the grant), 40 batches of
500 per variant, each in a child process, alternating `--rounds` times; minimum and median.

`processes`: bench/edge.py's `edge alone` path (an Edge process whose hub answers at once: only
the Edge's own work) for each variant side by side, measured in turn within each round with
bench/edge.py's load generator: requests/s (median of rounds), p50, p99, the Edge's CPU per
request and, for `redis`, Redis's.

Figures go to docs/benchmarks.md ("## Limits per principal").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import uvloop
import yaml

from bench import benchkit
from bench.edge import InstantHub
from iop.processes import free_port
from testkit import CLIENTS

#: Limits the bench never reaches: every check passes, so the figures are the counting's cost.
LIMIT = {
    "principal_ref": CLIENTS[0].principal_ref,
    "requests_per_minute": 100_000_000,
    "tokens_per_minute": 1_000_000_000,
    "max_concurrent": 100_000,
    "budget": {"tokens": 1_000_000_000_000, "period": "day"},
}


def config(variant: str, redis_url: str) -> dict[str, Any]:
    document: dict[str, Any] = benchkit.edge_config("http://127.0.0.1:1/v1")
    if variant in ("local", "redis"):
        document["openai"]["limits"] = [LIMIT]
    if variant == "redis":
        document["openai"]["limit_store"] = {
            "url": redis_url,
            "key_prefix": f"bench{os.urandom(4).hex()}",
        }
    return document


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, int]]:
    """A real redis-server on loopback: its URL and pid."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench/limits.py needs redis-server (apt-get install redis-server)")
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            ping = subprocess.run(
                ["redis-cli", "-p", str(port), "ping"], capture_output=True, check=False
            )
            if ping.stdout.strip() == b"PONG":
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}", server.pid
    finally:
        server.terminate()
        server.wait(timeout=10)


# -- in one process ------------------------------------------------------------------------------

BATCHES = 40
BATCH = 500


async def batches(one: Callable[[], Awaitable[None]], limiter: Any) -> list[list[float]]:
    """[wall us, CPU us] per request of each batch, after a warm-up; the request ends a
    batch left queued for the shared store are counted before the next batch starts."""
    for _ in range(2_000):
        await one()
    gc.disable()  # a collection's pause is the collector's cost, not the request's
    times = []
    for _ in range(BATCHES):
        began, cpu = time.perf_counter(), time.process_time()
        for _ in range(BATCH):
            await one()
        wall_us = (time.perf_counter() - began) / BATCH * 1e6
        times.append([wall_us, (time.process_time() - cpu) / BATCH * 1e6])
        if limiter is not None and limiter.store is not None:
            await limiter.store.drain()
    return times


def admission_child(variant: str, redis_url: str) -> None:
    from iop.edge.authenticating import Principal
    from iop.edge.bodies import parse_request
    from iop.edge.limits.limiter import Limiter
    from iop.edge.pool.dispatching import Dispatcher
    from iop.edge.pool.snapshots import PoolSnapshot
    from iop.edgeconfig import load_data

    async def run() -> list[list[float]]:
        edge_config = load_data(config(variant, redis_url))
        limiter = Limiter(Dispatcher(PoolSnapshot.build(edge_config)), edge_config)
        await limiter.start()
        principal = Principal(CLIENTS[0].principal_ref, CLIENTS[0].token_ref)
        request = parse_request("chat", benchkit.body("openai", False))

        async def one() -> None:
            grant = await limiter.admit(principal, "openai", request)
            grant.finish(16, True)

        try:
            return await batches(one, limiter)
        finally:
            await limiter.stop()

    print(json.dumps(uvloop.run(run())))


def relay_child(variant: str, redis_url: str) -> None:
    """The request path in one process; `baseline` runs in the commit before the limits."""
    from iop.edge.authenticating import Principal
    from iop.edge.bodies import apply_policy, parse_request
    from iop.edge.pool.dispatching import Dispatcher
    from iop.edge.pool.metering import Metrics
    from iop.edge.pool.relaying import Relay
    from iop.edge.pool.snapshots import PoolSnapshot
    from iop.edgeconfig import load_data

    async def run() -> list[list[float]]:
        edge_config = load_data(config(variant, redis_url))
        dispatcher = Dispatcher(PoolSnapshot.build(edge_config))
        dispatcher.set_available(["p-http", "p-fake"])
        metrics = Metrics(dispatcher)
        relay = Relay(dispatcher, InstantHub(), metrics)
        limiter: Any = None
        if variant != "baseline":
            from iop.edge.limits.limiter import Limiter

            limiter = Limiter(dispatcher, edge_config, registry=metrics.registry)
            await limiter.start()
        principal = Principal(CLIENTS[0].principal_ref, CLIENTS[0].token_ref)
        raw = benchkit.body("openai", False)
        policy = dispatcher.snapshot.models["openai"].generation

        async def one() -> None:
            request = parse_request("chat", raw)
            apply_policy(request, policy)
            grant = await limiter.admit(principal, "openai", request) if limiter else None
            async with relay.open(request, False, principal) as events:
                async for _ in events:
                    pass
            if grant is not None:
                grant.finish(events.spent, True)

        try:
            return await batches(one, limiter)
        finally:
            if limiter is not None:
                await limiter.stop()

    print(json.dumps(uvloop.run(run())))


async def in_process(part: str, args: argparse.Namespace, redis_url: str) -> None:
    variants = {"none": sys.executable, "local": sys.executable, "redis": sys.executable}
    if part == "relay":
        variants = {"baseline": args.baseline, **variants}
    commands = {
        name: benchkit.module_command(python, "limits", f"--{part}-child", name, redis_url)
        for name, python in variants.items()
    }
    times = await benchkit.child_rounds(part, args.rounds, commands)
    print(
        f"\n{part}:\n\n| variant | wall us per request, min | median | CPU us per request, "
        "median |\n|---|---:|---:|---:|"
    )
    for name, values in times.items():
        wall = [value[0] for value in values]
        cpu = statistics.median(value[1] for value in values)
        print(f"| {name} | {min(wall):.2f} | {statistics.median(wall):.2f} | {cpu:.2f} |")


# -- through processes ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def stub_edge(
    python: str, folder: Path, variant: str, redis_url: str
) -> AsyncIterator[tuple[str, int, int]]:
    """bench.edge's `--stub-edge` Edge, run by `python`, on the variant's config."""
    path = folder / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(config("none" if variant == "baseline" else variant, redis_url)))
    async with benchkit.stub_edge(python, path) as started:
        yield started


async def processes(args: argparse.Namespace, redis_url: str, redis_pid: int) -> None:
    variants = {"baseline": args.baseline, "none": sys.executable}
    variants |= {"local": sys.executable, "redis": sys.executable}
    rows: dict[tuple[str, int, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    with tempfile.TemporaryDirectory() as tmp:
        async with contextlib.AsyncExitStack() as exits:
            stacks = {
                name: await exits.enter_async_context(stub_edge(python, Path(tmp), name, redis_url))
                for name, python in variants.items()
            }
            for round_ in range(args.rounds):
                for stream in (False, True):
                    mode = "stream" if stream else "whole"
                    for conc in args.concurrency:
                        for name, (host, port, pid) in stacks.items():
                            payload = benchkit.chat_request(f"{host}:{port}", "openai", stream)
                            await benchkit.measure(host, port, payload, conc, 0.5)
                            pids = {"edge": pid, "redis": redis_pid}
                            cell, cpu = await benchkit.measure_cpu(
                                host, port, payload, conc, args.seconds, pids
                            )
                            row = rows[(mode, conc, name)]
                            row["rps"].append(cell.rps)
                            row["latencies"].extend(cell.latencies)
                            row["edge"].append(cpu["edge"])
                            row["redis"].append(cpu["redis"])
                print(f"  processes: round {round_ + 1} done", file=sys.stderr, flush=True)
    print(
        "\nprocesses:\n\n| mode | conc | variant | req/s (median) | /baseline | p50 ms | p99 ms "
        "| Edge CPU us/req | Redis CPU us/req |\n|---|---:|---|---:|---:|---:|---:|---:|---:|"
    )
    for (mode, conc, name), row in rows.items():
        base = statistics.median(rows[(mode, conc, "baseline")]["rps"])
        rps = statistics.median(row["rps"])
        store = f"{statistics.median(row['redis']):.0f}" if name == "redis" else "-"
        p50, p99 = benchkit.pct(row["latencies"], 50), benchkit.pct(row["latencies"], 99)
        print(
            f"| {mode} | {conc} | {name} | {rps:,.0f} | {rps / base:.2f} | {p50:.2f} | {p99:.2f} | "
            f"{statistics.median(row['edge']):.0f} | {store} |"
        )


async def main(args: argparse.Namespace) -> None:
    with redis_server() as (redis_url, redis_pid):
        for part in ("admission", "relay"):
            if part in args.parts:
                await in_process(part, args, redis_url)
        if "processes" in args.parts:
            await processes(args, redis_url, redis_pid)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("admission", "relay", "processes"),
        default=["admission", "relay", "processes"],
    )
    parser.add_argument("--baseline", help="the interpreter of the commit before the limits")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--admission-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--relay-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    children = args.admission_child or args.relay_child
    if {"relay", "processes"} & set(args.parts) and not args.baseline and not children:
        parser.error("the relay and processes parts need --baseline PYTHON")
    return args


if __name__ == "__main__":
    arguments = parse()
    if arguments.admission_child:
        admission_child(*arguments.admission_child)
    elif arguments.relay_child:
        relay_child(*arguments.relay_child)
    else:
        uvloop.run(main(arguments))
