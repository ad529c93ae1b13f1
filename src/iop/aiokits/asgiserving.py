"""One ASGI app served by uvicorn on a socket the caller bound, on the running event loop.

The Node's health endpoints run uvicorn this way (the Edge's listeners have a server of their
own, `iop.edge.http.server`): in a guarded task of the process's one loop, on a socket bound
before (`bind_listener`: a taken port fails at once), and without uvicorn's signal handlers,
since the process decides when it stops (`iop node run` drains first). `start()` returns once
the socket accepts connections; `stop()` lets the requests in progress finish, for at most
`grace` seconds when given.

uvicorn is the one import here beyond the standard library; nothing in `iop.aiokits` imports
this module, so the parts that serve no HTTP never load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Literal

import uvicorn

from .aiotasks import guarded_task
from .lifecycles import AsyncService

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process decides when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class AsgiServer(AsyncService):
    """`app` on `sock`; `await start()`, `await stop()` (or `async with`).

    `name` names the serving task, `what` the server in errors ("the health endpoints");
    `interface` what the app is when uvicorn cannot tell (a bound method looks like ASGI 2 to
    it).
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        sock: socket.socket,
        *,
        name: str,
        what: str,
        interface: Literal["auto", "asgi3"] = "auto",
        grace: float | None = None,
    ) -> None:
        options: dict[str, Any] = {}
        if grace is not None:
            options["timeout_graceful_shutdown"] = math.ceil(grace)
        config = uvicorn.Config(
            app,
            interface=interface,
            ws="none",
            loop="none",
            lifespan="off",
            access_log=False,
            log_config=None,
            server_header=False,
            proxy_headers=False,  # no app here reads a proxy's client address: skip that layer
            **options,
        )
        self._server = _Server(config)
        self._sock = sock
        self._name = name
        self._what = what
        self._serving: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def started(self) -> bool:
        return self._server.started

    @property
    def open_connections(self) -> int:
        """Client connections open now."""
        return len(self._server.server_state.connections)

    async def start(self) -> None:
        """Serve; returns once the socket accepts connections, raises what stopped it if not."""
        server = self._server
        serving = guarded_task(server.serve(sockets=[self._sock]), name=self._name, logger=logger)
        self._serving = serving
        while not server.started:
            if serving.done():
                serving.result()  # raises what stopped it
                raise OSError(f"{self._what} did not start")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop accepting, let requests in progress finish (up to the grace), then return."""
        serving, self._serving = self._serving, None
        if serving is None:
            return
        self._server.should_exit = True
        await serving
