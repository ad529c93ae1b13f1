"""Benchmark: Edge node hub -> Node -> fake upstream, against calling the fake upstream directly.

    uv run --frozen python -m bench.wire [--seconds 4] [--concurrency 1 64]

One run measures both paths side by side, streaming and not, at each concurrency:

- direct: this process runs the Node's own `openai` adapter (aiohttp pool, SSE parsing) against
  the fake upstream, so the only difference to the other path is the wire itself;
- wire: this process runs the Edge's `NodeHub`; a real `iop node run` process serves the runs
  through the same adapter against the same fake upstream (`iop fake-upstream`, a process);
- "fake adapter" rows: the same, with the Node's built-in `fake` adapter instead of HTTP, which
  shows the wire's own ceiling (direct = the same generator in this process).

Latency is request start to terminal event (RunDone). It prints runs/s, p50/p99 latency, the
ratio wire/direct and the latency the wire adds. Figures go to docs/benchmarks.md ("## Wire").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import uvloop

from bench.benchkit import pct
from iop.edge.hub.nodehub import NodeHub
from iop.edgeconfig import FakeAdapterSettings, OpenAIAdapterSettings, load_data
from iop.processes import spawn_fake_upstream, spawn_node, terminate
from iop.providers import FakeAdapter, OpenAIAdapter
from iop.wire import RunDone, RunRequest
from testkit import edge_document, node_token_of, provider


def body(stream: bool) -> bytes:
    return orjson.dumps(
        {
            "model": "served",
            "messages": [{"role": "user", "content": "Say something about gateways."}],
            "max_tokens": 16,
            "stream": stream,
        }
    )


async def measure(
    one: Callable[[int], Awaitable[None]], concurrency: int, seconds: float
) -> tuple[float, list[float]]:
    """Run `one(i)` from `concurrency` workers for `seconds`; (runs/s, latencies in ms)."""
    latencies: list[float] = []
    counter = iter(range(10**9))
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def worker() -> None:
        while loop.time() < end:
            start = time.perf_counter()
            await one(next(counter))
            latencies.append((time.perf_counter() - start) * 1000)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies) / (time.perf_counter() - began), latencies


@contextlib.asynccontextmanager
async def node_process(port: int, token_file: Path) -> AsyncIterator[None]:
    process = await spawn_node(port, "node-1", token_file)
    try:
        yield
    finally:
        await terminate(process)


async def main(seconds: float, concurrencies: list[int]) -> None:
    async with spawn_fake_upstream() as upstream:
        http = {"type": "openai", "base_url": upstream.base_url}
        providers = [provider("p1", http, capacity=1024), provider("p2", capacity=1024)]
        config = load_data(edge_document({"node-1": providers}, {"m": ["p1"]}))
        direct = OpenAIAdapter("direct", OpenAIAdapterSettings(base_url=upstream.base_url))
        fake = FakeAdapter("direct-fake", FakeAdapterSettings())
        with tempfile.TemporaryDirectory() as tmp:
            token_file = Path(tmp) / "token"
            token_file.write_text(node_token_of("node-1"))
            async with NodeHub(config) as hub, node_process(hub.port or 0, token_file):
                while not hub.connected_providers():
                    await asyncio.sleep(0.05)
                await run_table(hub, direct, fake, seconds, concurrencies)
        await direct.aclose()


async def run_table(
    hub: NodeHub,
    direct: OpenAIAdapter,
    fake: FakeAdapter,
    seconds: float,
    concurrencies: list[int],
) -> None:
    rows = []
    cases = [("whole", False, "p1"), ("stream", True, "p1"), ("fake adapter, stream", True, "p2")]
    for mode, stream, pid in cases:
        payload = body(stream)
        adapter: OpenAIAdapter | FakeAdapter = direct if pid == "p1" else fake

        async def via_direct(
            i: int, payload: bytes = payload, stream: bool = stream, adapter: Any = adapter
        ) -> None:
            request = RunRequest(f"d{i}", "p1", "served", "chat", payload, stream, None)
            last = None
            async for event in adapter.run(request):
                last = event
            assert isinstance(last, RunDone), last

        async def via_wire(
            i: int,
            payload: bytes = payload,
            stream: bool = stream,
            pid: str = pid,
            mode: str = mode,
        ) -> None:
            request = RunRequest(f"w{i}-{mode}", pid, "served", "chat", payload, stream, None)
            last = None
            async with hub.run(request) as events:
                async for event in events:
                    last = event
            assert isinstance(last, RunDone), last

        for concurrency in concurrencies:
            await measure(via_direct, concurrency, 0.5)  # warm-up
            await measure(via_wire, concurrency, 0.5)
            direct_rps, direct_lat = await measure(via_direct, concurrency, seconds)
            wire_rps, wire_lat = await measure(via_wire, concurrency, seconds)
            rows.append(
                (
                    mode,
                    concurrency,
                    direct_rps,
                    wire_rps,
                    pct(direct_lat, 50),
                    pct(wire_lat, 50),
                    pct(direct_lat, 99),
                    pct(wire_lat, 99),
                )
            )
            print(f"  measured {rows[-1][0]} c={concurrency}", file=sys.stderr, flush=True)
    print(
        "| mode | conc | direct runs/s | wire runs/s | wire/direct | direct p50 ms | wire p50 ms "
        "| added p50 ms | direct p99 ms | wire p99 ms | added p99 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, conc, d_rps, w_rps, d50, w50, d99, w99 in rows:
        print(
            f"| {mode} | {conc} | {d_rps:,.0f} | {w_rps:,.0f} | {w_rps / d_rps:.2f} | "
            f"{d50:.2f} | {w50:.2f} | {w50 - d50:+.2f} | {d99:.2f} | {w99:.2f} | {w99 - d99:+.2f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    print(f"# bench/wire.py on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}", flush=True)
    uvloop.run(main(args.seconds, args.concurrency))
