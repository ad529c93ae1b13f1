"""`iop node run`: the Node agent, dialing one or several Edges."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import uvloop

from iop.node import NodeAgent

from .settling import settle

__all__ = ["register"]


def register(commands: Any) -> None:
    """Add this module\'s subcommands to the `iop` parser."""
    node = commands.add_parser("node", help="run a Node agent")
    sub = node.add_subparsers(dest="node_command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="connect to the Edge(s) and serve runs",
        description="Dial every Edge given, authenticate with the token, apply the config each "
        "Edge sends and serve its runs; reconnect with backoff whenever a connection drops.",
    )
    run.add_argument(
        "--edge",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an Edge replica to keep a connection to (repeat for several)",
    )
    run.add_argument(
        "--edge-service",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="a name resolving to every Edge replica (headless Service): one connection each",
    )
    run.add_argument("--node-id", required=True, help="this node's id in the EdgeConfig")
    run.add_argument("--token-file", required=True, type=Path, help="file holding the node's token")
    run.add_argument("--alias", default=None, help="a human-readable name for status")
    run.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds a replaced adapter may wait for its runs before it is closed anyway",
    )
    run.add_argument(
        "--backoff-max", type=float, default=10.0, help="longest wait between reconnects"
    )
    run.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    run.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.edge and not args.edge_service:
        print("iop node run: give at least one --edge or --edge-service", file=sys.stderr)
        return 2
    try:
        token = args.token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        print(f"iop node run: cannot read --token-file: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if not token:
        print(f"iop node run: {args.token_file} is empty", file=sys.stderr)
        return 2
    try:
        agent = NodeAgent(
            node_id=args.node_id,
            token=token,
            edges=args.edge,
            services=args.edge_service,
            alias=args.alias,
            drain_timeout=args.drain_timeout,
            backoff_max=args.backoff_max,
        )
    except ValueError as exc:
        print(f"iop node run: {exc}", file=sys.stderr)
        return 2
    uvloop.run(_serve(agent))
    return 0


async def _serve(agent: NodeAgent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with agent:
        settle()
        await stop.wait()
