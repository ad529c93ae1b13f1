"""`iop fake-collector`: an OpenTelemetry trace receiver that shows what it got, for tests and
demos (`iop.fakes.FakeCollector`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import orjson
import uvloop

from iop.aiokits import split_listener
from iop.fakes import FakeCollector


def register(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of `iop fake-collector` to its parser."""
    parser.description = (
        "Receive OpenTelemetry spans over OTLP/gRPC (point OTEL_EXPORTER_OTLP_ENDPOINT at "
        "--otlp-listen) and serve the latest as JSON on --http-listen: GET /spans, POST /reset. "
        'Once listening it prints one JSON line on stdout: {"otlp": "HOST:PORT", '
        '"http": "HOST:PORT", "pid": N}.'
    )
    parser.add_argument(
        "--otlp-listen", default="127.0.0.1:4317", help="host:port of OTLP/gRPC; port 0 picks one"
    )
    parser.add_argument(
        "--http-listen", default="127.0.0.1:4320", help="host:port of GET /spans; port 0 picks one"
    )
    parser.add_argument("--max-spans", type=int, default=10_000, help="the latest spans kept")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    for flag, value in (("--otlp-listen", args.otlp_listen), ("--http-listen", args.http_listen)):
        try:
            split_listener(value)
        except ValueError as exc:
            print(f"iop fake-collector: {flag} {value}: {exc}", file=sys.stderr)
            return 2
    if args.max_spans < 1:
        print("iop fake-collector: --max-spans must be at least 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    uvloop.run(_serve(args.otlp_listen, args.http_listen, args.max_spans))
    return 0


async def _serve(otlp_listen: str, http_listen: str, max_spans: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    collector = FakeCollector(max_spans)
    otlp_port, http_port = await collector.start(otlp_listen, http_listen)
    try:
        otlp_host, http_host = otlp_listen.rpartition(":")[0], http_listen.rpartition(":")[0]
        line = {"otlp": f"{otlp_host}:{otlp_port}", "http": f"{http_host}:{http_port}"}
        sys.stdout.write(orjson.dumps({**line, "pid": os.getpid()}).decode() + "\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await collector.stop()
