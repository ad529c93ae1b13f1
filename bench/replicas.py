"""Benchmark: one Edge and one Node against two Edge replicas and two Nodes, on the same machine.

    uv run --frozen python -m bench.replicas [--rounds 3] [--seconds 3] [--concurrency 32]

Real processes as deployed (`iop fake-upstream`, `iop edge run`, `iop node run` with the
`openai` adapter), in two topologies that take turns within each round:

- `1 edge + 1 node`: the Node has one provider; the load goes to the one Edge;
- `2 edges + 2 nodes`: each Node has one provider and dials both Edges (as a Node keeps a
  connection to every replica); both Edges dispatch to both providers; the load is split evenly
  between the Edges (as a Service spreads connections).

The load generator is bench/edge.py's (httptools, one keep-alive connection per worker). It
prints requests/s, p50, p99 and the CPU time per request of every Edge and Node process summed
(from /proc), streaming and not: what a second replica costs or saves per request when both
share the same cores. Figures go to docs/benchmarks.md ("## Scaling out").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop
import yaml

from bench import benchkit
from iop.processes import spawn_edge, spawn_fake_upstream, spawn_iop, terminate
from testkit import edge_document, node_token_of, provider

TOPOLOGIES = {"1 edge + 1 node": 1, "2 edges + 2 nodes": 2}


def document(upstream_url: str, nodes: int) -> dict[str, Any]:
    adapter = {"type": "openai", "base_url": upstream_url}
    return edge_document(
        {
            f"node-{i}": [provider(f"p-{i}", adapter, capacity=1024, max_queue=1024)]
            for i in range(1, nodes + 1)
        },
        admin=True,
    )


@dataclass
class Topology:
    edges: list[tuple[str, int]]
    pids: list[int]


@contextlib.asynccontextmanager
async def topology(folder: Path, upstream_url: str, replicas: int) -> AsyncIterator[Topology]:
    config = folder / f"edge-{replicas}.yaml"
    config.write_text(yaml.safe_dump(document(upstream_url, replicas)))
    processes: list[asyncio.subprocess.Process] = []
    try:
        edges = []
        for _ in range(replicas):
            process, started = await spawn_edge(config)
            processes.append(process)
            edges.append(started)
        dials = [arg for s in edges for arg in ("--edge", f"127.0.0.1:{s['hub_port']}")]
        for i in range(1, replicas + 1):
            token = folder / f"token-{i}"
            token.write_text(node_token_of(f"node-{i}"))
            processes.append(
                await spawn_iop(
                    *("node", "run", *dials, "--node-id", f"node-{i}"),
                    *("--token-file", str(token), "--log-level", "WARNING"),
                )
            )
        wanted = ",".join(f'"p-{i}"' for i in range(1, replicas + 1)).encode()
        addresses = [benchkit.split_url(s["url"]) for s in edges]
        for host, port in addresses:
            await benchkit.wait_available(host, port, b'"providers_available":[' + wanted + b"]")
        yield Topology(addresses, [p.pid for p in processes])
    finally:
        for process in reversed(processes):
            await terminate(process)


@dataclass
class Row:
    rps: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)


async def measure(
    target: Topology, stream: bool, concurrency: int, seconds: float, row: Row
) -> None:
    share = concurrency // len(target.edges)
    payloads = [benchkit.chat_request(f"{host}:{port}", "m", stream) for host, port in target.edges]
    await asyncio.gather(
        *(
            benchkit.measure(host, port, payload, share, 0.3)
            for (host, port), payload in zip(target.edges, payloads, strict=True)
        )
    )
    before = benchkit.cpu_seconds(*target.pids)
    cells = await asyncio.gather(
        *(
            benchkit.measure(host, port, payload, share, seconds)
            for (host, port), payload in zip(target.edges, payloads, strict=True)
        )
    )
    served = sum(len(c.latencies) for c in cells)
    row.cpu_us.append((benchkit.cpu_seconds(*target.pids) - before) / served * 1e6)
    row.rps.append(sum(c.rps for c in cells))
    for cell in cells:
        row.latencies.extend(cell.latencies)


async def main(args: argparse.Namespace) -> None:
    rows: dict[tuple[str, str, int], Row] = collections.defaultdict(Row)
    async with spawn_fake_upstream() as upstream:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            async with contextlib.AsyncExitStack() as stack:
                targets = {
                    name: await stack.enter_async_context(
                        topology(folder, upstream.base_url, replicas)
                    )
                    for name, replicas in TOPOLOGIES.items()
                }
                for round_ in range(args.rounds):
                    for stream in (False, True):
                        for conc in args.concurrency:
                            for name, target in targets.items():
                                mode = "stream" if stream else "whole"
                                row = rows[(mode, name, conc)]
                                await measure(target, stream, conc, args.seconds, row)
                    print(f"  round {round_ + 1} done", file=sys.stderr, flush=True)
    print("| mode | conc | topology | req/s | p50 ms | p99 ms | CPU us/req, Edges + Nodes |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for (mode, name, conc), row in sorted(rows.items(), key=lambda kv: (kv[0][0] != "whole",)):
        lat = sorted(row.latencies)
        p50 = lat[len(lat) // 2]
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(
            f"| {mode} | {conc} | {name} | {statistics.median(row.rps):,.0f} | {p50:.2f} | "
            f"{p99:.2f} | {statistics.median(row.cpu_us):,.0f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32])
    arguments = parser.parse_args()
    print(
        f"{benchkit.opening('bench/replicas.py', 1)}; {arguments.rounds} rounds of "
        f"{arguments.seconds:g} s per cell\n"
    )
    uvloop.run(main(arguments))
    print("\n" + benchkit.closing(1))
