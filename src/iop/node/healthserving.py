"""The Node's health endpoints, for its kubelet: `GET /healthz` and `GET /readyz`.

A Node serves no other HTTP: its work arrives over the connections it dials. Without a readiness
probe Kubernetes would call a new Node pod ready as soon as its process starts, before it has
dialled any Edge, and a rollout would stop the old pod while the new one serves nothing yet.

- `/healthz`: 200 while the process's event loop answers (a liveness probe: a frozen Node fails).
- `/readyz`: 200 once an Edge has welcomed this Node; 503 before that, while it drains and while
  a provider of its config cannot run on this Node (settings it cannot build, an API key variable
  unset or malformed here), with the reason as JSON (`NodeAgent.readiness`): a rollout whose
  config breaks the Node stops at its new pod. A model server that is down does not count.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from iop.aiokits.asgiserving import AsgiServer

logger = logging.getLogger(__name__)

#: `() -> (ready, reason)`: the Node's readiness as `/readyz` reports it.
Readiness = Callable[[], tuple[bool, str]]
Message = MutableMapping[str, Any]


class HealthServer:
    """`/healthz` and `/readyz` on `sock` (bound by the caller); `await start()`, `await stop()`."""

    def __init__(self, readiness: Readiness, sock: socket.socket) -> None:
        self._readiness = readiness
        self._sock = sock
        self._server = AsgiServer(
            self._app,
            sock,
            name="node-health",
            what="the health endpoints",
            interface="asgi3",  # a bound method: uvicorn's guess would take it for ASGI 2
        )

    @property
    def port(self) -> int:
        return self._server.port

    async def start(self) -> None:
        """Serve; returns once the socket accepts connections."""
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop()

    async def _app(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        path, method = scope["path"], scope["method"]
        body: dict[str, object]
        if path not in ("/healthz", "/readyz"):
            status, body = 404, {"error": f"no {path} here: /healthz and /readyz"}
        elif method not in ("GET", "HEAD"):
            status, body = 405, {"error": f"{path} answers GET"}
        elif path == "/healthz":
            status, body = 200, {"status": "ok"}
        else:
            ready, reason = self._readiness()
            status, body = (200 if ready else 503), {"ready": ready, "reason": reason}
        data = orjson.dumps(body)
        headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else data})
