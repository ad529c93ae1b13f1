"""`iop node run`: the Node agent, dialing one or several Edges.

SIGTERM drains: the Node tells every Edge it is leaving (they stop dispatching to it), refuses
runs that still arrive with the retryable `provider_busy`, lets the runs in flight finish for up
to `--shutdown-grace` seconds, then exits. A second SIGTERM (or SIGINT) exits at once.

TLS is a per-process setting, hence flags rather than config: the Node has no config file (the
Edge sends it everything else), while its CA, certificate and key are files mounted into its
own pod.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop

from iop import tracing
from iop.aiokits import bind_listener, split_listener
from iop.node import HealthServer, NodeAgent
from iop.wire import ClientTls, TlsError

from .policies import PolicyRefused, add_policy_option, policy_for_run
from .settling import settle

if TYPE_CHECKING:
    from iop.edgeconfig import UpstreamPolicy


def register(parser: argparse.ArgumentParser) -> None:
    """Add the `iop node` subcommands to its parser."""
    sub = parser.add_subparsers(dest="node_command", required=True, metavar="COMMAND")
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
    run.add_argument(
        "--resolve-interval",
        type=_interval,
        default=30.0,
        metavar="SECONDS",
        help="with --edge-service: seconds between two lookups of the Edge replicas while every "
        "address listed has welcomed this node (it looks every second while one is missing); "
        "default 30",
    )
    run.add_argument(
        "--shutdown-grace",
        type=float,
        default=25.0,
        help="seconds the runs in flight may finish after SIGTERM (stay below the pod's "
        "terminationGracePeriodSeconds)",
    )
    run.add_argument(
        "--tls-ca-file",
        type=Path,
        default=None,
        help="PEM CA that signed the Edge's certificate: dial with TLS and verify the Edge",
    )
    run.add_argument(
        "--tls-cert-file",
        type=Path,
        default=None,
        help="PEM client certificate, for an Edge that requires mutual TLS",
    )
    run.add_argument("--tls-key-file", type=Path, default=None, help="PEM key of --tls-cert-file")
    run.add_argument(
        "--tls-server-name",
        default=None,
        help="the name the Edge's certificate carries, when the dialed address is not in it",
    )
    run.add_argument(
        "--health-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve GET /healthz (the process answers) and GET /readyz (an Edge has welcomed "
        "this node, it is not draining, and every provider of its config can run here) here, "
        "for the kubelet's probes; default: none",
    )
    add_policy_option(run, "of this Node's providers")
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
        policy = policy_for_run(args, "iop node run")
    except PolicyRefused:
        return 2
    try:
        agent = _agent(args, token, policy)
    except ValueError as exc:  # TlsError included
        print(f"iop node run: {exc}", file=sys.stderr)
        return 2
    health = None
    if args.health_listen is not None:
        try:
            health = bind_listener(*split_listener(args.health_listen), "--health-listen")
        except (ValueError, OSError) as exc:
            print(f"iop node run: --health-listen {args.health_listen}: {exc}", file=sys.stderr)
            return 2
    tracing.configure("iop-node")  # on when OTEL_EXPORTER_OTLP_ENDPOINT says where to
    try:
        uvloop.run(_serve(agent, args.shutdown_grace, health))
    finally:
        tracing.shutdown()
    return 0


def _agent(args: argparse.Namespace, token: str, policy: UpstreamPolicy | None) -> NodeAgent:
    """The Node agent of `iop node run ARGS` (not started); ValueError for a bad address or TLS
    setting."""
    return NodeAgent(
        node_id=args.node_id,
        token=token,
        edges=args.edge,
        services=args.edge_service,
        alias=args.alias,
        drain_timeout=args.drain_timeout,
        backoff_max=args.backoff_max,
        resolve_interval=args.resolve_interval,
        tls=_tls(args),
        policy=policy,
    )


def _interval(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: must be more than 0 seconds")
    return seconds


def _tls(args: argparse.Namespace) -> ClientTls | None:
    if args.tls_ca_file is None:
        if args.tls_cert_file or args.tls_key_file or args.tls_server_name:
            raise TlsError(
                "--tls-cert-file, --tls-key-file and --tls-server-name need --tls-ca-file"
            )
        return None
    return ClientTls(
        ca_file=str(args.tls_ca_file),
        cert_file=str(args.tls_cert_file) if args.tls_cert_file else None,
        key_file=str(args.tls_key_file) if args.tls_key_file else None,
        server_name=args.tls_server_name,
    )


async def _serve(agent: NodeAgent, grace: float, health: socket.socket | None) -> None:
    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, signals.put_nowait, signum)
    async with agent:
        server = HealthServer(agent.readiness, health) if health is not None else None
        if server is not None:
            await server.start()
        try:
            settle()
            await signals.get()
            drain = asyncio.ensure_future(agent.drain(grace))
            second = asyncio.ensure_future(signals.get())
            await asyncio.wait([drain, second], return_when=asyncio.FIRST_COMPLETED)
            for task in (drain, second):
                task.cancel()
            await asyncio.wait([drain, second])
        finally:
            if server is not None:
                await server.stop()
