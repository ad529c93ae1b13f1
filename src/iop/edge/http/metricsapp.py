"""The metrics listener's app: `GET /metrics` (Prometheus) and `GET /healthz`.

It serves what `metering.Metrics` renders, on a listener of its own (`edge.metrics.listen`),
never on the public OpenAI one: the metrics name every principal and token ref.
"""

from __future__ import annotations

from ..errors import MethodNotAllowed, RouteNotFound
from ..pool import CONTENT_TYPE, Metrics
from .exchanges import Exchange
from .responses import answer_error


class MetricsApp:
    """The app of the metrics listener: `GET /metrics` (Prometheus) and `GET /healthz`."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._content_type = CONTENT_TYPE.encode()

    async def __call__(self, exchange: Exchange) -> None:
        path = exchange.path
        if exchange.method not in ("GET", "HEAD"):
            answer_error(exchange, MethodNotAllowed("use GET", "GET", code="method_not_allowed"))
        elif path == "/metrics":
            exchange.respond(200, self._metrics.render(), self._content_type)
        elif path == "/healthz":
            exchange.respond(200, b'{"status":"ok"}')
        else:
            answer_error(exchange, RouteNotFound("no such path", code="not_found"))
