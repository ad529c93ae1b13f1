"""The OpenAI-compatible HTTP API, as an app of the Edge's own HTTP server (`http/server.py`).

`OpenAIApp` serves `/v1/models`, `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/v1/responses` (a stored response's retrieve, delete and cancel: `http/storedresponses.py`),
`/healthz` and `/readyz` (docs/edge.md, "The API", "The Responses API"). A completion goes:
auth -> body (413 past the limit, from its Content-Length or as it grows) -> JSON and field
validation -> model lookup -> generation policy and context class -> the limits (`Limiter`) ->
`Relay` (slot, run, events); every failure is an `EdgeError` rendered by `http/responses.py`.
A client that disconnects cancels the request's task (through `Exchange.on_gone`), hence its
run and its slot. No framework and no ASGI: each measured as a layer per request on this path
(docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Final

import orjson

from iop import tracing
from iop.aiokits import LogThrottle
from iop.wire import RunChunk, RunDone, RunFailed, RunKind

from ..authenticating import Authenticator, Principal
from ..bodies import ParsedRequest, apply_policy, is_long, parse_request
from ..bodybounds import BodyBounds
from ..errors import (
    EdgeError,
    InternalError,
    MethodNotAllowed,
    ModelNotFound,
    PayloadTooLarge,
    RouteNotFound,
)
from ..hub import MAX_AWAITED_SHOWN, NodeRuns, Readiness, provider_health
from ..limits import NO_GRANT, Grant, Limiter
from ..pool import (
    CLASS_HEADER,
    MAX_WAIT_HEADER,
    STABLE,
    Dispatcher,
    Metrics,
    PoolSnapshot,
    Relay,
    RelayedRun,
    RequestTrace,
    ResponseHomes,
    answer_id,
    stream_id,
)
from .exchanges import CLIENT_GONE, ClientGone, Disconnect, Exchange
from .responses import answer_error, ended_early, error_event, provider_failed, typed_error_event
from .storedresponses import (
    STORED_RESPONSES,
    ResponseHolders,
    StoredResponseRoutes,
    failure_of,
)

logger = logging.getLogger(__name__)


_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE: Final = b"data: [DONE]\n\n"
_Headers = list[tuple[bytes, bytes]]
_HEALTHY: Final = b'{"status":"ok"}'

_COMPLETIONS: Final[dict[str, RunKind]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
    "/v1/responses": "response",
}


class OpenAIApp:
    """The OpenAI API's app (`await app(exchange)`); one per Edge process, everything
    injected."""

    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        hub: NodeRuns,
        authenticator: Authenticator,
        metrics: Metrics,
        max_request_bytes: int,
        ready: Callable[[], Readiness],
        limiter: Limiter | None = None,
        body_bounds: BodyBounds | None = None,
        response_homes: ResponseHomes | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self._limiter = limiter
        self._authenticator = authenticator
        self._metrics = metrics
        self._hub = hub
        self._relay = Relay(dispatcher, hub, metrics)
        self._max_request_bytes = max_request_bytes
        self._body_bounds = body_bounds or BodyBounds()
        self._ready = ready
        #: Which provider holds each stored response that passed through (the Responses API).
        self.response_homes = response_homes if response_homes is not None else ResponseHomes()
        self._holders = ResponseHolders(dispatcher, limiter, self.response_homes)
        self._stored_responses = StoredResponseRoutes(
            dispatcher=dispatcher,
            hub=hub,
            authenticator=authenticator,
            metrics=metrics,
            holders=self._holders,
            run_id=self._relay.next_run_id,
        )
        self._models_cache: tuple[PoolSnapshot, bytes, dict[str, bytes]] | None = None
        self._bugs = LogThrottle(logger)

    async def __call__(self, exchange: Exchange) -> None:
        try:
            await self._http(exchange)
        except Exception as exc:
            self._bugs.error(
                "a request to %s %s failed with a bug: %r",
                exchange.method,
                exchange.path,
                exc,
                exc_info=exc,
            )
            if not exchange.started:
                self._refuse(exchange, InternalError("The server failed this request."))

    async def _http(self, exchange: Exchange) -> None:
        path = exchange.path
        method = exchange.method
        completion = _COMPLETIONS.get(path)
        if completion is not None:
            if method == "POST":
                await self._completion(completion, exchange)
            else:
                self._refuse(exchange, MethodNotAllowed(f"Use POST {path}.", "POST"))
            return
        if path.startswith(STORED_RESPONSES):
            await self._stored_responses(exchange, path, method)
            return
        if method not in ("GET", "HEAD"):
            if path in ("/v1/models", "/healthz", "/readyz") or path.startswith("/v1/models/"):
                self._refuse(exchange, MethodNotAllowed(f"Use GET {path}.", "GET"))
            else:
                self._refuse(exchange, RouteNotFound(f"Invalid URL ({method} {path})"))
            return
        if path == "/v1/models" or path.startswith("/v1/models/"):
            self._models(exchange, path)
        elif path == "/healthz":
            exchange.respond(200, _HEALTHY)
        elif path == "/readyz":
            readiness = self._ready()
            snapshot = self._dispatcher.snapshot
            health = provider_health(
                {pid: limits.node_id for pid, limits in snapshot.providers.items()},
                self._hub.connected_providers(),
            )
            answer: dict[str, object] = {
                "status": "ready" if readiness.ready else "not ready",
                "config_generation": snapshot.generation,
                "providers_available": sorted(self._dispatcher.available),
                "providers": {
                    pid: {"healthy": link.healthy, "reason": link.reason}
                    for pid, link in health.items()
                },
            }
            if not readiness.ready and readiness.awaited:
                answer["waiting_for_nodes"] = list(readiness.awaited[:MAX_AWAITED_SHOWN])
                answer["waiting_for_nodes_count"] = len(readiness.awaited)
                answer["wait_left_s"] = round(readiness.wait_left, 1)
            exchange.respond(200 if readiness.ready else 503, orjson.dumps(answer))
        else:
            self._refuse(exchange, RouteNotFound(f"Invalid URL ({method} {path})"))

    # -- the model catalog ---------------------------------------------------------------------

    def _models(self, exchange: Exchange, path: str) -> None:
        try:
            principal = self._authenticator.authenticate(exchange.header(b"authorization"))
        except EdgeError as error:
            self._refuse(exchange, error)
            return
        snapshot = self._dispatcher.snapshot
        cache = self._models_cache
        if cache is None or cache[0] is not snapshot:
            entries: dict[str, dict[str, object]] = {
                model_id: {
                    "id": model_id,
                    "object": "model",
                    "created": snapshot.created,
                    "owned_by": "iop-edge",
                }
                for model_id in snapshot.models
            }
            for model_id, pool_model in snapshot.models.items():
                if pool_model.base_model is not None:
                    # A LoRA adapter, as vLLM lists one: its base model is its parent.
                    entries[model_id] |= {"root": model_id, "parent": pool_model.base_model}
            cache = self._models_cache = (
                snapshot,
                orjson.dumps({"object": "list", "data": list(entries.values())}),
                {model_id: orjson.dumps(entry) for model_id, entry in entries.items()},
            )
        if path == "/v1/models":
            exchange.respond(200, cache[1])
            self._metrics.count_request(principal, "", "", 200)
            return
        model_id = path.removeprefix("/v1/models/")
        entry = cache[2].get(model_id)
        if entry is None:
            self._refuse(exchange, ModelNotFound(model_id), principal)
        else:
            exchange.respond(200, entry)
            self._metrics.count_request(principal, model_id, "", 200)

    # -- completions ---------------------------------------------------------------------------

    async def _completion(self, kind: RunKind, exchange: Exchange) -> None:
        arrived = time.perf_counter()
        principal: Principal | None = None
        model = ""  # a metrics label: only ids of the catalog, never what a client made up
        provider = ""
        status = 200
        gone = Disconnect()
        grant = NO_GRANT
        side = STABLE
        relayed: RelayedRun | None = None
        trace: RequestTrace | None = None
        traceparent = tracing.valid_traceparent(exchange.header(tracing.TRACEPARENT))
        tracer = tracing.tracer()
        if tracer is not None:
            trace, traceparent = RequestTrace.start(
                tracer, exchange.path, traceparent, exchange.header(tracing.TRACESTATE), arrived
            )
        failure: BaseException | None = None
        try:
            principal = exchange.principal or self._authenticator.authenticate(
                exchange.header(b"authorization")
            )
            raw = await exchange.read_body(self._max_request_bytes, self._too_large)
            request = parse_request(kind, raw, self._body_bounds)
            dispatcher = self._dispatcher
            snapshot = dispatcher.snapshot
            split = dispatcher.split
            if split is not None:  # a change on trial: which revision serves this request
                side = split.side_of(request.model, request, principal.principal_ref)
            pool_model = dispatcher.model_view(request.model, side)
            if pool_model is None:
                raise ModelNotFound(request.model)
            model = pool_model.id
            home = ""
            if request.previous_response_id is not None:
                home, pool_model, side = await self._holders.continued(
                    request.previous_response_id, model, pool_model, side
                )
            apply_policy(request, pool_model.generation)
            long = is_long(request, snapshot.long_context_threshold_tokens)
            priority = snapshot.priorities.resolve(
                principal.principal_ref,
                model,
                exchange.header(CLASS_HEADER),
                exchange.header(MAX_WAIT_HEADER),
            )
            if trace is not None:
                trace.request(kind, model, request, principal, priority)
            if self._limiter is not None:  # before the request takes a slot or a queue place
                grant = await self._admit(principal, model, request, trace)
            gone.task = asyncio.current_task()
            exchange.on_gone(gone)
            relayed = self._relay.open(
                request, long, principal, side, priority, trace, traceparent, home
            )
            async with relayed as run:
                provider = run.provider_id
                model = run.model_id  # a fallback's, when one took over
                if trace is not None and run.lease is not None:
                    trace.answered_by(model, provider, run.lease.served_model)
                failed = functools.partial(
                    failure_of, continued=request.previous_response_id, provider=run.provider_id
                )
                if request.stream:
                    status = await self._stream(
                        run,
                        exchange,
                        arrived,
                        model,
                        request.include_usage,
                        grant.headers,
                        trace,
                        kind,
                        failed,
                    )
                else:
                    status = await self._respond(
                        run, exchange, arrived, model, grant.headers, trace, kind, failed
                    )
        except EdgeError as error:
            exchange.on_gone(None)  # what comes next is the end of this answer
            failure = error
            status = self._refuse(exchange, error)
        except ClientGone:
            status = CLIENT_GONE
        except asyncio.CancelledError:
            if not gone.cancelled_it():
                raise
            status = CLIENT_GONE  # our own cancellation: the client left, nothing to send
        except Exception as exc:
            status = 500  # a bug: __call__ logs it and answers 500
            failure = exc
            raise
        finally:
            if trace is not None:
                trace.end(status, failure)
            exchange.on_gone(None)
            grant.finish(relayed.spent if relayed is not None else None, status == 200)
            retried = relayed.retried_tries if relayed is not None else 0
            self._metrics.count_request(principal, model, provider, status, side, retried)
            self._metrics.observe_duration(model, time.perf_counter() - arrived, side)

    async def _respond(
        self,
        run: RelayedRun,
        exchange: Exchange,
        arrived: float,
        model: str,
        headers: _Headers,
        trace: RequestTrace | None,
        kind: RunKind = "chat",
        failed: Callable[[RunFailed], EdgeError] = provider_failed,
    ) -> int:
        """A non-streaming answer: the Node's one chunk is the whole body."""
        body = b""
        async for event in run:
            if isinstance(event, RunChunk):
                body = event.data
                self._metrics.observe_first_token(model, time.perf_counter() - arrived, run.side)
                if trace is not None:
                    trace.first_token()
            elif isinstance(event, RunDone):
                if kind == "response" and (response_id := answer_id(body)) is not None:
                    self._holders.record(response_id, run.provider_id, model)
                exchange.respond(200, body, headers=headers)
                if trace is not None:
                    trace.finished(event.finish_reason)
                return 200
            elif isinstance(event, RunFailed):
                return self._refuse(exchange, failed(event))
        return self._refuse(exchange, ended_early())

    async def _stream(
        self,
        run: RelayedRun,
        exchange: Exchange,
        arrived: float,
        model: str,
        include_usage: bool,
        headers: _Headers,
        trace: RequestTrace | None,
        kind: RunKind = "chat",
        failed: Callable[[RunFailed], EdgeError] = provider_failed,
    ) -> int:
        """An SSE answer: one `data:` event per chunk object (a Node's chunk of whole events,
        `sse`, as it is), then `data: [DONE]`; a Responses stream's typed events as they are,
        with no `[DONE]` (its last event ends it), its id recorded from its first.

        The events that arrived while the previous write was under way go out in one write, as
        the wire's writers do: a stream the Edge keeps up with is written event by event, one it
        has fallen behind on catches up in fewer, larger writes, and nothing ever waits for
        company (one socket write per event was the largest cost of a stream on the Edge).
        """
        started = False
        start_headers = [*_SSE_HEADERS, *headers] if headers else _SSE_HEADERS
        typed = kind == "response"
        done = b"" if typed else _DONE
        failure_event = typed_error_event if typed else error_event
        async for first in run:
            parts: list[bytes] = []
            for event in (first, *run.take_ready()):
                if isinstance(event, RunChunk):
                    if event.usage_only and not include_usage:
                        continue
                    if not started:
                        started = True
                        self._metrics.observe_first_token(
                            model, time.perf_counter() - arrived, run.side
                        )
                        if typed and (response_id := stream_id(event.data)) is not None:
                            self._holders.record(response_id, run.provider_id, model)
                        if trace is not None:
                            trace.first_token()
                        exchange.start(200, start_headers)
                    parts.append(event.data if event.sse else b"data: " + event.data + b"\n\n")
                elif isinstance(event, RunDone):
                    if not started:
                        exchange.start(200, start_headers)
                    if trace is not None:
                        trace.finished(event.finish_reason)
                    parts.append(done)
                    await exchange.end(b"".join(parts))
                    return 200
                elif isinstance(event, RunFailed):
                    error = failed(event)
                    if not started:
                        return self._refuse(exchange, error)
                    status, data = failure_event(error)
                    parts.append(data)
                    await exchange.end(b"".join(parts))
                    return status
            if parts:
                await exchange.write(b"".join(parts))
        if not started:
            return self._refuse(exchange, ended_early())
        status, data = failure_event(ended_early())
        await exchange.end(data)
        return status

    async def _admit(
        self, principal: Principal, model: str, request: ParsedRequest, trace: RequestTrace | None
    ) -> Grant:
        """The principal's limits for this request (`Limiter.admit`), in a span when traced."""
        assert self._limiter is not None
        if trace is None:
            return await self._limiter.admit(principal, model, request)
        began = time.time_ns()
        try:
            grant = await self._limiter.admit(principal, model, request)
        except BaseException as error:
            trace.limits(began, error)
            raise
        trace.limits(began)
        return grant

    def _too_large(self) -> PayloadTooLarge:
        limit = self._max_request_bytes
        return PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.")

    def _refuse(
        self, exchange: Exchange, error: EdgeError, principal: Principal | None = None
    ) -> int:
        status = answer_error(exchange, error)
        if principal is not None:
            self._metrics.count_request(principal, "", "", status)
        return status
