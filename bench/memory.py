"""Benchmark: the Edge's memory per idle keep-alive connection and per open stream, and after.

    uv run --frozen python -m bench.memory [--connections 2000] [--streams 2000] [--cycles 3]
        [--placement node|edge]

Real processes: `iop fake-upstream` (streams paced by its per-request hook, so they stay open),
`iop edge run` and `iop node run` (the `openai` adapter, pool and capacity large enough for every
stream); with `--placement edge`, the Edge alone runs the provider (a node placed on the Edge:
its streams' upstream connections are the Edge's). RSS is read from /proc (VmRSS) once the Edge
has served some requests, then:

- idle: N connections to the OpenAI listener, each with one answered `GET /healthz` and then
  left open (within uvicorn's keep-alive timeout of 5 s); RSS with all of them open;
- streams: N streaming completions at once, each counted once its first event arrived; RSS (Edge
  and Node) with all of them open; then every client disconnects (which cancels its run);
- after: RSS once every connection closed; the whole is repeated `--cycles` times, so growth from
  one cycle to the next shows memory that closing does not give back.

Prints KiB per idle connection and per open stream (RSS delta / N) for each cycle, and the RSS
after each cycle. Figures go to docs/benchmarks.md ("## Memory").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from bench import benchkit
from iop.processes import spawn_fake_upstream
from testkit import CLIENT_TOKEN, Placement, edge_document, provider


def config(upstream_url: str, size: int, placement: Placement) -> dict[str, Any]:
    adapter = {"type": "openai", "base_url": upstream_url, "max_connections": size}
    return edge_document(
        {"node-1": [provider("p", adapter, capacity=size, max_queue=size)]},
        placement=placement,
        admin=True,
        # Every connection and stream comes from this one address: past the per-client bounds
        # of the client guards they would be refused, not measured.
        openai={
            "max_connections": 2 * size + 64,
            "max_connections_per_client": 2 * size,
            "max_requests_per_client": size,
        },
    )


def completion(host: str, stream: bool, tokens_per_second: float | None = None) -> bytes:
    """A chat completion of 8 tokens; with `tokens_per_second`, the fake upstream's per-request
    hook (which the Edge and the Node pass through) paces it."""
    body = benchkit.body("m", stream, pace=tokens_per_second or None)
    return benchkit.http_request(host, "/v1/chat/completions", body, CLIENT_TOKEN)


async def read_until(reader: asyncio.StreamReader, marker: bytes) -> None:
    seen = b""
    while marker not in seen:
        piece = await reader.read(65536)
        if not piece:
            raise ConnectionError("the Edge closed the connection")
        seen = seen[-len(marker) :] + piece


async def settle(seconds: float = 1.5) -> None:
    await asyncio.sleep(seconds)


async def cycle(
    host: str, port: int, pids: dict[str, int], args: argparse.Namespace
) -> dict[str, float]:
    found: dict[str, float] = {}
    before = benchkit.rss_kib(pids["edge"])
    idle = []
    for _ in range(args.connections):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        idle.append((reader, writer))
    await asyncio.gather(*(read_until(r, b'{"status":"ok"}') for r, _ in idle))
    found["idle_kib"] = (benchkit.rss_kib(pids["edge"]) - before) / args.connections
    for _, writer in idle:
        writer.close()
    await settle()
    before_streams = {name: benchkit.rss_kib(pid) for name, pid in pids.items()}
    streams = []
    payload = completion(f"{host}:{port}", True, args.tokens_per_second)
    for _ in range(args.streams):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(payload)
        streams.append((reader, writer))
    await asyncio.gather(*(read_until(r, b"data: ") for r, _ in streams))
    for name, pid in pids.items():
        found[f"stream_{name}_kib"] = (benchkit.rss_kib(pid) - before_streams[name]) / args.streams
    for _, writer in streams:
        writer.close()
    await settle(3.0)
    for name, pid in pids.items():
        found[f"after_{name}_kib"] = benchkit.rss_kib(pid)
    return found


async def main(args: argparse.Namespace) -> None:
    size = max(args.streams, 16) + 64
    async with spawn_fake_upstream(startup_timeout=120) as upstream:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            benchkit.write_stack(folder, config(upstream.base_url, size, args.placement))
            node = args.placement == "node"
            wanted = b'"providers_available":["p"]'
            async with benchkit.start_stack(folder, wanted, node=node, timeout=120) as stack:
                started, pids = stack
                host, port = benchkit.split_url(started["url"])
                # warm-up: a few hundred requests, so lazily built things exist before measuring
                reader, writer = await asyncio.open_connection(host, port)
                for _ in range(200):
                    writer.write(completion(f"{host}:{port}", stream=False))
                    await read_until(reader, b'"usage"')
                writer.close()
                await settle()
                start = {name: benchkit.rss_kib(pid) for name, pid in pids.items()}
                print(
                    f"# bench/memory.py, {time.strftime('%Y-%m-%d %H:%M')}, load average "
                    f"{os.getloadavg()[0]:.1f}; {args.connections} idle connections, "
                    f"{args.streams} open streams per cycle\n"
                )
                node_start = f"{start['node']:,} KiB" if "node" in start else "none"
                print(f"RSS after warm-up: Edge {start['edge']:,} KiB, Node {node_start}\n")
                print(
                    "| cycle | Edge KiB per idle connection | Edge KiB per open stream "
                    "| Node KiB per open stream | Edge RSS after, KiB | Node RSS after, KiB |"
                )
                print("|---:|---:|---:|---:|---:|---:|")
                for number in range(1, args.cycles + 1):
                    found = await cycle(host, port, pids, args)
                    print(
                        f"| {number} | {found['idle_kib']:.1f} | {found['stream_edge_kib']:.1f} | "
                        f"{found.get('stream_node_kib', float('nan')):.1f} | "
                        f"{found['after_edge_kib']:,.0f} | "
                        f"{found.get('after_node_kib', float('nan')):,.0f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--tokens-per-second", type=float, default=1.0)
    parser.add_argument(
        "--placement",
        choices=("node", "edge"),
        default="node",
        help="the provider in a Node (default) or placed on the Edge",
    )
    uvloop.run(main(parser.parse_args()))
