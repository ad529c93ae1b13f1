"""Benchmark: the Edge's OpenAI API served by uvicorn (today) and by granian, side by side.

    uv run --frozen python -m bench.studies.http_servers [--rounds 3] [--seconds 3]
        [--concurrency 1 32 128]

Both servers run the same `OpenAIApp` (auth, validation, dispatch, metering, SSE) over the stub hub
of bench/edge.py (`InstantHub`: every run answered at once, in-process), so the difference is the
HTTP server alone. uvicorn (httptools) runs as `iop edge run` does; granian runs in its embedded
mode (one process, the application on the same asyncio loop, hyper/tokio doing the HTTP in
Rust). granian is installed, pinned, with the project into a virtual environment of its own
under a cache directory (`--cache`, default `$XDG_CACHE_HOME/iop-bench/granian`), never into the
project's. The servers take turns within each round under the load generator of bench/edge.py
(httptools, one keep-alive connection per worker).

It prints requests/s, p50, p99 and the server process's CPU time per request for each server,
and granian's ratio to uvicorn. Figures go to docs/benchmarks.md ("## Where the tail comes
from").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import uvloop
import yaml

from bench import benchkit
from bench.edge import InstantHub
from testkit import CLIENT_TOKEN

GRANIAN = "granian==2.8.7"
SERVERS = ("uvicorn", "granian")


# -- granian's side (inside its environment) -------------------------------------------------------


async def serve_granian(config_path: str) -> None:
    from granian.constants import HTTPModes, Interfaces
    from granian.server.embed import Server

    from iop.edge.authenticating import Authenticator
    from iop.edge.http.openaiapp import OpenAIApp
    from iop.edge.hub import READY
    from iop.edge.hub.protocol import available_providers
    from iop.edge.pool.dispatching import Dispatcher
    from iop.edge.pool.metering import Metrics
    from iop.edge.pool.snapshots import PoolSnapshot
    from iop.edgeconfig import load_file

    config = load_file(config_path)
    hub = InstantHub()
    dispatcher = Dispatcher(PoolSnapshot.build(config))
    dispatcher.set_available(available_providers(hub.connected_providers()))
    app = OpenAIApp(
        dispatcher=dispatcher,
        hub=hub,
        authenticator=Authenticator(config.openai),
        metrics=Metrics(dispatcher),
        max_request_bytes=config.openai.max_request_bytes,
        ready=lambda: READY,
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server: Any = Server(
        app,
        address="127.0.0.1",
        port=port,
        interface=Interfaces.ASGINL,
        http=HTTPModes.http1,
        websockets=False,
        log_enabled=False,
        backlog=1024,
    )
    serving = asyncio.create_task(server.serve())
    for _ in range(500):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        break
    print(orjson.dumps({"url": f"http://127.0.0.1:{port}"}).decode(), flush=True)
    await serving


# -- the driver ------------------------------------------------------------------------------------


async def start(
    python: str, name: str, *args: str
) -> tuple[asyncio.subprocess.Process, tuple[str, int]]:
    process = await asyncio.create_subprocess_exec(
        *benchkit.module_command(python, name, *args),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=benchkit.REPO,
    )
    line = await benchkit.started_line(process)
    return process, benchkit.split_url(line["url"])


async def drive(args: argparse.Namespace, granian_python: Path) -> None:
    from iop.processes import terminate

    rows: dict[tuple[str, int, str], dict[str, list[Any]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "edge.yaml"
        config.write_text(yaml.safe_dump(benchkit.edge_config("http://127.0.0.1:9/v1")))
        servers = {
            "uvicorn": await start(sys.executable, "edge", "--stub-edge", str(config)),
            "granian": await start(
                str(granian_python), "studies.http_servers", "--serve", str(config)
            ),
        }
        try:
            for _ in range(args.rounds):
                for stream in (False, True):
                    for conc in args.concurrency:
                        for name in SERVERS:
                            process, (host, port) = servers[name]
                            payload = benchkit.http_request(
                                f"{host}:{port}",
                                "/v1/chat/completions",
                                benchkit.body("openai", stream),
                                CLIENT_TOKEN,
                            )
                            await benchkit.measure(host, port, payload, conc, 0.3)
                            before = benchkit.cpu_seconds(process.pid)
                            cell = await benchkit.measure(host, port, payload, conc, args.seconds)
                            cpu = benchkit.cpu_seconds(process.pid) - before
                            row = rows[("stream" if stream else "whole", conc, name)]
                            row["rps"].append(cell.rps)
                            row["cpu_us"].append(cpu / len(cell.latencies) * 1e6)
                            row["latencies"].extend(cell.latencies)
        finally:
            for process, _ in servers.values():
                await terminate(process)
    print("| mode | conc | server | req/s | x uvicorn | p50 ms | p99 ms | CPU us/req |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for mode in ("whole", "stream"):
        for conc in args.concurrency:
            base = statistics.median(rows[(mode, conc, "uvicorn")]["rps"])
            for name in SERVERS:
                row = rows[(mode, conc, name)]
                lat = sorted(row["latencies"])
                p50, p99 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.99 * len(lat)))]
                rps = statistics.median(row["rps"])
                print(
                    f"| {mode} | {conc} | {name} | {rps:,.0f} | {rps / base:.2f} | "
                    f"{p50:.2f} | {p99:.2f} | {statistics.median(row['cpu_us']):,.0f} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--cache", type=Path, default=benchkit.default_cache("granian"))
    parser.add_argument("--serve", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        uvloop.run(serve_granian(args.serve))
        return
    root = benchkit.REPO  # this checkout, into granian's environment
    python = benchkit.ensure_venv(args.cache / "venv", [GRANIAN], project=root)
    load = os.getloadavg()
    print(
        f"# bench.studies.http_servers on {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, "
        f"load average {load[0]:.1f}; {GRANIAN}; {args.rounds} rounds of {args.seconds:g} s\n"
    )
    uvloop.run(drive(args, python))
    print(f"\n# load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
