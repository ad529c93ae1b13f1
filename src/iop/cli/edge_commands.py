"""`iop edge run`: the Edge, serving the OpenAI API through the provider pool; `iop edge reload`,
`iop edge history` and `iop edge rollout` (`reload_commands`, `revision_commands`).

`iop edge run` is carried out by `edge_running.py`, imported only then: the other commands (HTTP
clients of the admin API) load nothing of the Edge.
"""

from __future__ import annotations

import argparse

from iop.aiokits import split_listener

from . import reload_commands, revision_commands
from .policies import add_policy_option


def register(parser: argparse.ArgumentParser) -> None:
    """Add the `iop edge` subcommands to its parser."""
    sub = parser.add_subparsers(dest="edge_command", required=True, metavar="COMMAND")
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
    run.add_argument("--admin-listen", default=None, help="override edge.admin.listen (host:port)")
    run.add_argument(
        "--metrics-listen", default=None, help="override edge.metrics.listen (host:port)"
    )
    run.add_argument(
        "--shutdown-grace", type=float, default=10.0, help="seconds running requests may finish"
    )
    run.add_argument(
        "--peers-service",
        default=None,
        type=_service,
        metavar="NAME:PORT",
        help="a headless Service listing every Edge replica (the hub Service): the nodes placed "
        "on the Edge share their providers' capacity among the replicas it lists",
    )
    run.add_argument(
        "--wait-for-nodes",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="answer /readyz 503 until every node of the config that dials in has connected, "
        "or for at most SECONDS after the hub starts listening (a node that is down never "
        "keeps the Edge unready); once ready, it stays ready. Default 0: ready at once",
    )
    add_policy_option(run, "of the providers of the nodes placed on this Edge")
    run.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    run.set_defaults(run=_run)
    reload_commands.register(sub)
    revision_commands.register(sub)


def _service(value: str) -> str:
    try:
        split_listener(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    return value


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: must be 0 or more seconds")
    return seconds


def _run(args: argparse.Namespace) -> int:
    from .edge_running import run_edge

    return run_edge(args)
