"""OpenTelemetry traces of IOP's processes: off unless configured the standard way.

A process turns tracing on with `configure(service_name)` at its start (`iop edge run`,
`iop node run`, `iop up`), which reads the OpenTelemetry SDK's own environment variables:
tracing is on when an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and neither `OTEL_SDK_DISABLED=true` nor
`OTEL_TRACES_EXPORTER=none` says otherwise; the sampler is `OTEL_TRACES_SAMPLER` and its
argument (parent-based, always on, by default; a Node follows the decision of the Edge that
sent the run), the service name `OTEL_SERVICE_NAME` if set, and
the spans go out over OTLP/gRPC in batches (`OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_*`). Off, nothing of
the SDK is imported, `tracer()` is None and the request path only tests that.

The W3C trace context crosses every hop as a `traceparent` string: the client's header on the
Edge, `RunRequest.traceparent` on the Node link, the header of the model server's request.
`valid_traceparent` checks one before it is trusted (a value that reaches an upstream's request
head must be nothing but the header's grammar). docs/edge.md, "Traces", has the spans and their
attributes.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

#: The header that carries the trace context (W3C Trace Context), and its companion.
TRACEPARENT: Final = b"traceparent"
TRACESTATE: Final = b"tracestate"
#: Version 00 of the header: version, trace id, parent span id, flags; all lowercase hex.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_ENDPOINTS: Final = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

# The GenAI semantic conventions' attribute names (OpenTelemetry semconv, gen-ai spans).
OPERATION: Final = "gen_ai.operation.name"
PROVIDER_NAME: Final = "gen_ai.provider.name"
REQUEST_MODEL: Final = "gen_ai.request.model"
REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
RESPONSE_MODEL: Final = "gen_ai.response.model"
RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
#: Seconds from the request to its first token: the convention's metric of that name, on the span.
TIME_TO_FIRST_TOKEN: Final = "gen_ai.server.time_to_first_token"
#: The operation of each run kind, as the conventions name them.
OPERATIONS: Final[Mapping[str, str]] = {
    "chat": "chat",
    "completion": "text_completion",
    "embedding": "embeddings",
}

_provider: TracerProvider | None = None
_tracer: Tracer | None = None
_propagator: TraceContextTextMapPropagator | None = None


def enabled_by(environ: Mapping[str, str]) -> bool:
    """Whether `environ` turns tracing on (see the module's docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return any(environ.get(name, "").strip() for name in _ENDPOINTS)


def configure(service_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on for this process if `environ` asks for it (named `service_name` unless
    `OTEL_SERVICE_NAME` names it); whether it is on. Call once, before serving."""
    global _provider, _tracer
    if _tracer is not None or not enabled_by(environ):
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": environ.get("OTEL_SERVICE_NAME") or service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _provider, _tracer = provider, provider.get_tracer("iop")
    endpoint = next(environ[name] for name in _ENDPOINTS if environ.get(name, "").strip())
    logger.info("tracing on: spans of %s go to %s over OTLP/gRPC", attributes, endpoint)
    return True


def tracer() -> Tracer | None:
    """The process's tracer; None while tracing is off."""
    return _tracer


def shutdown() -> None:
    """Send the spans still batched and turn tracing off (at the process's end)."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def valid_traceparent(value: bytes | str | None) -> str | None:
    """`value` if it is a well-formed version-00 `traceparent`, else None."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    return text if len(text) == 55 and _TRACEPARENT.fullmatch(text) else None


def parent_context(traceparent: str | None, tracestate: str | None = None) -> Context | None:
    """The context a span continues: the remote span `traceparent` names (None: a new trace)."""
    global _propagator
    if traceparent is None:
        return None
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = TraceContextTextMapPropagator()
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _propagator.extract(carrier)


def sampled(traceparent: str) -> bool:
    """Whether a well-formed `traceparent` says its trace is sampled."""
    return bool(int(traceparent[-2:], 16) & 1)


def traceparent_of(span: Span) -> str:
    """The `traceparent` that makes the next hop's spans children of `span` (sampled or not,
    so a trace the Edge did not sample is not sampled further on either)."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
