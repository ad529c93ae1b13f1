"""The fake OpenAI-compatible upstream (`iop fake-upstream`): a small HTTP/1.1 server on asyncio and
httptools.

The upstream of the tests and the baseline of the benchmarks: faithful (OpenAI's paths, bodies,
SSE framing and error bodies), cheap, and failing on request (a body's `"fake_upstream"` hooks).
`GET /fake/stats` counts what it saw (clients gone mid-response too), `POST /fake/reset` starts
afresh; with `gpu` settings its completions are timed by a simulated GPU server
(`simulating.py`) and `GET /metrics` speaks vLLM's names. docs/architecture.md, "The fakes",
says how and why.
"""

from __future__ import annotations

import asyncio
import hashlib
import http
import itertools
import logging
import random
import socket
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final, Literal, TypeAlias, cast
from urllib.parse import unquote

import httptools
import orjson

from iop.aiokits import AsyncService, guarded_task, stop_tasks

from ..answers import (
    Completion,
    OpenAIError,
    embedding_response,
    error_body,
    parse_request,
    tokens,
)
from ..responses import ResponseAnswer, ResponseStore, parse_response_request
from ..simulating import GpuEngine, GpuSettings, render_answer, render_chat

logger = logging.getLogger(__name__)

#: How an injected failure shows: an error status, a connection dropped before the response,
#: or one dropped in the middle of a stream.
FailMode: TypeAlias = Literal["status", "drop", "drop-mid-stream"]
#: Every `FailMode`, for a command line's choices.
FAIL_MODES: Final = ("status", "drop", "drop-mid-stream")

_CHAT: Final = b"/v1/chat/completions"
_COMPLETIONS: Final = b"/v1/completions"
_MODELS: Final = b"/v1/models"
_EMBEDDINGS: Final = b"/v1/embeddings"
_RESPONSES: Final = b"/v1/responses"
_DONE: Final = b"data: [DONE]\n\n"
#: Most distinct bearer tokens `bearer_sha256` keeps.
_MAX_BEARERS: Final = 64
#: Most traceparent headers `UpstreamStats.traceparents` keeps.
_MAX_TRACEPARENTS: Final = 64


@dataclass(frozen=True, slots=True)
class FakeUpstreamSettings:
    """How the fake answers; every request can override latency, speed and failure."""

    latency_ms: float = 0.0
    tokens_per_second: float | None = None
    completion_tokens: int = 16
    models: tuple[str, ...] = ()
    fail_rate: float = 0.0
    fail_mode: FailMode = "status"
    error_status: int = 500
    seed: int | None = None
    #: Time completions by a simulated GPU server (None: latency and speed as above).
    gpu: GpuSettings | None = None


@dataclass(slots=True)
class UpstreamStats:
    """What the fake saw; `completions` counts the completion requests it received, however they
    were answered (so a test can count the tries of a gateway's retries), `completed` the
    completions answered, `embeddings` the embeddings requests received, `lookups` the GETs
    answered (the model list, `/health`, `/metrics`: what a Node's health probe asks),
    `disconnects` clients that left before their response ended, `connections` the connections
    it accepted (so a test can see a client's keep-alive pool), `peak_in_flight` the most
    completions it served at once (so a test can check a capacity), `bearer_sha256` the SHA-256
    of each bearer token it was sent, with how often (so a test can tell which key reached it, and
    never holds one), `traceparents` the trace context of the latest requests."""

    requests: int = 0
    completions: int = 0
    completed: int = 0
    embeddings: int = 0
    lookups: int = 0
    failures_injected: int = 0
    disconnects: int = 0
    in_flight: int = 0
    connections: int = 0
    peak_in_flight: int = 0
    bearer_sha256: dict[str, int] = field(default_factory=dict)
    #: The `traceparent` headers of the latest requests that had one (at most
    #: `_MAX_TRACEPARENTS`, oldest first), so a test can see a trace reach the model server.
    traceparents: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    method: bytes
    target: bytes
    body: bytes
    keep_alive: bool
    headers: dict[bytes, bytes] = field(default_factory=dict)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests and answers them one at a time, in order."""

    def __init__(self, server: FakeUpstream) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._pending: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self._lost = False
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self.responding = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server._connections.add(self)
        self._server.stats.connections += 1

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._write_response(400, error_body(f"malformed HTTP request: {exc}"), False)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._server._connections.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._wake_writer()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writer()

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        traceparent = self._headers.get(b"traceparent")
        if traceparent is not None:
            seen = self._server.stats.traceparents
            seen.append(traceparent.decode("latin-1"))
            del seen[:-_MAX_TRACEPARENTS]
        request = _Request(
            method=self._parser.get_method(),
            target=self._url,
            body=b"".join(self._body),
            keep_alive=self._parser.should_keep_alive(),
            headers=self._headers,
        )
        if self.task is None and not self._paused and self._server._answer_at_once(self, request):
            if not request.keep_alive:
                self.close()
            return
        self._pending.append(request)
        if self.task is None:
            self.task = guarded_task(self._serve(), name="fake-upstream-connection", logger=logger)

    # -- answering -----------------------------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while self._pending and not self._lost:
                request = self._pending.popleft()
                await self._server._handle(self, request)
                if not request.keep_alive:
                    self.close()
                    return
        finally:
            self.task = None

    @property
    def lost(self) -> bool:
        return self._lost

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection: the client sees it end with no (further) response."""
        if self._transport is not None:
            self._transport.abort()

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
        lines = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode())]
        lines += [name + b": " + value for name, value in headers]
        lines.append(b"connection: keep-alive" if keep_alive else b"connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def _write_response(self, status: int, body: bytes, keep_alive: bool) -> None:
        if self._transport is None or self._lost:
            return
        head = self._head(
            status,
            [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-request-id", b"req_iopfake"),
            ],
            keep_alive,
        )
        self._transport.write(head + body)

    def _write_text(self, status: int, body: bytes, keep_alive: bool) -> None:
        """A Prometheus text exposition (`/metrics`)."""
        if self._transport is None or self._lost:
            return
        head = self._head(
            status,
            [
                (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
            keep_alive,
        )
        self._transport.write(head + body)

    def write_partial(self, status: int, body: bytes, keep_alive: bool) -> None:
        """The head of a response and half its body (then the caller drops the connection)."""
        if self._transport is None or self._lost:
            return
        head = self._head(
            status,
            [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
            keep_alive,
        )
        self._transport.write(head + body[: len(body) // 2])

    def start_stream(self, keep_alive: bool) -> bytes:
        return self._head(
            200,
            [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"transfer-encoding", b"chunked"),
                (b"cache-control", b"no-cache"),
                (b"x-request-id", b"req_iopfake"),
            ],
            keep_alive,
        )

    def write_now(self, data: bytes) -> None:
        """Write without waiting for the client to drain (the caller checked it is not paused)."""
        if self._transport is not None and not self._lost:
            self._transport.write(data)

    async def write(self, data: bytes) -> None:
        if self._transport is None or self._lost:
            raise ConnectionResetError("the client went away")
        self._transport.write(data)
        while self._paused and not self._lost:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)


def _chunked(event: bytes) -> bytes:
    """One SSE event (`data: ...\\n\\n`) framed as one HTTP/1.1 chunk."""
    return b"%x\r\ndata: %s\n\n\r\n" % (len(event) + 8, event)


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
        self._connections: set[_Connection] = set()
        self._random = random.Random(self.settings.seed)
        gpu = self.settings.gpu
        #: The simulated GPU server, when completions are timed by one.
        self.engine = GpuEngine(gpu) if gpu is not None else None
        self._engine_task: asyncio.Task[None] | None = None
        self._engine_wake = asyncio.Event()
        #: Simulated request id -> where its tokens go (a count per step, -1 at its end).
        self._sims: dict[int, asyncio.Queue[int]] = {}
        #: The responses of `POST /v1/responses` it keeps (`previous_response_id`, retrieve).
        self.responses = ResponseStore()

    async def start(self) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self._host, self._port, backlog=1024
        )
        self._port = self._server.sockets[0].getsockname()[1]
        return self._port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        tasks = [c.task for c in self._connections if c.task is not None]
        if self._engine_task is not None:
            tasks.append(self._engine_task)
            self._engine_task = None
        for connection in list(self._connections):
            connection.abort()
        await stop_tasks(tasks)
        await self._server.wait_closed()
        self._server = None

    def reset(self) -> None:
        """Start the counts afresh, and the simulated GPU server with an empty cache (call it
        while no request is in flight: `POST /fake/reset` refuses otherwise)."""
        self.stats = UpstreamStats()
        if self.settings.gpu is not None:
            self.engine = GpuEngine(self.settings.gpu)
            self._engine_wake.set()

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

    # -- requests --------------------------------------------------------------------------------

    async def _handle(self, connection: _Connection, request: _Request) -> None:
        path = request.target.split(b"?", 1)[0]
        self.stats.requests += 1
        authorization = request.headers.get(b"authorization", b"")
        if authorization[:7].lower() == b"bearer ":
            digest = hashlib.sha256(authorization[7:].strip()).hexdigest()
            seen = self.stats.bearer_sha256
            if digest in seen or len(seen) < _MAX_BEARERS:
                seen[digest] = seen.get(digest, 0) + 1
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
                connection._write_response(409, error_body(message), keep_alive)
            else:
                self.reset()
                connection._write_response(200, b"{}", keep_alive)
            return
        if request.method != b"GET":
            self._refuse(connection, request, 404 if path != _MODELS else 405)
            return
        if path == _MODELS:
            connection._write_response(200, self._models_document(), keep_alive)
        elif path.startswith(_MODELS + b"/"):
            model = path[len(_MODELS) + 1 :].decode("utf-8", "replace")
            if self.settings.models and model not in self._served:
                message = f"The model `{model}` does not exist or you do not have access to it."
                body = error_body(message, type="invalid_request_error", code="model_not_found")
                connection._write_response(404, body, keep_alive)
            else:
                connection._write_response(200, orjson.dumps(self._entry(model)), keep_alive)
        elif path == b"/health":
            connection._write_response(200, b"{}", keep_alive)
        elif path == b"/metrics" and self.engine is not None:
            connection._write_text(200, self.engine.metrics_text(self._base), keep_alive)
        elif path == b"/fake/stats":
            stats = asdict(self.stats)
            if self.engine is not None and self.engine.settings.max_loras:
                stats["adapter_loads"] = self.engine.adapter_loads
                stats["adapter_swaps"] = self.engine.adapter_swaps
            connection._write_response(200, orjson.dumps(stats), keep_alive)
        else:
            self._refuse(connection, request, 404)
            return
        self.stats.lookups += 1

    def _answer_at_once(self, connection: _Connection, request: _Request) -> bool:
        """Answer a plain completion (no latency, pacing, failure or test hook) from the parser's
        callback; False leaves the request to `_handle`.

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
            out = [connection.start_stream(request.keep_alive)]
            out += _stream_chunks(completion, tokens(completion.completion_tokens), first=True)
            out += _stream_end(completion)
            connection.write_now(b"".join(out))
        else:
            connection._write_response(200, completion.response(), request.keep_alive)
        self.stats.completed += 1
        return True

    async def _embed(self, connection: _Connection, request: _Request) -> None:
        """POST /v1/embeddings: deterministic vectors after `latency_ms` (or a failure)."""
        self.stats.embeddings += 1
        try:
            body, _ = embedding_response(request.body, models=self.settings.models)
        except OpenAIError as refusal:
            connection._write_response(refusal.status, refusal.body, request.keep_alive)
            return
        overrides = _overrides(request.body)
        latency = float(overrides.get("latency_ms", self.settings.latency_ms)) / 1000
        fault, status = self._fault(overrides)
        if latency:
            await asyncio.sleep(latency)
        if fault is not None:
            self.stats.failures_injected += 1
        if fault == "drop":
            connection.abort()
        elif fault == "status":
            message = f"The server had an error while processing your request (HTTP {status})."
            connection._write_response(status, error_body(message), request.keep_alive)
        elif fault == "drop-mid-stream":
            connection.write_partial(200, body, request.keep_alive)
            connection.abort()
        else:
            connection._write_response(200, body, request.keep_alive)

    async def _responses(self, connection: _Connection, request: _Request, path: bytes) -> None:
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
            connection._write_response(refusal.status, refusal.body, keep_alive)
            return
        self.stats.lookups += 1
        connection._write_response(200, body, keep_alive)

    async def _create_response(self, connection: _Connection, request: _Request) -> None:
        self.stats.completions += 1
        answer = parse_response_request(
            request.body,
            default_tokens=self.settings.completion_tokens,
            models=self.settings.models,
            now=int(time.time()),
            store=self.responses,
        )
        overrides = answer.overrides
        latency = float(overrides.get("latency_ms", self.settings.latency_ms)) / 1000
        speed = overrides.get("tokens_per_second", self.settings.tokens_per_second)
        interval = 1 / float(speed) if speed else 0.0
        fault, status = self._fault(overrides)
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        try:
            if fault is not None:
                stats.failures_injected += 1
            if fault == "drop":
                connection.abort()
                return
            if fault == "status":
                if latency:
                    await asyncio.sleep(latency)
                message = f"The server had an error while processing your request (HTTP {status})."
                connection._write_response(status, error_body(message), request.keep_alive)
            elif answer.stream:
                await self._stream_response(connection, request, answer, latency, interval, fault)
            else:
                delay = latency + interval * answer.output_tokens
                if delay:
                    await asyncio.sleep(delay)
                body = answer.body()
                if fault == "drop-mid-stream":
                    connection.write_partial(200, body, request.keep_alive)
                    connection.abort()
                    return
                if answer.store:
                    self.responses.keep(answer.document())
                connection._write_response(200, body, request.keep_alive)
            if fault is None or fault == "status":
                stats.completed += 1
        except asyncio.CancelledError:
            if connection.lost:
                stats.disconnects += 1
            raise
        except ConnectionResetError:
            stats.disconnects += 1
        finally:
            stats.in_flight -= 1

    async def _stream_response(
        self,
        connection: _Connection,
        request: _Request,
        answer: ResponseAnswer,
        latency: float,
        interval: float,
        fault: FailMode | None,
    ) -> None:
        """The typed events of a streamed response; kept as in progress from its first event
        (so it can be retrieved or cancelled meanwhile), as it ended at its last."""
        loop = asyncio.get_running_loop()
        out = [connection.start_stream(request.keep_alive)]
        if latency:
            await connection.write(b"".join(out))
            out.clear()
            await asyncio.sleep(latency)
        if answer.store:
            self.responses.keep(answer.document(final=False))
        out += [_chunked_event(event) for event in answer.opening_events()]
        start = loop.time()
        drop_at = answer.output_tokens // 2 if fault == "drop-mid-stream" else -1
        for index, token in enumerate(tokens(answer.output_tokens)):
            if index == drop_at:
                await connection.write(b"".join(out))
                connection.abort()
                return
            if interval and index:
                await connection.write(b"".join(out))
                out.clear()
                await asyncio.sleep(max(0.0, start + index * interval - loop.time()))
            out += [_chunked_event(event) for event in answer.delta_events((token,), index)]
        out += [_chunked_event(event) for event in answer.closing_events()]
        out.append(b"0\r\n\r\n")
        if answer.store:
            cancelled = self.responses.status(answer.id) == "cancelled"
            if not cancelled:
                self.responses.keep(answer.document())
        await connection.write(b"".join(out))

    def _refuse(self, connection: _Connection, request: _Request, status: int) -> None:
        method = request.method.decode()
        target = request.target.decode("utf-8", "replace")
        body = error_body(f"Invalid URL ({method} {target})", type="invalid_request_error")
        connection._write_response(status, body, request.keep_alive)

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

    def _fault(self, overrides: dict[str, Any]) -> tuple[FailMode | None, int]:
        status = overrides.get("status", self.settings.error_status)
        status = status if isinstance(status, int) and 400 <= status <= 599 else 500
        mode = overrides.get("fail")
        if mode in FAIL_MODES:
            return mode, status
        if self.settings.fail_rate > 0 and self._random.random() < self.settings.fail_rate:
            return self.settings.fail_mode, status
        return None, status

    async def _complete(
        self, connection: _Connection, request: _Request, kind: Literal["chat", "completion"]
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
            connection._write_response(refusal.status, refusal.body, request.keep_alive)
            self.stats.completed += 1
            return
        overrides = completion.overrides
        latency = float(overrides.get("latency_ms", self.settings.latency_ms)) / 1000
        speed = overrides.get("tokens_per_second", self.settings.tokens_per_second)
        interval = 1 / float(speed) if speed else 0.0
        fault, status = self._fault(overrides)
        stats = self.stats
        stats.in_flight += 1
        stats.peak_in_flight = max(stats.peak_in_flight, stats.in_flight)
        try:
            if fault is not None:
                self.stats.failures_injected += 1
            if fault == "drop":
                connection.abort()
                return
            if fault == "status":
                if latency:
                    await asyncio.sleep(latency)
                message = f"The server had an error while processing your request (HTTP {status})."
                connection._write_response(status, error_body(message), request.keep_alive)
            elif self.engine is not None and fault is None:
                await self._simulate(connection, request, completion)
            elif completion.stream:
                await self._stream(connection, request, completion, latency, interval, fault)
            else:
                delay = latency + interval * completion.completion_tokens
                if delay:
                    await asyncio.sleep(delay)
                body = completion.response()
                if fault == "drop-mid-stream":
                    connection.write_partial(200, body, request.keep_alive)
                    connection.abort()
                else:
                    connection._write_response(200, body, request.keep_alive)
            if fault is None or fault == "status":
                self.stats.completed += 1
        except asyncio.CancelledError:
            if connection.lost:
                self.stats.disconnects += 1
            raise
        except ConnectionResetError:
            self.stats.disconnects += 1
        finally:
            self.stats.in_flight -= 1

    async def _simulate(
        self, connection: _Connection, request: _Request, completion: Completion
    ) -> None:
        """Answer as the simulated GPU server times it: the first token when its prefill is
        done, one more per engine step; the whole body at the end when it does not stream."""
        engine = self.engine
        assert engine is not None
        document = orjson.loads(request.body)
        if completion.kind == "chat":
            prompt = render_chat(document.get("messages") or [])
        else:
            raw = document.get("prompt")
            prompt = (raw if isinstance(raw, str) else orjson.dumps(raw).decode()).encode()
        text = "".join(tokens(completion.completion_tokens))
        adapter = completion.model if completion.model in engine.settings.adapters else None
        sim = engine.submit(prompt, completion.completion_tokens, render_answer(text), adapter)
        queue: asyncio.Queue[int] = asyncio.Queue()
        self._sims[sim.id] = queue
        self._engine_wake.set()
        if self._engine_task is None:
            self._engine_task = guarded_task(
                self._drive_engine(), name="fake-upstream-gpu", logger=logger
            )
        try:
            first = await queue.get()
            completion = replace(
                completion, prompt_tokens=sim.prompt_tokens, cached_tokens=sim.cached_tokens
            )
            words = tokens(completion.completion_tokens)
            if not completion.stream:
                while first != -1:
                    first = await queue.get()
                connection._write_response(200, completion.response(), request.keep_alive)
                return
            out = [connection.start_stream(request.keep_alive)]
            count = first
            while count != -1:
                out += _stream_chunks(
                    completion, itertools.islice(words, count), first=len(out) == 1
                )
                await connection.write(b"".join(out))
                out.clear()
                count = await queue.get()
            out += _stream_end(completion)
            await connection.write(b"".join(out))
        finally:
            self._sims.pop(sim.id, None)
            engine.cancel(sim)  # nothing once it is done; frees its cache when its client left

    async def _drive_engine(self) -> None:
        """The simulated server's clock: a step, its duration, then the tokens it gave.

        Steps end on a schedule (each one its duration after the one before), not a sleep after
        each: a process that wakes late, on a busy machine, catches up on its next steps, so
        the server keeps the speed it simulates, as a GPU does whatever its host's CPUs do.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            engine = self.engine
            assert engine is not None
            step = engine.step()
            if step is None:
                self._engine_wake.clear()
                await self._engine_wake.wait()
                deadline = loop.time()  # idle until now: the next step starts now
                continue
            deadline = max(deadline, loop.time() - step.duration_s) + step.duration_s
            await asyncio.sleep(deadline - loop.time())
            sims = self._sims
            for sim, count in step.tokens:
                queue = sims.get(sim.id)
                if queue is not None:
                    queue.put_nowait(count)
            for sim in step.finished:
                queue = sims.get(sim.id)
                if queue is not None:
                    queue.put_nowait(-1)

    async def _stream(
        self,
        connection: _Connection,
        request: _Request,
        completion: Completion,
        latency: float,
        interval: float,
        fault: FailMode | None,
    ) -> None:
        """Send SSE as OpenAI does; write only when about to wait, so bytes go out in bursts."""
        loop = asyncio.get_running_loop()
        out = [connection.start_stream(request.keep_alive)]
        if latency:
            await connection.write(b"".join(out))
            out.clear()
            await asyncio.sleep(latency)
        out += _stream_chunks(completion, (), first=True)
        start = loop.time()
        drop_at = completion.completion_tokens // 2 if fault == "drop-mid-stream" else -1
        for index, token in enumerate(tokens(completion.completion_tokens)):
            if index == drop_at:
                await connection.write(b"".join(out))
                connection.abort()
                return
            if interval and index:
                await connection.write(b"".join(out))
                out.clear()
                await asyncio.sleep(max(0.0, start + index * interval - loop.time()))
            out += _stream_chunks(completion, (token,))
        out += _stream_end(completion)
        await connection.write(b"".join(out))


def _chunked_event(event: bytes) -> bytes:
    """One whole SSE event (its `event:` and `data:` lines) as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(event), event)


def _stream_chunks(
    completion: Completion, words: Iterable[str], *, first: bool = False
) -> list[bytes]:
    """The HTTP chunks of a stream's token chunks (after its role chunk when `first`): one SSE
    event per HTTP chunk, as OpenAI and vLLM send them."""
    out = []
    if first and (role := completion.first_chunk()) is not None:
        out.append(_chunked(role))
    out += [_chunked(completion.token_chunk(word)) for word in words]
    return out


def _stream_end(completion: Completion) -> list[bytes]:
    """The finish chunk, the usage chunk when asked for, `[DONE]` and the end of the body."""
    out = [_chunked(completion.final_chunk())]
    usage = completion.usage_chunk()
    if usage is not None:
        out.append(_chunked(usage))
    out.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(_DONE), _DONE))
    return out


def _overrides(body: bytes) -> dict[str, Any]:
    """The test hooks of a request body (`fake_upstream`), or none."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    overrides = document.get("fake_upstream") if isinstance(document, dict) else None
    return overrides if isinstance(overrides, dict) else {}
