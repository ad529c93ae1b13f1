"""One request's spans on the Edge (`iop.tracing`), when the Edge traces.

The request's span (kind SERVER, named as the GenAI conventions name an inference: `chat
llama-8b`) continues the client's `traceparent` and holds the conventions' attributes (the
operation, the requested and the answering model, the provider, token counts, the time to first
token, the finish reason) and the Edge's own (`iop.*`: principal, priority class, revision side,
retries). Its children say where the time went before the model server saw the request:
`iop.limits` (the principal's limits, when they refused the request or took 1 ms or more:
a shared store's round trip), one `iop.queue` per wait for a slot
that was not given at once (the model, the candidate given, the dispatch policy, how long), and
one `iop.run` (kind CLIENT) per try, from its start to the end of its run, with its provider, its
Node, its try number and why it was tried (a retry's failure, a fallback's reason), the dispatch
policy and its wait. The run's `traceparent` goes to the Node, whose
spans are its children (`providers/runtraces.py`), and on to the model server.

With tracing off nothing here is made: the request path tests `tracer() is None` once, and the
client's `traceparent`, if well formed, still travels to the model server unchanged. A request
whose trace is not sampled makes its one span (not recorded) and nothing more: its runs carry
that span's context, flagged not sampled, and the Node makes no span of them either.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from iop import tracing
from iop.wire import RunFailed, RunUsage

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

    from ..authenticating import Principal
    from ..bodies import ParsedRequest
    from .priorities import Priority
    from .slots import Lease


class RequestTrace:
    """The spans of one sampled request on this Edge (see the module's docstring)."""

    __slots__ = (
        "_arrived",
        "_attributes",
        "_run",
        "_span",
        "_tracer",
        "_tries",
        "_wait",
        "operation",
    )

    def __init__(self, tracer: Tracer, span: Span, arrived: float) -> None:
        self._tracer = tracer
        self._span = span
        self._arrived = arrived
        #: When the current wait for a slot began (`time.time_ns()`) and for which model.
        self._wait: tuple[int, str] | None = None
        self._run: Span | None = None
        self._tries = 0
        self.operation = ""
        #: The request span's attributes, set at its end in one call (each call takes a lock).
        self._attributes: dict[str, Any] = {}

    @classmethod
    def start(
        cls,
        tracer: Tracer,
        path: str,
        traceparent: str | None,
        tracestate: bytes | None,
        arrived: float,
    ) -> tuple[RequestTrace | None, str | None]:
        """A request's span, continuing the client's `traceparent`: its spans when the trace is
        sampled (None when not), and the `traceparent` its runs carry if not (the request's
        span, not sampled: the next hops do not sample it either, and make nothing of it;
        None when sampled: each run carries its own span's)."""
        from opentelemetry.trace import SpanKind

        state = tracestate.decode("latin-1") if tracestate else None
        span = tracer.start_span(
            f"POST {path}",
            context=tracing.parent_context(traceparent, state),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": path},
        )
        if not span.is_recording():
            return None, tracing.traceparent_of(span)
        return cls(tracer, span, arrived), None

    def request(
        self,
        kind: str,
        model: str,
        request: ParsedRequest,
        principal: Principal,
        priority: Priority,
    ) -> None:
        """The request was parsed and its model found."""
        self.operation = tracing.OPERATIONS.get(kind, kind)
        document = request.document
        max_tokens = document.get(
            "max_completion_tokens", document.get("max_tokens", document.get("max_output_tokens"))
        )
        self._span.update_name(f"{self.operation} {model}")
        attributes = self._attributes
        attributes[tracing.OPERATION] = self.operation
        attributes[tracing.REQUEST_MODEL] = model
        if isinstance(max_tokens, int):
            attributes[tracing.REQUEST_MAX_TOKENS] = max_tokens
        attributes["iop.principal"] = principal.principal_ref
        attributes["iop.priority_class"] = priority.class_name

    def _context(self) -> Context:
        """The context of the request's span, its children's parent."""
        from opentelemetry.trace import set_span_in_context

        return set_span_in_context(self._span)

    def waiting(self, model: str) -> None:
        """The request waits for a slot of `model` (a span is made if it had to wait)."""
        self._wait = (time.time_ns(), model)

    def leased(self, lease: Lease) -> None:
        """The wait ended with `lease`: an `iop.queue` span if the request waited at all."""
        wait, self._wait = self._wait, None
        if wait is None or lease.waited_s <= 0:
            return
        queue = self._wait_span(wait)
        queue.set_attribute("iop.provider", lease.provider_id)
        queue.set_attribute("iop.dispatch_policy", lease.pool_model.dispatch.policy)
        queue.set_attribute("iop.queue_wait_ms", round(lease.waited_s * 1000, 3))
        queue.end()

    def not_leased(self, error: BaseException) -> None:
        """The wait ended without a slot."""
        wait, self._wait = self._wait, None
        if wait is not None:
            queue = self._wait_span(wait)
            _fail(queue, error)
            queue.end()

    def _wait_span(self, wait: tuple[int, str]) -> Span:
        began, model = wait
        return self._tracer.start_span(
            "iop.queue",
            context=self._context(),
            attributes={tracing.REQUEST_MODEL: model},
            start_time=began,
        )

    def run_started(self, lease: Lease, model: str, why: str) -> str:
        """A try starts on `lease`: its span; the `traceparent` its run carries."""
        from opentelemetry.trace import SpanKind

        self._tries += 1
        run = self._run = self._tracer.start_span(
            "iop.run",
            context=self._context(),
            kind=SpanKind.CLIENT,
            attributes={
                tracing.REQUEST_MODEL: model,
                tracing.RESPONSE_MODEL: lease.served_model,
                "iop.provider": lease.provider_id,
                "iop.node": lease.node_id,
                "iop.try": self._tries,
                "iop.try_reason": why,
                "iop.dispatch_policy": lease.pool_model.dispatch.policy,
                "iop.queue_wait_ms": round(lease.waited_s * 1000, 3),
            },
        )
        return tracing.traceparent_of(run)

    def run_ended(self, failed: RunFailed | None = None) -> None:
        """The try's run ended (`failed`: before its first byte, how)."""
        run, self._run = self._run, None
        if run is None:
            return
        if failed is not None:
            from opentelemetry.trace import Status, StatusCode

            run.set_attribute("error.type", failed.code)
            run.set_status(Status(StatusCode.ERROR, failed.message[:200]))
        run.end()

    def answered_by(self, model: str, provider: str, served_model: str) -> None:
        attributes = self._attributes
        attributes[tracing.RESPONSE_MODEL] = served_model
        attributes["iop.model"] = model
        attributes["iop.provider"] = provider

    def limits(self, began: int, error: BaseException | None = None) -> None:
        """The principal's limits were checked from `began` (`time.time_ns()`) until now: their
        time on the request's span, and a span of their own when they refused it or took 1 ms
        or more (a shared store's round trip; the process's own counters take microseconds)."""
        ended = time.time_ns()
        self._attributes["iop.limits_ms"] = round((ended - began) / 1e6, 3)
        if error is None and ended - began < 1_000_000:
            return
        span = self._tracer.start_span("iop.limits", context=self._context(), start_time=began)
        if error is not None:
            _fail(span, error)
        span.end(end_time=ended)

    def first_token(self) -> None:
        elapsed = round(time.perf_counter() - self._arrived, 6)
        self._attributes[tracing.TIME_TO_FIRST_TOKEN] = elapsed

    def usage(self, usage: RunUsage) -> None:
        self._attributes[tracing.INPUT_TOKENS] = usage.prompt_tokens
        self._attributes[tracing.OUTPUT_TOKENS] = usage.completion_tokens

    def finished(self, reason: str | None) -> None:
        if reason:
            self._attributes[tracing.RESPONSE_FINISH_REASONS] = [reason]

    def end(self, status: int, error: BaseException | None = None, code: str = "") -> None:
        """The answer's status is known: every span still open ends."""
        if self._wait is not None:
            self.not_leased(error or RuntimeError("the request ended while waiting"))
        self.run_ended()
        span = self._span
        attributes = self._attributes
        attributes["http.response.status_code"] = status
        attributes["iop.tries"] = self._tries
        if status >= 400 or error is not None:
            attributes["error.type"] = code or str(status)
            if status >= 500 or status == 499:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, code or str(status)))
        span.set_attributes(attributes)
        span.end()


def _fail(span: Span, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", type(error).__name__)
    span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
