"""Benchmark: what one message costs on a gRPC stream, by API and by gRPC's own knobs.

    uv run --frozen python -m bench.grpc_hops [--seconds 3] [--rounds 3]
        [--variants aio sync aio-poll aio-lowat] [--in-flight 1 32]

The Edge <-> Node wire is one bidirectional gRPC stream per connection, and a message on it costs
each side far more CPU than its bytes (docs/benchmarks.md). This script isolates that cost: two
processes, a server and a client, ping-pong raw byte messages (no protobuf: what remains is
gRPC's own) on one bidirectional stream, with `--in-flight` messages outstanding (1: every
message waits for its answer, the c=1 case; 32: a pipelined stream, the batching case). Per
variant it prints round trips per second, the round trip's p50, and the CPU per round trip of
each process (from /proc), the client's and the server's.

Variants, taking turns within each round:

- `aio`: grpc.aio on both sides, each on uvloop, as the product runs;
- `sync`: the synchronous API, the server's handler on its thread pool, the client's reader on a
  thread of its own (the "sync API on a thread");
- `aio-poll`: `aio` with `GRPC_POLL_STRATEGY=poll` (epoll1 is the default on Linux);
- `aio-lowat`: `aio` with `GRPC_EXPERIMENTS=tcp_rcv_lowat` (fewer wake-ups on the read path);
- `aio-options`: `aio` with the channel and server options that trade for latency or fewer
  writes (`grpc.http2.bdp_probe` off, `grpc.optimization_target` latency, 1 MiB write buffer).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import uvloop

from bench import benchkit

METHOD = "/bench.Echo/Connect"
PAYLOAD = b"x" * 200  # about one chunk object of a stream
VARIANTS: dict[str, dict[str, str]] = {
    "aio": {},
    "sync": {},
    "aio-poll": {"GRPC_POLL_STRATEGY": "poll"},
    "aio-lowat": {"GRPC_EXPERIMENTS": "tcp_rcv_lowat"},
    "aio-options": {},
}
OPTIONS = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.optimization_target", "latency"),
    ("grpc.http2.write_buffer_size", 1 << 20),
]


def options(variant: str) -> list[tuple[str, Any]]:
    return OPTIONS if variant == "aio-options" else []


# -- the server ------------------------------------------------------------------------------------


def echo_handler(stream_stream: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "bench.Echo", {"Connect": grpc.stream_stream_rpc_method_handler(stream_stream)}
    )


async def serve_aio(variant: str) -> None:
    async def connect(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for message in requests:
            yield message

    server = grpc.aio.server(options=options(variant))
    server.add_generic_rpc_handlers([echo_handler(connect)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def serve_sync() -> None:
    def connect(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        yield from requests

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers([echo_handler(connect)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


# -- the client ------------------------------------------------------------------------------------


async def client_aio(port: int, variant: str, in_flight: int, seconds: float) -> list[float]:
    """Round trip times (s) of `in_flight` messages kept outstanding for `seconds`."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options(variant)) as channel:
        call: Any = channel.stream_stream(METHOD)()
        sent: list[float] = []
        times: list[float] = []
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        for _ in range(in_flight):
            sent.append(time.perf_counter())
            await call.write(PAYLOAD)
        index = 0
        while True:
            await call.read()
            times.append(time.perf_counter() - sent[index])
            index += 1
            if loop.time() < end:
                sent.append(time.perf_counter())
                await call.write(PAYLOAD)
            elif index == len(sent):
                break
        await call.done_writing()
        return times


def client_sync(port: int, in_flight: int, seconds: float) -> list[float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        outgoing: queue.Queue[bytes | None] = queue.Queue()
        sent: list[float] = []
        times: list[float] = []
        connect: Any = channel.stream_stream(METHOD)
        answers: Iterator[bytes] = connect(iter(outgoing.get, None))
        end = time.monotonic() + seconds
        for _ in range(in_flight):
            sent.append(time.perf_counter())
            outgoing.put(PAYLOAD)
        index = 0
        for _ in answers:
            times.append(time.perf_counter() - sent[index])
            index += 1
            if time.monotonic() < end:
                sent.append(time.perf_counter())
                outgoing.put(PAYLOAD)
            elif index == len(sent):
                outgoing.put(None)
        return times


# -- the run ---------------------------------------------------------------------------------------


def run_cell(variant: str, in_flight: int, seconds: float) -> tuple[float, float, float, float]:
    """(round trips/s, p50 ms, client CPU us per round trip, server CPU us per round trip)."""
    env = {**os.environ, **VARIANTS[variant]}
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_hops", "--serve", variant],
        cwd=benchkit.REPO,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        numbers = [str(in_flight), str(seconds), str(server.pid)]
        client = subprocess.run(
            [sys.executable, "-m", "bench.grpc_hops", "--client", variant, str(port), *numbers],
            cwd=benchkit.REPO,
            capture_output=True,
            env=env,
            check=True,
            text=True,
        )
        rate, p50, client_cpu, server_cpu = (float(x) for x in client.stdout.split())
        return rate, p50, client_cpu, server_cpu
    finally:
        server.terminate()
        server.wait()


def client_main(variant: str, port: int, in_flight: int, seconds: float, server_pid: int) -> None:
    # A warm-up, then the measured stretch; CPU from /proc for this process and the server.
    if variant == "sync":
        client_sync(port, in_flight, 0.3)
    else:
        uvloop.run(client_aio(port, variant, in_flight, 0.3))
    before = (benchkit.cpu_seconds(os.getpid()), benchkit.cpu_seconds(server_pid))
    began = time.perf_counter()
    if variant == "sync":
        times = client_sync(port, in_flight, seconds)
    else:
        times = uvloop.run(client_aio(port, variant, in_flight, seconds))
    elapsed = time.perf_counter() - began
    after = (benchkit.cpu_seconds(os.getpid()), benchkit.cpu_seconds(server_pid))
    count = len(times)
    print(
        count / elapsed,
        statistics.median(times) * 1000,
        (after[0] - before[0]) / count * 1e6,
        (after[1] - before[1]) / count * 1e6,
    )


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        variant = sys.argv[2]
        if variant == "sync":
            serve_sync()
        else:
            uvloop.run(serve_aio(variant))
        return
    if sys.argv[1:2] == ["--client"]:
        variant, port, in_flight, seconds, pid = sys.argv[2:7]
        client_main(variant, int(port), int(in_flight), float(seconds), int(pid))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    print(
        f"# bench/grpc_hops.py, grpcio {grpc.__version__}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load average {benchkit.load_average()}, "
        f"{args.rounds} rounds of {args.seconds:g} s",
        flush=True,
    )
    cells: dict[tuple[int, str], list[tuple[float, float, float, float]]] = {}
    for round_ in range(args.rounds):
        turn = (
            args.variants[round_ % len(args.variants) :]
            + args.variants[: round_ % len(args.variants)]
        )
        for in_flight in args.in_flight:
            for variant in turn:
                cell = run_cell(variant, in_flight, args.seconds)
                cells.setdefault((in_flight, variant), []).append(cell)
                print(
                    f"  round {round_ + 1} {variant} in flight {in_flight}: {cell}", file=sys.stderr
                )
    print(benchkit.closing() + "\n")
    print(
        "| in flight | variant | round trips/s | p50 ms | CPU us per round trip: client "
        "| server | both | both / aio's |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for in_flight in args.in_flight:
        base = None
        for variant in args.variants:
            rows = cells[(in_flight, variant)]
            rate, p50, client, server = (statistics.median(r[i] for r in rows) for i in range(4))
            both = client + server
            if variant == "aio":
                base = both
            ratio = f"{both / base:.2f}" if base else "-"
            print(
                f"| {in_flight} | {variant} | {rate:,.0f} | {p50:.3f} | {client:,.1f} | "
                f"{server:,.1f} | {both:,.1f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
