"""Benchmark: live refresh. Apply -> all node acks with 20 Nodes, and throughput during an apply
storm against a steady run, in one run.

    uv run --frozen python -m bench.refresh [--nodes 20] [--applies 100] [--rounds 8]

Real processes, as deployed: `iop edge run` (admin API on loopback) and one `iop node run` per
node, each node with one provider (the built-in `fake` adapter: no upstream HTTP, so the figures
are the refresh path's and the request path's own). Model `m` maps every provider.

1. Apply latency, idle: `--applies` applies in a row, each flipping every provider's capacity
   (8 <-> 9), so every node gets a `NodeConfigRefreshRequest`. The admin API answers once every
   node has acknowledged, so the client's round trip is "POST /refresh -> all node acks"; the
   report's own `duration_ms` (load, validate, classify, swap, push, acks) is shown beside it.
   The same for applies that push nothing (a priority change: Edge-only), for the Edge's share,
   and the CPU time the Edge and the nodes (all together) spent per apply (Linux /proc).
2. Throughput: one continuous load, cut into windows that differ only in what happens
   meanwhile: nothing (steady), applies back to back, or applies paced at `--storm-rate` per
   second (each pushes to every node). Every storm window sits between two steady ones, and
   counts against their mean, so the machine's drift cancels out; steady windows, compared the
   same way with their steady neighbours, give the noise. Apply latency under load is shown too.
   Every request must succeed, and every apply be acked by every node.

The load generator (bench/benchkit.py's `Connection`) keeps one HTTP/1.1 keep-alive connection
per worker and parses responses with httptools; half the workers stream. Figures go to
docs/benchmarks.md ("## Live refresh").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvloop
import yaml

from bench import benchkit
from iop.processes import spawn_edge, spawn_node, terminate
from testkit import edge_document, node_token_of, provider


def document(nodes: int) -> dict[str, Any]:
    fake = {"type": "fake", "latency_ms": 2, "completion_tokens": 8}
    ids = [f"{index:02d}" for index in range(1, nodes + 1)]
    return edge_document(
        {f"node-{i}": [provider(f"p{i}", fake, max_queue=256)] for i in ids},
        model_settings={"m": {"generation": {"max_tokens": 8}}},
        admin=True,
    )


# -- the load -------------------------------------------------------------------------------------


def payloads(host: str, concurrency: int) -> list[bytes]:
    """One request per connection, half of them streaming."""
    return [benchkit.chat_request(host, "m", index % 2 == 0) for index in range(concurrency)]


# -- the applies ----------------------------------------------------------------------------------


@dataclass
class Applies:
    round_trips: list[float] = field(default_factory=list)
    reported: list[float] = field(default_factory=list)


class Applier:
    def __init__(self, admin: httpx.AsyncClient, base: dict[str, Any]) -> None:
        self.admin = admin
        self.document = base

    async def apply(self, change: str, into: Applies) -> None:
        """`push`: flip every provider's capacity 8 <-> 9; else flip its priority 0 <-> 1."""
        candidate = copy.deepcopy(self.document)
        for node in candidate["nodes"]:
            entry = node["providers"][0]
            if change == "push":
                entry["capacity"] = 17 - entry["capacity"]
            else:
                entry["priority"] = 1 - entry.get("priority", 0)
        started = time.perf_counter()
        response = await self.admin.post("/refresh", json={"mode": "apply", "config": candidate})
        elapsed = (time.perf_counter() - started) * 1000
        report = response.json()
        if response.status_code != 200 or report["outcome"] != "applied":
            raise RuntimeError(f"apply failed: {response.status_code} {response.text[:500]}")
        expected = len(candidate["nodes"]) if change == "push" else 0
        acked = [p for p in report["pushes"] if p["status"] == "acked"]
        if len(acked) != expected or len(report["pushes"]) != expected:
            raise RuntimeError(f"not every node acked: {report['message']}")
        self.document = candidate
        into.round_trips.append(elapsed)
        into.reported.append(report["duration_ms"])


# -- the processes --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def stack(folder: Path, nodes: int) -> AsyncIterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Start the Edge and the nodes; yields the Edge's start line (plus the pids) and the
    config document."""
    base = document(nodes)
    (folder / "edge.yaml").write_text(yaml.safe_dump(base))
    async with contextlib.AsyncExitStack() as exits:
        edge, started = await spawn_edge(folder / "edge.yaml")
        exits.push_async_callback(terminate, edge)
        started["edge_pid"], started["node_pids"] = edge.pid, []
        for node in base["nodes"]:
            token = folder / f"{node['id']}.token"
            token.write_text(node_token_of(node["id"]))
            process = await spawn_node(started["hub_port"], node["id"], token)
            exits.push_async_callback(terminate, process)
            started["node_pids"].append(process.pid)
        wanted = sorted(p["id"] for n in base["nodes"] for p in n["providers"])
        async with httpx.AsyncClient(base_url=started["url"]) as http:
            for _ in range(1200):
                ready = (await http.get("/readyz")).json()
                if ready["providers_available"] == wanted:
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"providers never all available: {ready}")
        yield started, base


# -- the run --------------------------------------------------------------------------------------


async def main(
    nodes: int, applies: int, rounds: int, window: float, concurrency: int, storm_rate: float
) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-refresh-") as folder:
        async with stack(Path(folder), nodes) as (started, base):
            url = httpx.URL(started["url"])
            host, port = url.host, url.port
            assert port is not None
            async with httpx.AsyncClient(base_url=started["admin_url"], timeout=60) as admin:
                applier = Applier(admin, base)
                for _ in range(5):  # warm up: first pushes, connections, caches
                    await applier.apply("push", Applies())
                idle_push, idle_edge = Applies(), Applies()
                edge_pid, node_pids = started["edge_pid"], started["node_pids"]

                async def idle(change: str, into: Applies) -> tuple[float, float]:
                    """`applies` applies of `change`; the CPU the Edge and the Nodes spent."""
                    edge_was = benchkit.cpu_seconds(edge_pid)
                    nodes_were = benchkit.cpu_seconds(*node_pids)
                    for _ in range(applies):
                        await applier.apply(change, into)
                    return (
                        benchkit.cpu_seconds(edge_pid) - edge_was,
                        benchkit.cpu_seconds(*node_pids) - nodes_were,
                    )

                cpu_push = await idle("push", idle_push)
                cpu_edge = await idle("edge", idle_edge)

                # One continuous load; the windows differ only in what the applier does, and
                # every storm window sits between two steady ones: S B S P S B S P ... S.
                paced = f"storm: {storm_rate:g} applies/s"
                rates: dict[str, float | None] = {
                    "steady": None,
                    "storm: applies back to back": 0.0,
                    paced: storm_rate,
                }
                order = ["steady"]
                for _ in range(rounds):
                    order += ["storm: applies back to back", "steady", paced, "steady"]
                timeline: list[tuple[str, float]] = []
                storms = {name: Applies() for name, rate in rates.items() if rate is not None}
                stop = asyncio.Event()
                load = benchkit.Load()
                loader = asyncio.create_task(
                    benchkit.keep_loading(host, port, payloads(host, concurrency), stop, load)
                )
                try:
                    await asyncio.sleep(1.0)  # connections up, caches warm
                    for name in order:
                        rate = rates[name]
                        count, began = load.requests, time.perf_counter()
                        until = began + window
                        if rate is None:
                            await asyncio.sleep(window)
                        while rate is not None and time.perf_counter() < until:
                            start = time.perf_counter()
                            await applier.apply("push", storms[name])
                            if rate:
                                pause = start + 1 / rate - time.perf_counter()
                                await asyncio.sleep(max(0.0, pause))
                        elapsed = time.perf_counter() - began
                        timeline.append((name, (load.requests - count) / elapsed))
                finally:
                    stop.set()
                    await loader

    print(
        f"\n{nodes} nodes; {applies} idle applies per row; load: {concurrency} connections "
        f"(half streaming) throughout, {len(order)} windows of {window:g}s\n"
    )
    print(
        "| applies | nodes pushed | n | round trip p50 ms | p99 ms | reported p50 ms | p99 ms "
        "| Edge CPU ms/apply | nodes' CPU ms/apply |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows_in: list[tuple[str, int, Applies, tuple[float, float] | None]] = [
        ("capacity flip, idle", nodes, idle_push, cpu_push),
        ("priority flip (no push), idle", 0, idle_edge, cpu_edge),
    ]
    rows_in += [(f"capacity flip, {name}", nodes, a, None) for name, a in storms.items()]
    for name, pushed, rows, used in rows_in:
        count = len(rows.round_trips)
        costs = f"{used[0] / count * 1000:.1f} | {used[1] / count * 1000:.1f}" if used else "- | -"
        print(
            f"| {name} | {pushed} | {count} | {benchkit.pct(rows.round_trips, 50):.1f} | "
            f"{benchkit.pct(rows.round_trips, 99):.1f} | {benchkit.pct(rows.reported, 50):.1f} | "
            f"{benchkit.pct(rows.reported, 99):.1f} | {costs} |"
        )
    # Each window against the mean of the steady windows around it (drift cancels out); for a
    # steady window, its steady neighbours two places away: that spread is the noise.
    relative: dict[str, list[float]] = {name: [] for name in rates}
    absolute: dict[str, list[float]] = {name: [] for name in rates}
    for index, (name, rate) in enumerate(timeline):
        absolute[name].append(rate)
        step = 2 if name == "steady" else 1
        around = [
            timeline[i][1]
            for i in (index - step, index + step)
            if 0 <= i < len(timeline) and timeline[i][0] == "steady"
        ]
        if around:
            relative[name].append(rate / statistics.mean(around))
    print("\n| windows | n | req/s median | vs steady neighbours: median | p25 | p75 | applies/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, ratios in relative.items():
        applied = len(storms[name].round_trips) / (rounds * window) if name in storms else 0.0
        quartiles = (
            statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        )
        print(
            f"| {name} | {len(absolute[name])} | {statistics.median(absolute[name]):,.0f} | "
            f"{statistics.median(ratios):.3f} | {quartiles[0]:.3f} | {quartiles[2]:.3f} | "
            f"{applied:.1f} |"
        )
    print(
        f"\n{load.requests} requests, {load.failed} failed; every storm apply pushed to all "
        f"{nodes} nodes and was acked by all"
    )
    if load.failed:
        sys.exit("some requests failed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--applies", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of throughput windows")
    parser.add_argument("--window", type=float, default=2.0, help="seconds per window")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--storm-rate", type=float, default=5.0, help="applies/s of the paced storm"
    )
    options = parser.parse_args()
    uvloop.run(
        main(
            options.nodes,
            options.applies,
            options.rounds,
            options.window,
            options.concurrency,
            options.storm_rate,
        )
    )
