"""`iop edge run`: the Edge from a config file, until SIGTERM or SIGINT.

SIGHUP makes the running Edge re-read its config file and apply it through the same path as the
admin API's `POST /refresh` (the report is logged).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import orjson
import uvloop

from iop import tracing
from iop.aiokits import guarded_task, stop_tasks
from iop.edge import EdgeServer
from iop.edge.http import AdminAuthError
from iop.edge.refresh import ConfigFileRefused, ConfigSource
from iop.edgeconfig import ConfigError, load_file, require_token_hashes
from iop.wire import TlsError

from .policies import PolicyRefused, policy_for_run
from .problems import print_problems
from .settling import settle

logger = logging.getLogger("iop.edge.run")


def run_edge(args: argparse.Namespace) -> int:
    """`iop edge run`: serve until SIGTERM or SIGINT; the exit code."""
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_file(args.config)
        require_token_hashes(config)
    except ConfigError as error:
        print_problems(str(args.config), error)
        return 1
    try:
        policy = policy_for_run(args, "iop edge run")
    except PolicyRefused:
        return 1
    try:
        edge = EdgeServer(
            config,
            openai_listen=args.openai_listen,
            hub_listen=args.hub_listen,
            shutdown_grace_s=args.shutdown_grace,
            admin_listen=args.admin_listen or config.edge.admin.listen,
            metrics_listen=args.metrics_listen or config.edge.metrics.listen,
            # Absolute now: SIGHUP and a refresh without a source re-read it whatever the
            # working directory (a refresh reads only absolute paths).
            config_path=os.path.abspath(args.config),
            peers_service=args.peers_service,
            upstream_policy=policy,
            wait_for_nodes_s=args.wait_for_nodes,
        )
    except (AdminAuthError, TlsError) as exc:
        print(f"iop edge run: {exc}", file=sys.stderr)
        return 1
    tracing.configure("iop-edge")  # on when OTEL_EXPORTER_OTLP_ENDPOINT says where to
    try:
        uvloop.run(_serve(edge, os.path.abspath(args.config)))
    except OSError as exc:
        print(f"iop edge run: {exc}", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()
    return 0


async def _serve(edge: EdgeServer, config_path: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    def hangup() -> None:
        task = guarded_task(_reload(edge, config_path), name="edge-sighup-reload", logger=logger)
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, hangup)
    async with edge:
        # One line on stdout once serving, for scripts that start the Edge (like `iop up`).
        started = {
            "url": edge.url,
            "hub_port": edge.hub_port,
            "admin_url": edge.admin_url,
            "metrics_url": edge.metrics_url,
        }
        print(orjson.dumps(started).decode(), flush=True)
        settle()
        await stop.wait()
        loop.remove_signal_handler(signal.SIGHUP)
        await stop_tasks(reloads)


async def _reload(edge: EdgeServer, config_path: str) -> None:
    """SIGHUP: re-read the config file and apply it (the refresher logs the outcome)."""
    try:
        report = await edge.refresher.apply(
            ConfigSource.of_path(config_path), requested_by="SIGHUP"
        )
    except ConfigFileRefused as refused:  # gone, not a regular file, too large: nothing applied
        logger.error("SIGHUP: cannot re-read the config file: %s; nothing changed", refused)
        return
    logger.debug("SIGHUP refresh report: %s", orjson.dumps(report.as_dict()).decode())
