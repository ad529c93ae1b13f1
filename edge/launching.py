"""One Edge: the node hub, the provider pool and the OpenAI HTTP API, under one lifecycle.

`EdgeServer` owns every part and starts and stops them in order: the hub first (Nodes may dial in
while the HTTP side comes up), then uvicorn on the OpenAI listener; on stop, the HTTP side stops
taking requests and lets the running ones finish, then the hub closes the Nodes' connections.
Signals are the caller's business (`iop edge run` maps SIGTERM/SIGINT to `stop()`), so uvicorn's
own signal capture is switched off.

`swap(config)` is the live-refresh seam: it builds the next pool snapshot and swaps it into the
dispatcher with one reference assignment (the refresh API also hands the config to the hub).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Generator
from types import TracebackType
from typing import Self

import uvicorn

from iop.edgeconfig import EdgeConfig, split_listener
from iop.wire import guarded_task

from .authenticating import Authenticator
from .dispatching import Dispatcher
from .metering import Metrics
from .nodehub import NodeHub
from .runs import Hub, available_providers
from .serving import EdgeApp
from .snapshots import PoolSnapshot

__all__ = ["EdgeServer"]

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process decides when the Edge stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class EdgeServer:
    """An Edge process's parts; `async with EdgeServer(config) as edge:` or start()/stop()."""

    def __init__(
        self,
        config: EdgeConfig,
        *,
        hub: Hub | None = None,
        openai_listen: str | None = None,
        hub_listen: str | None = None,
        shutdown_grace_s: float = 10.0,
    ) -> None:
        self.dispatcher = Dispatcher(PoolSnapshot.build(config))
        self.hub: Hub = hub if hub is not None else NodeHub(config, listen=hub_listen)
        self.metrics = Metrics(self.dispatcher)
        self.app = EdgeApp(
            dispatcher=self.dispatcher,
            hub=self.hub,
            authenticator=Authenticator(config.openai),
            metrics=self.metrics,
            max_request_bytes=config.openai.max_request_bytes,
            ready=self.ready,
        )
        self._listen = openai_listen or config.openai.listen
        self._grace = shutdown_grace_s
        self._server: _Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._hub_started = False
        self.host, self.port = split_listener(self._listen)
        self.hub_port: int | None = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (what clients use as base_url, minus the /v1)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
        return f"http://{host}:{self.port}"

    def ready(self) -> bool:
        """Config loaded, the hub listening and the HTTP side serving."""
        server = self._server
        return self._hub_started and server is not None and server.started

    def swap(self, config: EdgeConfig) -> PoolSnapshot:
        """Dispatch on `config` from now on (one reference swap); returns the new snapshot."""
        snapshot = PoolSnapshot.build(config, self.dispatcher.snapshot.generation + 1)
        self.dispatcher.swap(snapshot)
        return snapshot

    async def start(self) -> None:
        self.hub_port = await self.hub.start()
        self._hub_started = True
        self.hub.add_listener(self._links_changed)
        self._links_changed()
        try:
            sock = _bind(self.host, self.port)
        except OSError:
            await self.hub.stop(0)
            raise
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            http="httptools",
            ws="none",
            loop="none",
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            proxy_headers=False,  # the Edge reads no client address: skip that middleware
            timeout_graceful_shutdown=math.ceil(self._grace),
        )
        server = self._server = _Server(config)
        self._serving = guarded_task(
            server.serve(sockets=[sock]), name="edge-openai-http", logger=logger
        )
        while not server.started:
            if self._serving.done():
                await self.hub.stop(0)
                self._serving.result()  # raises what stopped it
                raise OSError(f"the OpenAI API did not start on {self._listen}")
            await asyncio.sleep(0.005)
        logger.info(
            "edge serving the OpenAI API on %s (listen %s); nodes dial port %s",
            self.url,
            self._listen,
            self.hub_port,
        )

    async def stop(self) -> None:
        """Stop taking requests, let running ones finish (up to the grace), then the hub."""
        server, serving = self._server, self._serving
        if server is not None and serving is not None:
            server.should_exit = True
            try:
                await serving
            finally:
                self._server = self._serving = None
        if self._hub_started:
            self._hub_started = False
            await self.hub.stop(self._grace)
        self.dispatcher.close()

    def _links_changed(self) -> None:
        self.dispatcher.set_available(available_providers(self.hub.connected_providers()))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the OpenAI API: {exc}") from exc
    return sock
