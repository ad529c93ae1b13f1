"""The Edge's HTTP server: one app on one listening socket, with the limits of `http/caps.py`.

`HttpServer` serves an app (`async def app(exchange)`, `http/exchanges.py`) on a socket the
caller bound, on the running loop, through `http/connections.py`'s protocol: httptools' parser
and asyncio's transports, no ASGI layer and no framework (docs/benchmarks.md, "The OpenAI
listener without ASGI", has the figures that chose it). `stop()` stops accepting, closes the
idle connections, lets the requests in progress finish for up to `grace` seconds, then cancels
what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from .caps import HttpCaps, Refusals
from .connections import Connection, Handler, Listener

logger = logging.getLogger(__name__)

#: The listening socket's backlog (what uvicorn, the server before this one, used).
_BACKLOG = 2048


class HttpServer:
    """`app` on `sock` within `caps`; `await start()`, `await stop()`. `what` names the
    listener in its refusals and logs ("the OpenAI API")."""

    def __init__(
        self,
        app: Handler,
        sock: socket.socket,
        *,
        caps: HttpCaps,
        what: str,
        grace: float | None = None,
    ) -> None:
        self.refusals = Refusals(what, caps.fitted())
        self._listener = Listener(app, self.refusals)
        self._sock = sock
        self._grace = grace
        self._server: asyncio.Server | None = None

    @property
    def started(self) -> bool:
        return self._server is not None

    @property
    def open_connections(self) -> int:
        """Client connections open now (those over the cap, refused, not counted)."""
        return len(self._listener.connections)

    async def start(self) -> None:
        """Serve; returns once the socket accepts connections."""
        listener = self._listener
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Connection(listener), sock=self._sock, backlog=_BACKLOG
        )

    async def stop(self) -> None:
        """Stop accepting, let requests in progress finish (up to the grace), then return."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        listener = self._listener
        listener.closing = True
        for connection in list(listener.connections):
            connection.shutdown()
        loop = asyncio.get_running_loop()
        deadline = None if self._grace is None else loop.time() + self._grace
        while True:
            tasks = {c.task for c in listener.connections if c.task is not None}
            if not tasks:
                break
            timeout = None if deadline is None else deadline - loop.time()
            if timeout is not None and timeout <= 0:
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks)
                break
            await asyncio.wait(tasks, timeout=timeout)
        for connection in list(listener.connections):
            connection.abort()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 1.0)
