"""The metrics listener's app: `GET /metrics` (Prometheus) and `GET /healthz`.

It serves what `metering.Metrics` renders, on a listener of its own (`edge.metrics.listen`),
never on the public OpenAI one: the metrics name every principal and token ref.
"""

from __future__ import annotations

from ..errors import MethodNotAllowed, RouteNotFound
from ..pool import CONTENT_TYPE, Metrics
from .asgi import Receive, Scope, Send, not_http, send_body
from .responses import send_error


class MetricsApp:
    """The ASGI app of the metrics listener: `GET /metrics` (Prometheus) and `GET /healthz`."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._content_type = CONTENT_TYPE.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await not_http(scope, receive, send):
            return
        path: str = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            await send_error(send, MethodNotAllowed("use GET", "GET", code="method_not_allowed"))
        elif path == "/metrics":
            await send_body(send, 200, self._metrics.render(), self._content_type)
        elif path == "/healthz":
            await send_body(send, 200, b'{"status":"ok"}')
        else:
            await send_error(send, RouteNotFound("no such path", code="not_found"))
