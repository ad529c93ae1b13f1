"""Benchmark: the Edge's request path (Edge -> Node -> fake upstream) against the fake upstream
called directly, in one run, streaming and not, at several concurrencies.

    uv run --frozen python -m bench.edge [--seconds 3] [--concurrency 1 32 128]
        [--paths openai node-fake edge-alone] [--probe-interval-ms 0 1000]

Three real processes, as deployed: `iop fake-upstream`, `iop edge run` (auth on, metrics on, a
principal token, the full dispatch path) and `iop node run` (the `openai` adapter against the
fake upstream). The load generator in this process keeps one HTTP/1.1 keep-alive connection per
worker and parses responses with httptools, so that the client costs as little CPU as possible;
everything shares the machine's cores, as in the figures of docs/benchmarks.md.

Rows, each against the same direct path (the fake upstream over HTTP):

- `openai`: Edge -> Node -> `openai` adapter -> fake upstream, the path deployed;
- `node fake`: Edge -> Node with its built-in `fake` adapter (no upstream HTTP): the Edge plus
  the wire, without the Node's HTTP client;
- `edge alone`: an Edge process whose hub answers at once in-process (`--stub-edge`): the Edge's
  own HTTP, auth, validation, dispatch and metering, and nothing else.

`--probe-interval-ms` measures the `openai` row once per value given, with the Node probing the
fake upstream at that interval (0: probing off; `nodes[].providers[].health.interval_ms`), each
on its own Edge and Node: the cost of active health checks, side by side in one run. Repeat
values (`0 1000 0 1000`) to see how much the machine drifts between rows.

Per cell it prints requests/s for both paths and their ratio, p50/p99 latency (request sent to
the last byte) and the latency the Edge path adds, and for streams the time to first byte of the
body (the first SSE event) and what the Edge adds to it; then the CPU time each process spent
per request while the Edge path was measured (from /proc), which shows where the cores go.
Figures go to docs/benchmarks.md ("## Edge request path").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
import uvloop

from bench import benchkit
from bench.benchkit import (
    MAX_TOKENS,
    body,
    edge_config,
    http_request,
    measure,
    pct,
    split_url,
)
from iop.edge import EdgeServer
from iop.edge.hub.protocol import NodeStatus, PreparedSwap, ProviderLink, ProviderLoad
from iop.edgeconfig import EdgeConfig, load_file
from iop.processes import spawn_fake_upstream
from iop.wire import RunChunk, RunDone, RunEvent, RunRequest, RunUsage
from iop.wire.nodestates import ConfigAck


@contextlib.asynccontextmanager
async def edge_stack(folder: Path) -> AsyncIterator[tuple[str, int, dict[str, int]]]:
    """`iop edge run` and `iop node run` processes; yields the Edge's OpenAI host and port and
    the processes' ids."""
    wanted = b'"providers_available":["p-fake","p-http"]'
    async with benchkit.start_stack(folder, wanted) as (started, pids):
        host, port = split_url(started["url"])
        yield host, port, pids


@contextlib.asynccontextmanager
async def stub_edge(folder: Path) -> AsyncIterator[tuple[str, int, dict[str, int]]]:
    """This module as an Edge process whose hub answers every run at once (`--stub-edge`)."""
    async with benchkit.stub_edge(sys.executable, folder / "edge.yaml") as (host, port, pid):
        yield host, port, {"edge": pid}


# -- the stub hub of `--stub-edge` ---------------------------------------------------------------


class _InstantStream:
    def __init__(self, events: list[RunEvent]) -> None:
        self._events = iter(events)

    async def __aenter__(self) -> _InstantStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def __aiter__(self) -> _InstantStream:
        return self

    def take_ready(self) -> list[RunEvent]:
        return list(self._events)  # every event is there at once

    async def __anext__(self) -> RunEvent:
        for event in self._events:
            return event
        raise StopAsyncIteration

    def on_end(self, callback: Callable[[], object]) -> None:
        callback()  # every event is there from the start: the run has ended already

    def cancel(self, *, first_byte_timeout: bool = False) -> None:
        return None  # nothing runs anywhere


class InstantHub:
    """Answers every run at once with what the fake upstream would send (8 tokens)."""

    def __init__(self) -> None:
        words = [" word"] * MAX_TOKENS
        self._whole: list[RunEvent] = [
            RunChunk(
                orjson.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 1,
                        "model": "served",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "".join(words)},
                                "finish_reason": "length",
                            }
                        ],
                        "usage": {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16},
                    }
                )
            ),
            RunUsage(8, MAX_TOKENS, 8 + MAX_TOKENS),
            RunDone("length"),
        ]
        chunks = [{"role": "assistant", "content": ""}, *({"content": w} for w in words), {}]
        self._stream: list[RunEvent] = [
            *(
                RunChunk(
                    orjson.dumps(
                        {
                            "id": "x",
                            "object": "chat.completion.chunk",
                            "created": 1,
                            "model": "served",
                            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                        }
                    )
                )
                for delta in chunks
            ),
            RunUsage(8, MAX_TOKENS, 8 + MAX_TOKENS),
            RunDone("length"),
        ]
        self._links = {p: ProviderLink(p, "node-1", healthy=True) for p in ("p-http", "p-fake")}

    def connected_providers(self) -> Mapping[str, ProviderLink]:
        return self._links

    def add_listener(self, callback: Callable[[], None]) -> None:
        return None

    def provider_loads(self) -> Mapping[str, ProviderLoad]:
        return {}

    def run(self, request: RunRequest) -> _InstantStream:
        return _InstantStream(self._stream if request.stream else self._whole)

    async def start(self) -> int:
        return 0

    def prepare(self, config: EdgeConfig, generation: int) -> PreparedSwap:
        return PreparedSwap(config, generation, config, {}, {})

    async def swap_config(
        self,
        config: EdgeConfig,
        *,
        generation: int | None = None,
        ack_timeout: float = 0.0,
        hold: Collection[str] = (),
        prepared: PreparedSwap | None = None,
    ) -> Mapping[str, ConfigAck | None]:
        return {}

    def nodes(self) -> Mapping[str, NodeStatus]:
        return {}

    def payload_digests(self) -> Mapping[str, str]:
        return {}

    async def stop(self, grace: float = 0.0) -> None:
        return None


async def serve_stub_edge(config_path: str) -> None:
    config = load_file(config_path)
    async with EdgeServer(config, hub=InstantHub()) as edge:
        print(orjson.dumps({"url": edge.url, "hub_port": 0}).decode(), flush=True)
        await asyncio.Event().wait()


async def main(
    seconds: float, concurrencies: list[int], paths: list[str], probe_intervals: list[int] | None
) -> None:
    rows = []
    async with spawn_fake_upstream() as upstream:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            benchkit.write_stack(folder, edge_config(upstream.base_url))
            up_host, up_port = split_url(upstream.listen)
            runs: list[tuple[str, str, Callable[..., Any], Path]] = []
            for index, interval in enumerate(probe_intervals or [None]):
                label, where = "openai", folder
                if interval is not None:
                    label = f"openai, probes {f'{interval} ms' if interval else 'off'}"
                    where = folder / f"probes-{index}"
                    where.mkdir()
                    benchkit.write_stack(where, edge_config(upstream.base_url, interval))
                runs.append((label, "openai", edge_stack, where))
            runs += [
                ("node fake", "node-fake", edge_stack, folder),
                ("edge alone", "openai", stub_edge, folder),
            ]
            for label, model, stack, where in runs:
                if label.split(",")[0].replace(" ", "-") not in paths:
                    continue
                async with stack(where) as (edge_host, edge_port, pids):
                    pids = {**pids, "upstream": upstream.pid, "load": os.getpid()}
                    for stream in (False, True):
                        direct_payload = http_request(
                            upstream.listen, "/v1/chat/completions", body("served", stream), None
                        )
                        edge_payload = benchkit.chat_request(
                            f"{edge_host}:{edge_port}", model, stream
                        )
                        for concurrency in concurrencies:
                            # warm-up, then both paths in turn
                            await measure(up_host, up_port, direct_payload, concurrency, 0.5)
                            await measure(edge_host, edge_port, edge_payload, concurrency, 0.5)
                            direct = await measure(
                                up_host, up_port, direct_payload, concurrency, seconds
                            )
                            edge, cpu = await benchkit.measure_cpu(
                                edge_host, edge_port, edge_payload, concurrency, seconds, pids
                            )
                            mode = f"{label}, {'stream' if stream else 'whole'}"
                            rows.append((mode, concurrency, direct, edge, cpu))
                            print(f"  measured {mode} c={concurrency}", file=sys.stderr, flush=True)
    print(
        "| path | conc | direct req/s | edge req/s | edge/direct | direct p50 ms | edge p50 ms "
        "| added p50 ms | direct p99 ms | edge p99 ms | added p99 ms | added TTFB p50 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, conc, d, e, _ in rows:
        d50, e50 = pct(d.latencies, 50), pct(e.latencies, 50)
        d99, e99 = pct(d.latencies, 99), pct(e.latencies, 99)
        ttfb = f"{pct(e.firsts, 50) - pct(d.firsts, 50):+.2f}" if "stream" in mode else "-"
        print(
            f"| {mode} | {conc} | {d.rps:,.0f} | {e.rps:,.0f} | {e.rps / d.rps:.2f} | "
            f"{d50:.2f} | {e50:.2f} | {e50 - d50:+.2f} | {d99:.2f} | {e99:.2f} | "
            f"{e99 - d99:+.2f} | {ttfb} |"
        )
    print("\nCPU time per request on the Edge path, by process (us), load generator included:\n")
    print("| path | conc | edge req/s | edge | node | upstream | load generator |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, conc, _, e, cpu in rows:
        node = f"{cpu['node']:,.0f}" if "node" in cpu else "-"
        print(
            f"| {mode} | {conc} | {e.rps:,.0f} | {cpu['edge']:,.0f} | {node} | "
            f"{cpu['upstream']:,.0f} | {cpu['load']:,.0f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=("openai", "node-fake", "edge-alone"),
        default=["openai", "node-fake", "edge-alone"],
        help="which rows to measure",
    )
    parser.add_argument(
        "--probe-interval-ms",
        type=int,
        nargs="+",
        default=None,
        metavar="MS",
        help="measure the openai row once per interval at which the Node probes the upstream "
        "(0: probing off); default: one row, the config's default",
    )
    parser.add_argument("--stub-edge", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stub_edge:
        uvloop.run(serve_stub_edge(args.stub_edge))
        sys.exit(0)
    print(f"# bench/edge.py on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}", flush=True)
    uvloop.run(main(args.seconds, args.concurrency, args.paths, args.probe_interval_ms))
