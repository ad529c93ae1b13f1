"""`iop edge run`: the Edge, serving the OpenAI API through the provider pool."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

import uvloop

from iop.edge import EdgeServer
from iop.edgeconfig import ConfigError, load_file

__all__ = ["register"]


def register(commands: Any) -> None:
    edge = commands.add_parser("edge", help="run the Edge")
    sub = edge.add_subparsers(dest="edge_command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="serve the OpenAI API and the node hub from a config file",
        description="Load and validate the config, listen for Nodes on edge.listen and serve "
        "the OpenAI-compatible API on openai.listen until SIGTERM or SIGINT; then stop taking "
        "requests, let running ones finish and close the Nodes' connections.",
    )
    run.add_argument("--config", required=True, help="path of the edge.yaml")
    run.add_argument("--openai-listen", default=None, help="override openai.listen (host:port)")
    run.add_argument("--hub-listen", default=None, help="override edge.listen (host:port)")
    run.add_argument(
        "--shutdown-grace", type=float, default=10.0, help="seconds running requests may finish"
    )
    run.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    run.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_file(args.config)
    except ConfigError as error:
        print(f"{args.config}: {len(error.problems)} problem(s)", file=sys.stderr)
        for problem in error.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    edge = EdgeServer(
        config,
        openai_listen=args.openai_listen,
        hub_listen=args.hub_listen,
        shutdown_grace_s=args.shutdown_grace,
    )
    try:
        uvloop.run(_serve(edge))
    except OSError as exc:
        print(f"iop edge run: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(edge: EdgeServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with edge:
        # One line on stdout once serving, for scripts that start the Edge (like `iop up`).
        print(f'{{"url": "{edge.url}", "hub_port": {edge.hub_port}}}', flush=True)
        await stop.wait()
