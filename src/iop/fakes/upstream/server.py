"""The fake upstream's server (`FakeUpstream`): its lifecycle, its routes, and its answers to
completions, embeddings and the Responses API, with the latency, speed and failures asked of it.

`GET /fake/stats` counts what it saw (clients gone mid-response too), `POST /fake/reset` starts
afresh; with `gpu` settings its completions are timed by a simulated GPU server (`gpuclock.py`)
and `GET /metrics` speaks vLLM's names.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, Final, Literal
from urllib.parse import unquote

import orjson

from iop.aiokits import AsyncService, stop_tasks

from ..answers import OpenAIError, embedding_response, error_body, parse_request, tokens
from ..responses import ResponseStore, parse_response_request
from ..simulating import GpuEngine
from .connection import Connection, Request
from .gpuclock import GpuClock
from .settings import (
    Delivery,
    FakeUpstreamSettings,
    delivery_of,
    hooked_latency,
    hooks,
    injected_fault,
)
from .stats import UpstreamStats
from .streaming import (
    CompletionStream,
    ResponseStream,
    completion_chunks,
    completion_end,
    send_whole,
    stream,
)

_CHAT: Final = b"/v1/chat/completions"
_COMPLETIONS: Final = b"/v1/completions"
_MODELS: Final = b"/v1/models"
_EMBEDDINGS: Final = b"/v1/embeddings"
_RESPONSES: Final = b"/v1/responses"


class FakeUpstream(AsyncService):
    """An OpenAI-compatible server with deterministic answers and injectable failures.

    `async with FakeUpstream(settings, port=0) as upstream:` serves on `upstream.base_url`.
    """

    def __init__(
        self,
        settings: FakeUpstreamSettings | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.settings = settings or FakeUpstreamSettings()
        self.stats = UpstreamStats()
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._connections: set[Connection] = set()
        self._random = random.Random(self.settings.seed)
        gpu = self.settings.gpu
        self._gpu = GpuClock(gpu) if gpu is not None else None
        #: The responses of `POST /v1/responses` it keeps (`previous_response_id`, retrieve).
        self.responses = ResponseStore()

    async def start(self) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self), self._host, self._port, backlog=1024
        )
        self._port = self._server.sockets[0].getsockname()[1]
        return self._port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        tasks = [c.task for c in self._connections if c.task is not None]
        if self._gpu is not None:
            tasks += self._gpu.detach()
        for connection in list(self._connections):
            connection.abort()
        await stop_tasks(tasks)
        await self._server.wait_closed()
        self._server = None

    def reset(self) -> None:
        """Start the counts afresh, and the simulated GPU server with an empty cache (call it
        while no request is in flight: `POST /fake/reset` refuses otherwise)."""
        self.stats = UpstreamStats()
        if self._gpu is not None:
            self._gpu.reset()

    @property
    def engine(self) -> GpuEngine | None:
        """The simulated GPU server, when completions are timed by one."""
        return self._gpu.engine if self._gpu is not None else None

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.address}/v1"

    # -- its connections (connection.Handler) ------------------------------------------------------

    def opened(self, connection: Connection) -> None:
        """A client connected (counted in `stats.connections`)."""
        self._connections.add(connection)
        self.stats.connections += 1

    def closed(self, connection: Connection) -> None:
        """A connection ended."""
        self._connections.discard(connection)

    def received(self, connection: Connection, request: Request, *, idle: bool) -> bool:
        """Note a request's trace context; answer it at once when the connection is `idle` and
        the request is a plain completion (True then)."""
        traceparent = request.headers.get(b"traceparent")
        if traceparent is not None:
            self.stats.saw_traceparent(traceparent)
        return idle and self._answer_at_once(connection, request)

    async def handle(self, connection: Connection, request: Request) -> None:
        """Answer a request by its path and method."""
        path = request.target.split(b"?", 1)[0]
        self.stats.requests += 1
        self.stats.saw_authorization(request.headers.get(b"authorization", b""))
        keep_alive = request.keep_alive
        if path in (_CHAT, _COMPLETIONS):
            if request.method != b"POST":
                self._refuse(connection, request, 405)
                return
            await self._complete(connection, request, "chat" if path == _CHAT else "completion")
            return
        if path == _EMBEDDINGS:
            if request.method != b"POST":
                self._refuse(connection, request, 405)
                return
            await self._embed(connection, request)
            return
        if path == _RESPONSES or path.startswith(_RESPONSES + b"/"):
            await self._responses(connection, request, path)
            return
        if path == b"/fake/reset" and request.method == b"POST":
            if self.stats.in_flight:
                message = f"{self.stats.in_flight} request(s) in flight: reset when idle"
                connection.write_response(409, error_body(message), keep_alive)
            else:
                self.reset()
                connection.write_response(200, b"{}", keep_alive)
            return
        if request.method != b"GET":
            self._refuse(connection, request, 404 if path != _MODELS else 405)
            return
        engine = self.engine
        if path == _MODELS:
            connection.write_response(200, self._models_document(), keep_alive)
        elif path.startswith(_MODELS + b"/"):
            model = path[len(_MODELS) + 1 :].decode("utf-8", "replace")
            if self.settings.models and model not in self._served:
                message = f"The model `{model}` does not exist or you do not have access to it."
                body = error_body(message, type="invalid_request_error", code="model_not_found")
                connection.write_response(404, body, keep_alive)
            else:
                connection.write_response(200, orjson.dumps(self._entry(model)), keep_alive)
        elif path == b"/health":
            connection.write_response(200, b"{}", keep_alive)
        elif path == b"/metrics" and engine is not None:
            connection.write_text(200, engine.metrics_text(self._base), keep_alive)
        elif path == b"/fake/stats":
            stats = asdict(self.stats)
            if engine is not None and engine.settings.max_loras:
                stats["adapter_loads"] = engine.adapter_loads
                stats["adapter_swaps"] = engine.adapter_swaps
            connection.write_response(200, orjson.dumps(stats), keep_alive)
        else:
            self._refuse(connection, request, 404)
            return
        self.stats.lookups += 1

    # -- requests --------------------------------------------------------------------------------

    def _answer_at_once(self, connection: Connection, request: Request) -> bool:
        """Answer a plain completion (no latency, pacing, failure or test hook) from the parser's
        callback; False leaves the request to `handle`.

        The usual benchmark request needs no waiting, and answering it here saves a task and a
        turn of the event loop per request: the baseline the Edge is measured against, and a
        process sharing the cores with it, should cost as little as the answer itself.
        """
        path = request.target.split(b"?", 1)[0]
        settings = self.settings
        if (
            request.method != b"POST"
            or path not in (_CHAT, _COMPLETIONS)
            or settings.latency_ms
            or settings.tokens_per_second
            or settings.fail_rate > 0
            or settings.gpu is not None
        ):
            return False
        try:
            completion = parse_request(
                "chat" if path == _CHAT else "completion",
                request.body,
                default_tokens=settings.completion_tokens,
                models=settings.models,
                now=int(time.time()),
            )
        except OpenAIError:
            return False
        if completion.overrides:
            return False
        self.stats.requests += 1
        self.stats.completions += 1
        if completion.stream:
            out = [connection.stream_head(request.keep_alive)]
            out += completion_chunks(completion, tokens(completion.completion_tokens), first=True)
            out += completion_end(completion)
            connection.write_now(b"".join(out))
        else:
            connection.write_response(200, completion.response(), request.keep_alive)
        self.stats.completed += 1
        return True

    async def _complete(
        self, connection: Connection, request: Request, kind: Literal["chat", "completion"]
    ) -> None:
        self.stats.completions += 1
        try:
            completion = parse_request(
                kind,
                request.body,
                default_tokens=self.settings.completion_tokens,
                models=self._served if self.settings.models else (),
                now=int(time.time()),
            )
        except OpenAIError as refusal:
            connection.write_response(refusal.status, refusal.body, request.keep_alive)
            self.stats.completed += 1
            return
        delivery = delivery_of(self.settings, completion.overrides, self._random)

        async def respond() -> None:
            if self._gpu is not None and delivery.fault is None:
                await self._gpu.answer(connection, request, completion)
            elif completion.stream:
                await stream(connection, request.keep_alive, CompletionStream(completion), delivery)
            else:
                whole = completion.response
                count = completion.completion_tokens
                await send_whole(connection, request.keep_alive, whole, count, delivery)

        await self._answer(connection, request, delivery, respond)

    async def _create_response(self, connection: Connection, request: Request) -> None:
        self.stats.completions += 1
        answer = parse_response_request(
            request.body,
            default_tokens=self.settings.completion_tokens,
            models=self.settings.models,
            now=int(time.time()),
            store=self.responses,
        )
        delivery = delivery_of(self.settings, answer.overrides, self._random)

        async def respond() -> None:
            if answer.stream:
                answering = ResponseStream(answer, self.responses)
                await stream(connection, request.keep_alive, answering, delivery)
                return
            count = answer.output_tokens
            sent = await send_whole(connection, request.keep_alive, answer.body, count, delivery)
            if sent and answer.store:
                self.responses.keep(answer.document())

        await self._answer(connection, request, delivery, respond)

    async def _answer(
        self,
        connection: Connection,
        request: Request,
        delivery: Delivery,
        respond: Callable[[], Awaitable[None]],
    ) -> None:
        """Answer a completion or a response, counted in flight: with the failure `delivery`
        injects, else by `respond()`; a client that leaves before the end counts as a
        disconnect."""
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        try:
            if delivery.fault is not None:
                stats.failures_injected += 1
            if delivery.fault == "drop":
                connection.abort()
                return
            if delivery.fault == "status":
                if delivery.latency:
                    await asyncio.sleep(delivery.latency)
                self._write_failure(connection, request, delivery.status)
            else:
                await respond()
            if delivery.fault is None or delivery.fault == "status":
                stats.completed += 1
        except asyncio.CancelledError:
            if connection.lost:
                stats.disconnects += 1
            raise
        except ConnectionResetError:
            stats.disconnects += 1
        finally:
            stats.in_flight -= 1

    async def _embed(self, connection: Connection, request: Request) -> None:
        """POST /v1/embeddings: deterministic vectors after `latency_ms` (or a failure)."""
        self.stats.embeddings += 1
        try:
            body, _ = embedding_response(request.body, models=self.settings.models)
        except OpenAIError as refusal:
            connection.write_response(refusal.status, refusal.body, request.keep_alive)
            return
        overrides = hooks(request.body)
        latency = hooked_latency(self.settings, overrides)
        fault, status = injected_fault(self.settings, overrides, self._random)
        if latency:
            await asyncio.sleep(latency)
        if fault is not None:
            self.stats.failures_injected += 1
        if fault == "drop":
            connection.abort()
        elif fault == "status":
            self._write_failure(connection, request, status)
        elif fault == "drop-mid-stream":
            connection.write_partial(200, body, request.keep_alive)
            connection.abort()
        else:
            connection.write_response(200, body, request.keep_alive)

    async def _responses(self, connection: Connection, request: Request, path: bytes) -> None:
        """`POST /v1/responses`, and a kept response's `GET`, `DELETE` and `POST .../cancel`."""
        keep_alive = request.keep_alive
        rest = path[len(_RESPONSES) + 1 :].decode("utf-8", "replace")
        method = request.method
        try:
            if not rest:
                if method != b"POST":
                    self._refuse(connection, request, 405)
                    return
                await self._create_response(connection, request)
                return
            response_id, _, action = rest.partition("/")
            response_id = unquote(response_id)
            store = self.responses
            if not action and method == b"GET":
                body = store.retrieve(response_id)
            elif not action and method == b"DELETE":
                body = store.delete(response_id)
            elif action == "cancel" and method == b"POST":
                body = store.cancel(response_id)
            else:
                self._refuse(connection, request, 404)
                return
        except OpenAIError as refusal:
            connection.write_response(refusal.status, refusal.body, keep_alive)
            return
        self.stats.lookups += 1
        connection.write_response(200, body, keep_alive)

    def _write_failure(self, connection: Connection, request: Request, status: int) -> None:
        """An injected error status, with OpenAI's body for a server error."""
        message = f"The server had an error while processing your request (HTTP {status})."
        connection.write_response(status, error_body(message), request.keep_alive)

    def _refuse(self, connection: Connection, request: Request, status: int) -> None:
        method = request.method.decode()
        target = request.target.decode("utf-8", "replace")
        body = error_body(f"Invalid URL ({method} {target})", type="invalid_request_error")
        connection.write_response(status, body, request.keep_alive)

    # -- the model list --------------------------------------------------------------------------

    def _model(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 1700000000, "owned_by": "iop-fake"}

    @property
    def _served(self) -> tuple[str, ...]:
        """The models served by name, the simulated server's LoRA adapters included."""
        gpu = self.settings.gpu
        return self.settings.models + (gpu.adapters if gpu is not None else ())

    @property
    def _base(self) -> str:
        return self.settings.models[0] if self.settings.models else "fake-model"

    def _entry(self, model_id: str) -> dict[str, Any]:
        """A /v1/models entry; an adapter's as vLLM's: its base model is its parent."""
        gpu = self.settings.gpu
        if gpu is not None and model_id in gpu.adapters:
            return self._model(model_id) | {"root": f"/adapters/{model_id}", "parent": self._base}
        return self._model(model_id)

    def _models_document(self) -> bytes:
        models = (self.settings.models or ("fake-model",)) + (
            self.settings.gpu.adapters if self.settings.gpu is not None else ()
        )
        return orjson.dumps({"object": "list", "data": [self._entry(m) for m in models]})
