"""Benchmark: where the request path's tail comes from, and process-level knobs side by side.

    uv run --frozen python -m bench.tail [--seconds 4] [--rounds 3] [--concurrency 1 32]
        [--variants today baseline gc-relaxed switch-1ms] [--baseline PYTHON] [--py-spy PATH]

The Edge and the Node run as real `iop edge run` / `iop node run` processes (the `openai`
adapter against `iop fake-upstream`), each started through this script (`--child`), which
instruments the process without touching the product's code:

- GC pauses: `gc.callbacks` times every collection, by generation;
- event-loop stalls: a task that asks to wake every 2 ms records how late it wakes, i.e. how long
  a ready callback can wait behind the loop's current work;
- the coalescing writers' batches: items per gRPC message, per writer.

Variants, each a separate Edge + Node pair measured in turn within each round (the load
generator of bench/edge.py: httptools, one keep-alive connection per worker): `today` (this
checkout as it is); `baseline` (the same processes from another checkout's interpreter,
`--baseline PYTHON`, e.g. the main branch's `.venv/bin/python`, so a change to the product's code
is measured against the code before it in the same run); and process-level knobs on top of
`today`: `gc-relaxed` (a first-generation threshold of 10,000 allocations instead of 700, so
young collections run far less often) and `switch-1ms` (the GIL's switch interval at 1 ms
instead of 5, for grpc.aio's completion-queue thread). It prints, per variant, mode and
concurrency: requests/s, p50, p99, p99/p50, CPU per request of the Edge and the Node, and what
the instruments saw during that cell. With `--py-spy PATH` (py-spy's binary, installed anywhere
but the project's environment) it then samples the Edge and the Node of `today` under c=32 load,
streaming and not, and prints where their CPU goes (own time by function, and time under each
of the product's functions). Figures go to docs/benchmarks.md ("## Where the tail comes from").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from bench import benchkit

VARIANTS = ("today", "baseline", "gc-relaxed", "switch-1ms")


# -- inside an instrumented Edge or Node process ---------------------------------------------------


@dataclass
class Instruments:
    gc_pauses: dict[int, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    lags: list[float] = field(default_factory=list)
    batches: dict[str, collections.Counter[int]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )

    def snapshot(self) -> dict[str, Any]:
        lags = sorted(self.lags)
        return {
            "gc": {
                str(gen): {"n": len(p), "total_ms": sum(p), "max_ms": max(p, default=0.0)}
                for gen, p in sorted(self.gc_pauses.items())
            },
            "lag": {
                "n": len(lags),
                "p50_ms": _quantile(lags, 0.5),
                "p99_ms": _quantile(lags, 0.99),
                "max_ms": lags[-1] if lags else 0.0,
                "over_5ms": sum(1 for x in lags if x > 5),
            },
            "batches": {
                name: {"messages": sum(c.values()), "items": sum(k * v for k, v in c.items())}
                | {"p50": _counter_quantile(c, 0.5), "p99": _counter_quantile(c, 0.99)}
                for name, c in self.batches.items()
            },
        }

    def reset(self) -> None:
        self.gc_pauses.clear()
        self.lags.clear()
        self.batches.clear()


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _counter_quantile(counter: collections.Counter[int], q: float) -> int:
    total = sum(counter.values())
    seen = 0
    for size in sorted(counter):
        seen += counter[size]
        if seen >= q * total:
            return size
    return 0


def child(out: Path, variant: str, argv: list[str]) -> int:
    """Run `iop ARGV...` in this process with the instruments on and the variant's knobs."""
    from iop.cli import main as iop_main
    from iop.wire import writing

    instruments = Instruments()
    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[info["generation"]] = time.perf_counter()
        else:
            began = started.pop(info["generation"], None)
            if began is not None:
                pause = (time.perf_counter() - began) * 1000
                instruments.gc_pauses[info["generation"]].append(pause)

    gc.callbacks.append(on_gc)
    if variant == "gc-relaxed":
        gc.set_threshold(10_000, 10, 10)
    if variant == "switch-1ms":
        sys.setswitchinterval(0.001)

    original_init = writing.CoalescingWriter.__init__

    def counting_init(self: Any, send: Any, *, name: str, **kwargs: Any) -> None:
        kind = "hub-writer" if name.startswith("hub-writer") else name.split("-")[0]

        async def counted(batch: Sequence[Any]) -> None:
            instruments.batches[kind][len(batch)] += 1
            await send(batch)

        original_init(self, counted, name=name, **kwargs)

    writing.CoalescingWriter.__init__ = counting_init  # type: ignore[method-assign]

    original_run = uvloop.run

    def instrumented_run(main: Coroutine[Any, Any, Any], **kwargs: Any) -> Any:
        async def wrapped() -> Any:
            loop = asyncio.get_running_loop()

            def dump() -> None:
                with out.open("a") as file:
                    file.write(json.dumps(instruments.snapshot()) + "\n")
                instruments.reset()

            loop.add_signal_handler(signal.SIGUSR1, dump)

            async def watch_lag() -> None:
                while True:
                    before = time.perf_counter()
                    await asyncio.sleep(0.002)
                    instruments.lags.append((time.perf_counter() - before - 0.002) * 1000)

            watcher = asyncio.create_task(watch_lag(), name="bench-lag-watcher")
            try:
                return await main
            finally:
                watcher.cancel()

        return original_run(wrapped(), **kwargs)

    uvloop.run = instrumented_run
    return iop_main(argv)


# -- the driver ------------------------------------------------------------------------------------


@dataclass
class Stack:
    host: str
    port: int
    pids: dict[str, int]
    stats: dict[str, Path]


async def spawn_child(
    stats: Path, variant: str, *argv: str, python: str = sys.executable
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *benchkit.module_command(python, "tail", "--child", str(stats), "--variant", variant),
        "--",
        *argv,
        stdout=asyncio.subprocess.PIPE if argv[0] == "edge" else None,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=benchkit.REPO,
    )


@contextlib.asynccontextmanager
async def stack(folder: Path, variant: str, python: str) -> AsyncIterator[Stack]:
    from iop.processes import terminate

    stats = {"edge": folder / f"{variant}-edge.jsonl", "node": folder / f"{variant}-node.jsonl"}
    config = folder / "edge.yaml"
    edge = await spawn_child(
        stats["edge"],
        variant,
        *("edge", "run", "--config", str(config), "--log-level", "WARNING"),
        python=python,
    )
    node: asyncio.subprocess.Process | None = None
    try:
        started = await benchkit.started_line(edge)
        node = await spawn_child(
            stats["node"],
            variant,
            *("node", "run", "--edge", f"127.0.0.1:{started['hub_port']}", "--node-id", "node-1"),
            *("--token-file", str(folder / "token"), "--log-level", "WARNING"),
            python=python,
        )
        host, port = benchkit.split_url(started["url"])
        await benchkit.wait_available(host, port, b'"providers_available":["p-fake","p-http"]')
        yield Stack(host, port, {"edge": edge.pid, "node": node.pid}, stats)
    finally:
        if node is not None:
            await terminate(node)
        await terminate(edge)


async def collect(target: Stack) -> dict[str, dict[str, Any]]:
    """Ask both processes for their instruments' figures since the last call."""
    sizes = {
        name: path.stat().st_size if path.exists() else 0 for name, path in target.stats.items()
    }
    for pid in target.pids.values():
        os.kill(pid, signal.SIGUSR1)
    found: dict[str, dict[str, Any]] = {}
    for _ in range(200):
        for name, path in target.stats.items():
            if name not in found and path.exists() and path.stat().st_size > sizes[name]:
                with path.open() as file:
                    file.seek(sizes[name])
                    found[name] = json.loads(file.readline())
        if len(found) == len(target.stats):
            return found
        await asyncio.sleep(0.01)
    raise RuntimeError("the instrumented processes did not answer")


@dataclass
class Row:
    rps: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    cpu: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    seen: list[dict[str, dict[str, Any]]] = field(default_factory=list)


async def drive(args: argparse.Namespace) -> None:
    from iop.processes import spawn_fake_upstream

    rows: dict[tuple[str, str, int], Row] = collections.defaultdict(Row)
    async with spawn_fake_upstream() as upstream:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            benchkit.write_stack(folder, benchkit.edge_config(upstream.base_url))
            async with contextlib.AsyncExitStack() as exits:
                stacks = {
                    v: await exits.enter_async_context(
                        stack(folder, v, args.baseline if v == "baseline" else sys.executable)
                    )
                    for v in args.variants
                }
                for round_ in range(args.rounds):
                    for stream in (False, True):
                        for conc in args.concurrency:
                            for variant in args.variants:
                                target = stacks[variant]
                                await measure_cell(
                                    target,
                                    stream,
                                    conc,
                                    args.seconds,
                                    rows[(variant, "stream" if stream else "whole", conc)],
                                )
                    print(f"  round {round_ + 1} done", file=sys.stderr, flush=True)
                report(rows, args)
                if args.py_spy:
                    await profile(stacks[args.variants[0]], args)


async def measure_cell(target: Stack, stream: bool, conc: int, seconds: float, row: Row) -> None:
    payload = benchkit.chat_request(f"{target.host}:{target.port}", "openai", stream)
    await benchkit.measure(target.host, target.port, payload, conc, 0.3)  # warm-up
    await collect(target)  # resets the instruments
    cell, cpu = await benchkit.measure_cpu(
        target.host, target.port, payload, conc, seconds, target.pids
    )
    seen = await collect(target)
    for name, used in cpu.items():
        row.cpu[name].append(used)
    row.rps.append(cell.rps)
    row.latencies.extend(cell.latencies)
    row.seen.append(seen)


Seen = list[dict[str, dict[str, Any]]]


def gc_sum(seen: Seen, proc: str, what: str) -> float:
    return float(sum(g[what] for s in seen for g in s[proc]["gc"].values()))


def gc_max(seen: Seen, proc: str) -> float:
    return float(max((g["max_ms"] for s in seen for g in s[proc]["gc"].values()), default=0.0))


def lag(seen: Seen, proc: str, what: str) -> float:
    values = [float(s[proc]["lag"][what]) for s in seen]
    return max(values) if what == "max_ms" else statistics.median(values)


def batch(seen: Seen, proc: str, writer: str) -> str:
    got = [b for b in (s[proc]["batches"].get(writer) for s in seen) if b]
    if not got:
        return "-"
    return f"{statistics.median(b['p50'] for b in got):.0f}/{max(b['p99'] for b in got)}"


def report(rows: dict[tuple[str, str, int], Row], args: argparse.Namespace) -> None:
    print(
        "| variant | mode | conc | req/s | p50 ms | p99 ms | p99/p50 | CPU us/req edge + node "
        "| GC runs/s (edge, node) | GC ms/s | max GC ms | loop lag p99 ms (edge, node) "
        "| max lag ms | hub batch p50/p99 | node batch p50/p99 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---|---|---|---|---|---|---|")
    for (variant, mode, conc), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        lat = sorted(row.latencies)
        p50, p99 = _quantile(lat, 0.5), _quantile(lat, 0.99)
        secs = args.seconds * len(row.seen)
        seen = row.seen
        cpu = f"{statistics.median(row.cpu['edge']):.0f} + {statistics.median(row.cpu['node']):.0f}"
        print(
            f"| {variant} | {mode} | {conc} | {statistics.median(row.rps):,.0f} | {p50:.2f} | "
            f"{p99:.2f} | {p99 / p50:.1f} | {cpu} | "
            f"{gc_sum(seen, 'edge', 'n') / secs:.0f}, {gc_sum(seen, 'node', 'n') / secs:.0f} | "
            f"{gc_sum(seen, 'edge', 'total_ms') / secs:.1f}, "
            f"{gc_sum(seen, 'node', 'total_ms') / secs:.1f} | "
            f"{max(gc_max(seen, 'edge'), gc_max(seen, 'node')):.1f} | "
            f"{lag(seen, 'edge', 'p99_ms'):.2f}, {lag(seen, 'node', 'p99_ms'):.2f} | "
            f"{max(lag(seen, 'edge', 'max_ms'), lag(seen, 'node', 'max_ms')):.1f} | "
            f"{batch(seen, 'edge', 'hub-writer')} | {batch(seen, 'node', 'node')} |"
        )


async def profile(target: Stack, args: argparse.Namespace) -> None:
    """py-spy over the Edge and the Node while c=32 load runs, streaming and not."""
    for stream in (False, True):
        payload = benchkit.chat_request(f"{target.host}:{target.port}", "openai", stream)
        with tempfile.TemporaryDirectory() as tmp:
            outputs = {name: Path(tmp) / f"{name}.txt" for name in target.pids}
            spies = [
                await asyncio.create_subprocess_exec(
                    args.py_spy,
                    *("record", "--pid", str(pid), "--duration", str(int(args.profile_seconds))),
                    *("--rate", "200", "--format", "raw", "--output", str(outputs[name])),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
                for name, pid in target.pids.items()
            ]
            await benchkit.measure(target.host, target.port, payload, 32, args.profile_seconds + 1)
            for spy in spies:
                await spy.wait()
            for name, path in outputs.items():
                print(f"\n### {name}, {'stream' if stream else 'whole'}, c=32\n")
                summarise(path.read_text())


def summarise(folded: str, top: int = 14) -> None:
    """Own time by function and time under each of the product's functions, from py-spy's raw
    (folded) output: one line per stack, `frame;frame;... count`."""
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    total = 0
    for line in folded.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_short(f) for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            if "iop/" in frame or "iop." in frame:
                under[frame] += n
    if not total:
        print("(no samples)")
        return
    print(f"{total} samples; own time:\n")
    for frame, n in own.most_common(top):
        print(f"- {n / total:5.1%} {frame}")
    print("\ntime under the product's functions:\n")
    for frame, n in under.most_common(top):
        print(f"- {n / total:5.1%} {frame}")


def _short(frame: str) -> str:
    """`func (path/to/site-packages/pkg/mod.py:12)` -> `func (pkg/mod.py)`."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/src/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["today"])
    parser.add_argument("--baseline", metavar="PYTHON", help="interpreter of the baseline")
    parser.add_argument("--py-spy", metavar="PATH", help="py-spy's binary: profile `today`")
    parser.add_argument("--profile-seconds", type=int, default=8)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="today", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child is not None:
        sys.exit(child(args.child, args.variant, rest[1:] if rest[:1] == ["--"] else rest))
    if "baseline" in args.variants and not args.baseline:
        parser.error("the baseline variant needs --baseline PYTHON")
    print(
        f"{benchkit.opening('bench/tail.py', 1)}; {args.rounds} rounds of {args.seconds:g} s "
        "per cell\n",
        flush=True,
    )
    uvloop.run(drive(args))
    print("\n" + benchkit.closing(1))


if __name__ == "__main__":
    main()
