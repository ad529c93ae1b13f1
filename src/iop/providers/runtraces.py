"""A run's span on its Node, when the Node traces (`iop.tracing`).

One span per run (kind CLIENT: the Node's call of its model server, the GenAI conventions'
inference span, named `chat served-name`), a child of the Edge's span of the run when the run
carries its `traceparent` (a new trace otherwise). Its context replaces the run's `traceparent`
before the adapter sees the run, so the model server's request names this span as its parent.
It holds the operation, the served model, the provider's adapter type as `gen_ai.provider.name`,
the server's address, the token counts and finish reason the upstream reported, the time to the
first chunk, and a failure's code.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from iop import tracing
from iop.wire import RunChunk, RunDone, RunEvent, RunFailed, RunRequest, RunUsage

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from .adapters import Upstream


class RunTrace:
    """The span of one run on this Node."""

    __slots__ = ("_began", "_first", "_span")

    def __init__(
        self, tracer: Tracer, request: RunRequest, adapter_type: str, upstream: Upstream | None
    ) -> None:
        from opentelemetry.trace import SpanKind

        operation = tracing.OPERATIONS.get(request.kind, request.kind)
        attributes: dict[str, str | int] = {
            tracing.OPERATION: operation,
            tracing.REQUEST_MODEL: request.served_model,
            tracing.RESPONSE_MODEL: request.served_model,
            tracing.PROVIDER_NAME: adapter_type,
            "iop.provider": request.provider_id,
            "iop.run_id": request.run_id,
        }
        if upstream is not None:
            url = urlsplit(upstream.base_url)
            attributes["server.address"] = url.hostname or ""
            attributes["server.port"] = url.port or (443 if url.scheme == "https" else 80)
        self._span: Span = tracer.start_span(
            f"{operation} {request.served_model}",
            context=tracing.parent_context(request.traceparent),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )
        self._began = time.perf_counter()
        self._first = False

    def request(self, request: RunRequest) -> RunRequest:
        """`request` as its adapter sends it: continuing this span."""
        return replace(request, traceparent=tracing.traceparent_of(self._span))

    def event(self, event: RunEvent) -> None:
        span = self._span
        if type(event) is RunChunk:
            if not self._first:
                self._first = True
                elapsed = round(time.perf_counter() - self._began, 6)
                span.set_attribute(tracing.TIME_TO_FIRST_TOKEN, elapsed)
        elif type(event) is RunUsage:
            span.set_attribute(tracing.INPUT_TOKENS, event.prompt_tokens)
            span.set_attribute(tracing.OUTPUT_TOKENS, event.completion_tokens)
        elif type(event) is RunDone:
            if event.finish_reason:
                span.set_attribute(tracing.RESPONSE_FINISH_REASONS, [event.finish_reason])
        elif type(event) is RunFailed:
            from opentelemetry.trace import Status, StatusCode

            span.set_attribute("error.type", event.code)
            if event.status:
                span.set_attribute("http.response.status_code", event.status)
            span.set_status(Status(StatusCode.ERROR, event.message[:200]))

    def end(self) -> None:
        self._span.end()
