"""A real OTLP/gRPC trace receiver for the tests and benchmarks: the collector's TraceService on a
loopback port, keeping what the processes under test export.

The processes export with the OpenTelemetry SDK's own OTLP exporter, as they would to a
collector: `environment()` gives the variables that point them here (and export each batch
within 100 ms instead of the SDK's 5 s).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import grpc
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


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, its ids in lowercase hex as `traceparent` writes them."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)
    #: The status code's name: unset, ok or error.
    status: str = "unset"


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, which) if which is not None else None


class _Service(service_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    async def Export(
        self, request: service.ExportTraceServiceRequest, context: Any
    ) -> service.ExportTraceServiceResponse:
        self._receiver.take(request)
        return service.ExportTraceServiceResponse()


class OtlpReceiver:
    """`async with OtlpReceiver() as receiver:` a TraceService on 127.0.0.1; `spans` holds what
    arrived, `exports` counts the export calls."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._arrived = asyncio.Event()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self, **extra: str) -> dict[str, str]:
        """The variables that make an IOP process export its spans here."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            **extra,
        }

    def take(self, request: service.ExportTraceServiceRequest) -> None:
        self.exports += 1
        for resource_spans in request.resource_spans:
            names = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=str(names.get("service.name", "")),
                            name=span.name,
                            kind=KINDS.get(span.kind, "unspecified"),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status=("unset", "ok", "error")[span.status.code],
                        )
                    )
        self._arrived.set()

    async def wait_for(self, count: int, timeout: float = 20.0) -> list[ReceivedSpan]:
        """Until at least `count` spans arrived in all (TimeoutError after `timeout`)."""
        async with asyncio.timeout(timeout):
            while len(self.spans) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return self.spans

    async def __aenter__(self) -> Self:
        server = grpc.aio.server()
        service_grpc.add_TraceServiceServicer_to_server(_Service(self), server)  # type: ignore[no-untyped-call]
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
