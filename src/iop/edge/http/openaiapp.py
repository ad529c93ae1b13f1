"""The OpenAI-compatible HTTP API, as a raw ASGI app (served by uvicorn with httptools).

`OpenAIApp` serves `/v1/models`, `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/healthz` and `/readyz` (docs/edge.md, "The API"). A completion goes: auth -> body (413 past
the limit, from its Content-Length or as it grows) -> JSON and field validation -> model lookup
-> generation policy and context class -> the limits (`Limiter`) -> `Relay` (slot, run,
events); every failure is an `EdgeError` rendered by `http/responses.py`. A client that
disconnects cancels the request's task, hence its run and its slot. A raw ASGI app because it
measured faster than aiohttp.web on this path (docs/benchmarks.md), and a framework would add a
layer per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Final

import orjson

from iop.aiokits import LogThrottle, guarded_task
from iop.wire import RunChunk, RunDone, RunFailed, RunKind

from ..authenticating import Authenticator, Principal
from ..bodies import BodyBounds, apply_policy, is_long, parse_request
from ..errors import (
    EdgeError,
    InternalError,
    MethodNotAllowed,
    ModelNotFound,
    PayloadTooLarge,
    ProviderFailed,
    RouteNotFound,
)
from ..hub import MAX_AWAITED_SHOWN, NodeRuns, Readiness, provider_health
from ..limits import NO_GRANT, Limiter
from ..pool import STABLE, Dispatcher, Metrics, PoolSnapshot, Relay, RelayedRun
from .asgi import Receive, Scope, Send, header, not_http, send_body
from .responses import error_event, provider_failed, send_error

logger = logging.getLogger(__name__)


_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE: Final = b"data: [DONE]\n\n"
_Headers = list[tuple[bytes, bytes]]
#: The status recorded for a request whose client went away before its answer.
_CLIENT_GONE: Final = 499

_COMPLETIONS: Final[dict[str, RunKind]] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
}


class _ClientGone(Exception):
    """The client disconnected while its body was being read."""


class OpenAIApp:
    """The ASGI application; one per Edge process, everything injected."""

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
        self._models_cache: tuple[PoolSnapshot, bytes, dict[str, bytes]] | None = None
        self._bugs = LogThrottle(logger)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await not_http(scope, receive, send):
            return
        try:
            await self._http(scope, receive, send)
        except Exception as exc:
            self._bugs.error(
                "a request to %s %s failed with a bug: %r",
                scope.get("method"),
                scope.get("path"),
                exc,
                exc_info=exc,
            )
            with contextlib.suppress(Exception):  # the answer may have begun already
                await self._refuse(send, InternalError("The server failed this request."))

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        completion = _COMPLETIONS.get(path)
        if completion is not None:
            if method == "POST":
                await self._completion(completion, scope, receive, send)
            else:
                await self._refuse(send, MethodNotAllowed(f"Use POST {path}.", "POST"))
            return
        if method not in ("GET", "HEAD"):
            if path in ("/v1/models", "/healthz", "/readyz") or path.startswith("/v1/models/"):
                await self._refuse(send, MethodNotAllowed(f"Use GET {path}.", "GET"))
            else:
                await self._refuse(send, RouteNotFound(f"Invalid URL ({method} {path})"))
            return
        if path == "/v1/models" or path.startswith("/v1/models/"):
            await self._models(scope, send, path)
        elif path == "/healthz":
            await send_body(send, 200, b'{"status":"ok"}')
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
            await send_body(send, 200 if readiness.ready else 503, orjson.dumps(answer))
        else:
            await self._refuse(send, RouteNotFound(f"Invalid URL ({method} {path})"))

    # -- the model catalog ---------------------------------------------------------------------

    async def _models(self, scope: Scope, send: Send, path: str) -> None:
        try:
            principal = self._authenticator.authenticate(header(scope, b"authorization"))
        except EdgeError as error:
            await self._refuse(send, error)
            return
        snapshot = self._dispatcher.snapshot
        cache = self._models_cache
        if cache is None or cache[0] is not snapshot:
            entries = {
                model_id: {
                    "id": model_id,
                    "object": "model",
                    "created": snapshot.created,
                    "owned_by": "iop-edge",
                }
                for model_id in snapshot.models
            }
            cache = self._models_cache = (
                snapshot,
                orjson.dumps({"object": "list", "data": list(entries.values())}),
                {model_id: orjson.dumps(entry) for model_id, entry in entries.items()},
            )
        if path == "/v1/models":
            await send_body(send, 200, cache[1])
            self._metrics.count_request(principal, "", "", 200)
            return
        model_id = path.removeprefix("/v1/models/")
        entry = cache[2].get(model_id)
        if entry is None:
            await self._refuse(send, ModelNotFound(model_id), principal)
        else:
            await send_body(send, 200, entry)
            self._metrics.count_request(principal, model_id, "", 200)

    # -- completions ---------------------------------------------------------------------------

    async def _completion(self, kind: RunKind, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.perf_counter()
        principal: Principal | None = None
        model = ""  # a metrics label: only ids of the catalog, never what a client made up
        provider = ""
        status = 200
        watcher: asyncio.Task[None] | None = None
        gone = _Disconnect()
        grant = NO_GRANT
        side = STABLE
        relayed: RelayedRun | None = None
        try:
            principal = self._authenticator.authenticate(header(scope, b"authorization"))
            raw = await self._read_body(scope, receive)
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
            apply_policy(request, pool_model.generation)
            long = is_long(request, snapshot.long_context_threshold_tokens)
            if self._limiter is not None:  # before the request takes a slot or a queue place
                grant = await self._limiter.admit(principal, model, request)
            task = asyncio.current_task()
            assert task is not None
            watcher = guarded_task(
                _watch(receive, task, gone),
                name=f"edge-http-disconnect-{id(task):x}",
                logger=logger,
            )
            relayed = self._relay.open(request, long, principal, side)
            async with relayed as run:
                provider = run.provider_id
                model = run.model_id  # a fallback's, when one took over
                if request.stream:
                    status = await self._stream(
                        run, send, arrived, model, request.include_usage, grant.headers
                    )
                else:
                    status = await self._respond(run, send, arrived, model, grant.headers)
                gone.finished = True
        except EdgeError as error:
            gone.finished = True  # what the watcher sees next is the end of this answer
            status = await self._refuse(send, error)
        except _ClientGone:
            status = _CLIENT_GONE
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if gone.seen and task is not None and task.uncancel() == 0:
                status = _CLIENT_GONE  # our own cancellation: the client left, nothing to send
            else:
                raise
        except Exception:
            status = 500  # a bug: __call__ logs it and answers 500
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
            grant.finish(relayed.spent if relayed is not None else None, status == 200)
            retried = relayed.retried_tries if relayed is not None else 0
            self._metrics.count_request(principal, model, provider, status, side, retried)
            self._metrics.observe_duration(model, time.perf_counter() - arrived, side)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self._max_request_bytes
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise PayloadTooLarge(_too_large(limit))
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise PayloadTooLarge(_too_large(limit))
            return body
        parts = [body]
        size = len(body)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(_too_large(limit))
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _respond(
        self, run: RelayedRun, send: Send, arrived: float, model: str, headers: _Headers
    ) -> int:
        """A non-streaming answer: the Node's one chunk is the whole body."""
        body = b""
        async for event in run:
            if isinstance(event, RunChunk):
                body = event.data
                self._metrics.observe_first_token(model, time.perf_counter() - arrived, run.side)
            elif isinstance(event, RunDone):
                await send_body(send, 200, body, headers=headers)
                return 200
            elif isinstance(event, RunFailed):
                return await self._refuse(send, provider_failed(event))
        return await self._refuse(send, _ended_early())

    async def _stream(
        self,
        run: RelayedRun,
        send: Send,
        arrived: float,
        model: str,
        include_usage: bool,
        headers: _Headers,
    ) -> int:
        """An SSE answer: one `data:` event per chunk object (a Node's chunk of whole events,
        `sse`, as it is), then `data: [DONE]`.

        The events that arrived while the previous write was under way go out in one write, as
        the wire's writers do: a stream the Edge keeps up with is written event by event, one it
        has fallen behind on catches up in fewer, larger writes, and nothing ever waits for
        company (one socket write per event was the largest cost of a stream on the Edge).
        """
        started = False
        start_headers = [*_SSE_HEADERS, *headers] if headers else _SSE_HEADERS
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
                        await send(
                            {"type": "http.response.start", "status": 200, "headers": start_headers}
                        )
                    parts.append(event.data if event.sse else b"data: " + event.data + b"\n\n")
                elif isinstance(event, RunDone):
                    if not started:
                        await send(
                            {"type": "http.response.start", "status": 200, "headers": start_headers}
                        )
                    parts.append(_DONE)
                    await send(
                        {"type": "http.response.body", "body": b"".join(parts), "more_body": False}
                    )
                    return 200
                elif isinstance(event, RunFailed):
                    error = provider_failed(event)
                    if not started:
                        return await self._refuse(send, error)
                    status, data = error_event(error)
                    parts.append(data)
                    await send(
                        {"type": "http.response.body", "body": b"".join(parts), "more_body": False}
                    )
                    return status
            if parts:
                await send(
                    {"type": "http.response.body", "body": b"".join(parts), "more_body": True}
                )
        if not started:
            return await self._refuse(send, _ended_early())
        status, data = error_event(_ended_early())
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return status

    async def _refuse(
        self, send: Send, error: EdgeError, principal: Principal | None = None
    ) -> int:
        status = await send_error(send, error)
        if principal is not None:
            self._metrics.count_request(principal, "", "", status)
        return status


class _Disconnect:
    __slots__ = ("finished", "seen")

    def __init__(self) -> None:
        self.seen = False
        self.finished = False


async def _watch(receive: Receive, task: asyncio.Task[Any], gone: _Disconnect) -> None:
    """Cancel `task` when its client disconnects (the body is read: only that can arrive)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not gone.finished:
                gone.seen = True
                task.cancel()
            return


def _ended_early() -> EdgeError:
    return ProviderFailed("The run ended without a result.", "incomplete_run", 502)


def _too_large(limit: int) -> str:
    return f"The request body is larger than the limit of {limit} bytes."
