"""`FakeCollector`: an OpenTelemetry collector's trace receiver and nothing more, for tests and
demos (`iop fake-collector`).

The OTLP/gRPC TraceService on one port (where `OTEL_EXPORTER_OTLP_ENDPOINT` points the Edge and
the Nodes), and what it received as JSON on another: `GET /spans` (the latest `max_spans`, oldest
first, each with its service, name, kind, ids in lowercase hex as `traceparent` writes them, its
parent's id, attributes and status), `POST /reset`, `GET /healthz`. Nothing is forwarded or
stored beyond that window.
"""

from __future__ import annotations

import collections
from typing import Any

import grpc
import orjson
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as service
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as service_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

#: The span kinds by their OTLP numbers.
KINDS = {
    Span.SPAN_KIND_INTERNAL: "internal",
    Span.SPAN_KIND_SERVER: "server",
    Span.SPAN_KIND_CLIENT: "client",
    Span.SPAN_KIND_PRODUCER: "producer",
    Span.SPAN_KIND_CONSUMER: "consumer",
}
_STATUSES = ("unset", "ok", "error")


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, which) if which is not None else None


def spans_of(request: service.ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """The spans of one OTLP export, each as the collector's `GET /spans` lists it."""
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "service": str(resource.get("service.name", "")),
                        "name": span.name,
                        "kind": KINDS.get(span.kind, "unspecified"),
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "status": _STATUSES[span.status.code],
                    }
                )
    return spans


class _TraceService(service_grpc.TraceServiceServicer):
    def __init__(self, collector: FakeCollector) -> None:
        self._collector = collector

    async def Export(
        self, request: service.ExportTraceServiceRequest, context: Any
    ) -> service.ExportTraceServiceResponse:
        self._collector.take(spans_of(request))
        return service.ExportTraceServiceResponse()


class FakeCollector:
    """The receiver (`start` / `stop`); `spans` holds the latest `max_spans` it received."""

    def __init__(self, max_spans: int = 10_000) -> None:
        self.spans: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_spans)
        self.exports = 0
        #: Called after each export with the spans it brought (a test's wake-up).
        self.listeners: list[Any] = []
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None

    def take(self, spans: list[dict[str, Any]]) -> None:
        self.exports += 1
        self.spans.extend(spans)
        for listener in self.listeners:
            listener(spans)

    async def start(self, otlp_listen: str, http_listen: str | None = None) -> tuple[int, int]:
        """Listen for OTLP/gRPC on `otlp_listen` and, if given, serve the spans on
        `http_listen` (host:port, port 0 picks one); the two ports (0 for no HTTP)."""
        server = grpc.aio.server()
        service_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceService(self), server
        )
        otlp_port = server.add_insecure_port(otlp_listen)
        await server.start()
        self._grpc = server
        if http_listen is None:
            return otlp_port, 0
        app = web.Application()
        app.router.add_get("/spans", self._list)
        app.router.add_post("/reset", self._reset)
        app.router.add_get("/healthz", self._healthz)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        host, _, port = http_listen.rpartition(":")
        site = web.TCPSite(runner, host.strip("[]") or None, int(port))
        await site.start()
        self._http = runner
        return otlp_port, int(runner.addresses[0][1])

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        if self._grpc is not None:
            await self._grpc.stop(grace=None)
            self._grpc = None

    async def _list(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(list(self.spans)), content_type="application/json")

    async def _reset(self, request: web.Request) -> web.Response:
        self.spans.clear()
        return web.Response(body=b"{}", content_type="application/json")

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")
