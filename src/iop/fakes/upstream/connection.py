"""One client connection of the fake upstream: HTTP/1.1 parsed by httptools on an asyncio protocol.

It parses requests and hands each to its `Handler` (the server), one at a time and in order, and
writes what the handler answers: a whole JSON or text response, a stream's head, a stream's
bytes (waiting while the client does not read), or half a response before the connection drops.
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, cast

import httptools

from iop.aiokits import guarded_task

from ..answers import error_body

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Request:
    """One parsed request (headers by lowercased name)."""

    method: bytes
    target: bytes
    body: bytes
    keep_alive: bool
    headers: dict[bytes, bytes] = field(default_factory=dict)


class Handler(Protocol):
    """What a connection's requests go to: the server, which also keeps its connections."""

    def opened(self, connection: Connection) -> None:
        """A client connected."""

    def closed(self, connection: Connection) -> None:
        """The connection ended, whichever side ended it."""

    def received(self, connection: Connection, request: Request, *, idle: bool) -> bool:
        """A request was parsed; True when it was answered at once (only when `idle`: nothing
        before it on this connection is being answered, and the client reads)."""

    async def handle(self, connection: Connection, request: Request) -> None:
        """Answer a request that `received` left (the connection answers them in order)."""


class Connection(asyncio.Protocol):
    """One client connection: parses requests and answers them one at a time, in order."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._pending: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self._lost = False
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._handler.opened(self)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.write_response(400, error_body(f"malformed HTTP request: {exc}"), False)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._handler.closed(self)
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
        request = Request(
            method=self._parser.get_method(),
            target=self._url,
            body=b"".join(self._body),
            keep_alive=self._parser.should_keep_alive(),
            headers=self._headers,
        )
        idle = self.task is None and not self._paused
        if self._handler.received(self, request, idle=idle):
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
                await self._handler.handle(self, request)
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

    def write_response(self, status: int, body: bytes, keep_alive: bool) -> None:
        """A whole JSON response."""
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"x-request-id", b"req_iopfake"),
        ]
        self._write_whole(status, headers, body, keep_alive)

    def write_text(self, status: int, body: bytes, keep_alive: bool) -> None:
        """A Prometheus text exposition (`/metrics`)."""
        headers = [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
            (b"content-length", b"%d" % len(body)),
        ]
        self._write_whole(status, headers, body, keep_alive)

    def write_partial(self, status: int, body: bytes, keep_alive: bool) -> None:
        """The head of a response and half its body (then the caller drops the connection)."""
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        self._write_whole(status, headers, body[: len(body) // 2], keep_alive)

    def _write_whole(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool
    ) -> None:
        if self._transport is not None and not self._lost:
            self._transport.write(self._head(status, headers, keep_alive) + body)

    def stream_head(self, keep_alive: bool) -> bytes:
        """The head of an SSE response (chunked), for the caller to write with its first bytes."""
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
        """Write, then wait while the client does not read; ConnectionResetError once it left."""
        if self._transport is None or self._lost:
            raise ConnectionResetError("the client went away")
        self._transport.write(data)
        while self._paused and not self._lost:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
