"""Benchmark: what retries before the first byte cost when nothing fails, and what they buy when
something does.

    uv run --frozen python -m bench.retries [--parts relay cost errors] [--baseline PYTHON]
        [--seconds 3] [--rounds 3] [--concurrency 1 32] [--requests 2000]

`relay` (needs `--baseline PYTHON`): the request path's own work in one process, without HTTP
or a Node: parse the body, apply the model's policy, and run it through `Relay` (dispatch,
the retry bookkeeping, metering) against bench/edge.py's stub hub, 200 batches of 1,000
requests (the collector off), in a child process per interpreter, alternating `--rounds` times;
the minimum and median time per request over the batches. The minimum is the least disturbed by
other processes on the machine: the finest measure of what the retry path adds to a request
that does not fail.

`cost` (needs `--baseline PYTHON`: another checkout's interpreter, e.g. the commit before the
feature, with its own `.venv`): bench/edge.py's `edge alone` path (an Edge process whose hub
answers at once, so only the Edge's own work is measured: the retry path's bookkeeping shows
there first) and `node fake` path (Edge -> Node with its built-in generator), each as two
stacks side by side, this checkout (`today`, retries at their defaults) and the baseline,
measured in turn within each round with bench/edge.py's load generator. Per variant, mode and
concurrency: requests/s (median of the rounds), p50 and p99, and the Edge's CPU per request.

`errors`: two `iop fake-upstream` processes behind one `iop node run`, one model over both, and
an `iop edge run` with retries at their defaults or turned off (`openai.retries.max_per_request:
0`); `--requests` requests at concurrency 16, plain and streamed, per scenario: one upstream
failing 30% of its requests (each `--fail-mode`), or both. Per row: the share of requests that
failed for the client (a status other than 200, or a stream that did not end with `[DONE]`),
the upstream tries per request, and p50/p99 latency.

Figures go to docs/benchmarks.md ("## Retries and fallbacks").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvloop

from bench import benchkit
from bench.edge import InstantHub
from iop.processes import spawn_edge, spawn_fake_upstream, spawn_node, terminate
from testkit import CLIENTS, edge_document, provider

FAIL_MODES = ("status", "drop", "drop-mid-stream")


@contextlib.asynccontextmanager
async def edge_stack(
    python: str, folder: Path, path: str
) -> AsyncIterator[tuple[str, int, dict[str, int]]]:
    """An Edge (and for `node-fake` a Node) run by `python`'s installation of `iop`."""
    config = folder / "edge.yaml"
    if path == "edge-alone":
        async with benchkit.stub_edge(python, config) as (host, port, pid):
            yield host, port, {"edge": pid}
        return
    iop = str(Path(python).with_name("iop"))
    edge = await asyncio.create_subprocess_exec(
        iop, "edge", "run", "--config", str(config), "--log-level", "WARNING",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    node: asyncio.subprocess.Process | None = None
    try:
        started = await benchkit.started_line(edge)
        host, port = benchkit.split_url(started["url"])
        pids = {"edge": edge.pid}
        if path == "node-fake":
            node = await asyncio.create_subprocess_exec(
                iop, "node", "run", "--edge", f"127.0.0.1:{started['hub_port']}",
                "--node-id", "node-1", "--token-file", str(folder / "token"),
                "--log-level", "WARNING",
            )  # fmt: skip
            pids["node"] = node.pid
        await benchkit.wait_available(host, port, b'"providers_available":["p-fake","p-http"]')
        yield host, port, pids
    finally:
        if node is not None:
            await terminate(node)
        await terminate(edge)


@dataclass
class CostRow:
    rps: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    edge_cpu_us: list[float] = field(default_factory=list)


async def cost(args: argparse.Namespace) -> None:
    variants = {"today": sys.executable, "baseline": args.baseline}
    rows: dict[tuple[str, str, str, int], CostRow] = defaultdict(CostRow)
    async with spawn_fake_upstream() as upstream:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            benchkit.write_stack(folder, benchkit.edge_config(upstream.base_url))
            for path, model in (("edge-alone", "openai"), ("node-fake", "node-fake")):
                async with contextlib.AsyncExitStack() as exits:
                    stacks = {
                        name: await exits.enter_async_context(edge_stack(python, folder, path))
                        for name, python in variants.items()
                    }
                    for round_ in range(args.rounds):
                        for stream in (False, True):
                            mode = "stream" if stream else "whole"
                            for conc in args.concurrency:
                                for name, (host, port, pids) in stacks.items():
                                    payload = benchkit.chat_request(f"{host}:{port}", model, stream)
                                    await benchkit.measure(host, port, payload, conc, 0.5)
                                    cell, cpu = await benchkit.measure_cpu(
                                        host, port, payload, conc, args.seconds, pids
                                    )
                                    row = rows[(path, mode, name, conc)]
                                    row.rps.append(cell.rps)
                                    row.latencies.extend(cell.latencies)
                                    row.edge_cpu_us.append(cpu["edge"])
                        print(f"  {path}: round {round_ + 1} done", file=sys.stderr, flush=True)
    print("\n| path | mode | conc | variant | req/s (median) | p50 ms | p99 ms | edge CPU us/req |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for (path, mode, name, conc), row in rows.items():
        print(
            f"| {path} | {mode} | {conc} | {name} | {statistics.median(row.rps):,.0f} | "
            f"{benchkit.pct(row.latencies, 50):.2f} | {benchkit.pct(row.latencies, 99):.2f} | "
            f"{statistics.median(row.edge_cpu_us):.0f} |"
        )
    print("\n| path | mode | conc | today/baseline req/s | CPU today - baseline us |")
    print("|---|---|---:|---:|---:|")
    for (path, mode, name, conc), row in rows.items():
        if name != "today":
            continue
        base = rows[(path, mode, "baseline", conc)]
        ratio = statistics.median(row.rps) / statistics.median(base.rps)
        delta = statistics.median(row.edge_cpu_us) - statistics.median(base.edge_cpu_us)
        print(f"| {path} | {mode} | {conc} | {ratio:.3f} | {delta:+.0f} |")


def relay_child() -> None:
    """In a child process: time requests through `Relay` with the stub hub; print one line."""
    from iop.edge.authenticating import Principal
    from iop.edge.bodies import apply_policy, parse_request
    from iop.edge.pool.dispatching import Dispatcher
    from iop.edge.pool.metering import Metrics
    from iop.edge.pool.relaying import Relay
    from iop.edge.pool.snapshots import PoolSnapshot
    from iop.edgeconfig import load_data

    async def run() -> list[float]:
        dispatcher = Dispatcher(
            PoolSnapshot.build(load_data(benchkit.edge_config("http://127.0.0.1:1/v1")))
        )
        dispatcher.set_available(["p-http", "p-fake"])
        relay = Relay(dispatcher, InstantHub(), Metrics(dispatcher))
        principal = Principal(CLIENTS[0].principal_ref, CLIENTS[0].token_ref)
        raw = benchkit.body("openai", False)
        policy = dispatcher.snapshot.models["openai"].generation

        async def one() -> None:
            request = parse_request("chat", raw)
            apply_policy(request, policy)
            async with relay.open(request, False, principal) as events:
                async for _ in events:
                    pass

        for _ in range(20_000):  # warm-up
            await one()
        gc.disable()  # a collection's pause is the collector's cost, not the request's
        times = []
        for _ in range(200):
            began = time.perf_counter()
            for _ in range(1000):
                await one()
            times.append((time.perf_counter() - began) / 1000 * 1e6)
        return times

    print(json.dumps(uvloop.run(run())))


async def relay(args: argparse.Namespace) -> None:
    variants = {"today": sys.executable, "baseline": args.baseline}
    commands = {
        name: benchkit.module_command(python, "retries", "--relay-child")
        for name, python in variants.items()
    }
    times = await benchkit.child_rounds("relay", args.rounds, commands)
    print("\n| variant | us per request, min | median |")
    print("|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} |")


# -- error rates with injected faults ------------------------------------------------------------


def pool_config(upstreams: dict[str, str], retries: dict[str, int]) -> dict[str, Any]:
    providers = [
        provider(name, {"type": "openai", "base_url": url}, capacity=64, max_queue=1024)
        for name, url in upstreams.items()
    ]
    return edge_document({"node-1": providers}, admin=True, openai={"retries": retries})


@dataclass
class Outcome:
    failed: int
    requests: int
    tries: int
    latencies: list[float]


async def drive_requests(host: str, port: int, stream: bool, count: int, conc: int) -> Outcome:
    """`count` requests over `conc` keep-alive connections; a failure is a status other than
    200 or a stream that does not end with [DONE]."""
    loop = asyncio.get_running_loop()
    payload = benchkit.chat_request(f"{host}:{port}", "m", stream)
    left = count
    failed = 0
    latencies: list[float] = []

    async def worker() -> None:
        nonlocal left, failed
        connection: Any = None
        while left > 0:
            left -= 1
            if connection is None:
                _, connection = await loop.create_connection(benchkit.Connection, host, port)
            connection.done = loop.create_future()
            connection.tail = b""
            began = time.perf_counter()
            connection.transport.write(payload)
            try:
                await connection.done
            except ConnectionError:
                failed += 1
                connection = None
                continue
            latencies.append((time.perf_counter() - began) * 1000)
            ok = connection.parser.get_status_code() == 200
            if stream and not connection.tail.endswith(b"data: [DONE]\n\n"):
                ok = False
            failed += not ok
        if connection is not None:
            connection.transport.close()

    await asyncio.gather(*(worker() for _ in range(conc)))
    return Outcome(failed, count, 0, latencies)


async def completions(listen: str) -> int:
    async with httpx.AsyncClient() as http:
        return int((await http.get(f"http://{listen}/fake/stats")).json()["completions"])


async def errors(args: argparse.Namespace) -> None:
    scenarios: list[tuple[str, tuple[str, ...]]] = [
        (f"one of two fails 30%, {mode}", (mode,)) for mode in args.fail_modes
    ]
    scenarios.append(("both fail 30%, status", ("status", "status")))
    results = []
    for label, failing in scenarios:
        for retries_on in (True, False):
            async with contextlib.AsyncExitStack() as exits:
                names = ["up-a", "up-b"]
                flags: dict[str, list[str]] = {name: [] for name in names}
                for name, mode in zip(reversed(names), failing, strict=False):
                    flags[name] = ["--fail-rate", "0.3", "--fail-mode", mode, "--seed", "7"]
                upstreams = {
                    name: await exits.enter_async_context(spawn_fake_upstream(flags[name]))
                    for name in names
                }
                folder = Path(exits.enter_context(tempfile.TemporaryDirectory()))
                retries = {} if retries_on else {"max_per_request": 0}
                config = pool_config({n: u.base_url for n, u in upstreams.items()}, retries)
                edge, started = await spawn_edge(benchkit.write_stack(folder, config))
                exits.push_async_callback(terminate, edge)
                node = await spawn_node(started["hub_port"], "node-1", folder / "token")
                exits.push_async_callback(terminate, node)
                host, port = benchkit.split_url(started["url"])
                await benchkit.wait_available(host, port, b'"providers_available":["up-a","up-b"]')
                for stream in (False, True):
                    before = sum([await completions(u.listen) for u in upstreams.values()])
                    outcome = await drive_requests(host, port, stream, args.requests, 16)
                    after = sum([await completions(u.listen) for u in upstreams.values()])
                    outcome.tries = after - before
                    results.append((label, "stream" if stream else "whole", retries_on, outcome))
                    print(f"  {label}, stream={stream}, retries={retries_on}", file=sys.stderr)
    print("\n| scenario | mode | retries | client errors | tries per request | p50 ms | p99 ms |")
    print("|---|---|---|---:|---:|---:|---:|")
    for label, mode, retries_on, o in results:
        print(
            f"| {label} | {mode} | {'defaults' if retries_on else 'off'} | "
            f"{o.failed / o.requests:.1%} ({o.failed}/{o.requests}) | {o.tries / o.requests:.3f} | "
            f"{benchkit.pct(o.latencies, 50):.2f} | {benchkit.pct(o.latencies, 99):.2f} |"
        )


async def main(args: argparse.Namespace) -> None:
    if "relay" in args.parts:
        await relay(args)
    if "cost" in args.parts:
        await cost(args)
    if "errors" in args.parts:
        await errors(args)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--parts", nargs="+", choices=("relay", "cost", "errors"), default=["errors"]
    )
    parser.add_argument("--baseline", metavar="PYTHON", help="interpreter of the baseline (cost)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per cell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests", type=int, default=2000, help="requests per errors row")
    parser.add_argument("--fail-modes", nargs="+", choices=FAIL_MODES, default=list(FAIL_MODES))
    parser.add_argument("--relay-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if {"relay", "cost"} & set(args.parts) and not args.baseline and not args.relay_child:
        parser.error("the relay and cost parts need --baseline PYTHON")
    return args


if __name__ == "__main__":
    arguments = parse()
    if arguments.relay_child:
        relay_child()
        sys.exit(0)
    print(f"# bench/retries.py on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}", flush=True)
    uvloop.run(main(arguments))
