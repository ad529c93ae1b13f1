"""The Edge's HTTP server: uvicorn with httptools, and the limits of `http/caps.py` enforced in it.

This module is the seam between the Edge and its HTTP server: `HttpServer` serves one raw ASGI
app on one socket. `_LimitedProtocol` is uvicorn's httptools protocol with what it lacks: the
head bounded in bytes, headers and time, connections capped overall and per address, a send
timeout, OpenAI-shaped refusals of malformed framing (`caps.Refusals`, throttled in the log),
lingering closes, and an HTTP/1.0 stream ended by the connection's end. A different server
(granian, say) would enforce the same `HttpCaps` its own way; nothing else in the Edge knows
which server runs. docs/reliability.md, "The HTTP listeners", says what each bound does and why.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from iop.aiokits.asgiserving import AsgiServer

from ..authfailures import source_of
from .asgi import Message
from .caps import HttpCaps, Refusals

logger = logging.getLogger(__name__)

#: How long, and how many of, a refused connection's further bytes are read and dropped before
#: it is closed: closing with them unread would reset the connection and could destroy the
#: answer, while reading them forever would let the client keep the Edge busy.
_LINGER_S = 1.0
_LINGER_BYTES = 1024 * 1024


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head the listener refuses."""


class _LimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `http/caps.py` (docs/reliability.md, "The
    HTTP listeners", says what each does).

    `refusals` is set on a subclass per server (`HttpServer` makes it).
    """

    refusals: ClassVar[Refusals]
    #: Connections open per client address (`authfailures.source_of`), per server.
    clients: ClassVar[dict[str, int]]

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._caps: HttpCaps = self.refusals.caps
        self._in_head = True
        self._head_bytes = 0  # bytes received while the head is incomplete (before parsing)
        self._head_size = 0  # bytes of the head parsed so far (url and headers)
        self._head_count = 0
        self._too_large = ""
        self._unsupported = ""
        self._received = False
        self._accepted = False  # counted in the server's connections
        self._client = ""  # counted in `clients` under this key (when bounded per client)
        self._lingering = False  # answered by the server itself: what comes next is dropped
        self._dropped = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the transport when the send timer was armed

    # -- connections -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self._caps.max_connections:
            self.transport = transport
            self._linger(self.refusals.too_many_connections(len(self.connections)))
            return
        per_client = self._caps.max_connections_per_client
        if per_client:
            peer = transport.get_extra_info("peername")
            client = source_of(peer[0]) if isinstance(peer, tuple) and peer else ""
            open_now = self.clients.get(client, 0)
            if open_now >= per_client:
                self.transport = transport
                self._linger(self.refusals.too_many_client_connections(client, open_now))
                return
            self.clients[client] = open_now + 1
            self._client = client
        super().connection_made(transport)
        self._accepted = True
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._accepted:
            if self._caps.max_connections_per_client:
                left = self.clients[self._client] - 1
                if left:
                    self.clients[self._client] = left
                else:
                    del self.clients[self._client]
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # answered already: dropped, up to a bound
            self._dropped += len(data)
            if self._dropped > _LINGER_BYTES:
                self.transport.close()
            return
        self._received = True
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol upgrade is served; the request is answered as a plain one
        except httptools.HttpParserError as exc:
            if self._too_large:
                self._answer_and_close(self.refusals.too_large(self._too_large))
            elif self._unsupported:
                self._answer_and_close(self.refusals.unsupported(self._unsupported))
            else:
                self._answer_and_close(self.refusals.malformed(_reason(exc)))
            return
        if self._in_head and self._head_bytes > self._caps.max_header_bytes:
            limit = self._caps.max_header_bytes
            self._answer_and_close(self.refusals.too_large(f"more than {limit} bytes"))

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._arm_send_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    # -- parser callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_size = 0
        self._head_count = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        if self._head_size > self._caps.max_header_bytes:
            self._stop(f"more than {self._caps.max_header_bytes} bytes")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        self._head_size += size
        self._head_count += 1
        limits = self._caps
        if size > limits.max_header_field_bytes:
            self._stop(f"one header has more than {limits.max_header_field_bytes} bytes")
        if self._head_count > limits.max_headers:
            self._stop(f"more than {limits.max_headers} headers")
        if self._head_size > limits.max_header_bytes:
            self._stop(f"more than {limits.max_header_bytes} bytes")
        if name.lower() == b"transfer-encoding" and value.strip().lower() != b"chunked":
            # Any other coding (gzip, or a list: "gzip, chunked") would reach the app as a
            # body it cannot read, and httptools answers some of them with no response at all.
            self._unsupported = (
                f"Transfer-Encoding {_shown(value)} is not supported; send the body with "
                "Content-Length or Transfer-Encoding: chunked"
            )
            raise _HeadRefused(self._unsupported)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        cycle = self.cycle
        if self.scope.get("http_version") == "1.0" and cycle is not None:
            _end_with_the_connection(cycle)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes = 0

    # -- internals -------------------------------------------------------------------------------

    def _stop(self, what: str) -> None:
        self._too_large = what
        raise _HeadRefused(what)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._caps.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head:
            return
        if self._received:
            self._answer_and_close(self.refusals.header_timeout())
        else:
            self.refusals.idle_closed()
            self.transport.close()

    def _arm_send_timer(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self._caps.send_timeout, self._send_checked)

    def _send_checked(self) -> None:
        """A send timeout passed with writing paused: cut the client unless it took some."""
        self._send_timer = None
        if self.transport.is_closing() or not self.flow.write_paused:
            return
        if self.transport.get_write_buffer_size() < self._unsent:
            self._arm_send_timer()  # slow, but reading
            return
        self.refusals.send_timeout()
        self.transport.abort()

    def _answer_and_close(self, answer: bytes) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self.transport.close()  # an answer is in progress: no room for another one
            return
        self._linger(answer)

    def _linger(self, answer: bytes) -> None:
        """Send `answer`, shut the write side, drop what still arrives, close in a moment."""
        self._lingering = True
        self._cancel_timers()
        transport = self.transport
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._head_timer = self.loop.call_later(_LINGER_S, transport.close)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._send_timer = None


def _reason(error: httptools.HttpParserError) -> str:
    """The parser's own words (never the client's bytes)."""
    text = str(error).strip() or type(error).__name__
    return text[:120]


def _shown(value: bytes) -> str:
    """A client's header value in a refusal: quoted, printable ASCII only, and short."""
    text = value.decode("ascii", "replace").strip()
    return repr("".join(c if c.isprintable() else "?" for c in text[:40]))


def _end_with_the_connection(cycle: RequestResponseCycle) -> None:
    """An HTTP/1.0 client cannot read chunked encoding: an answer without a length is sent as
    is, and the end of the connection ends it (what HTTP/1.0 defines)."""
    send = cycle.send
    raw = False

    async def send_delimited_by_close(message: Message) -> None:
        nonlocal raw
        kind = message["type"]
        if kind == "http.response.start" and not cycle.response_started:
            headers = list(message.get("headers", ()))
            if cycle.scope["method"] == "HEAD" or any(
                name.lower() == b"content-length" for name, _ in headers
            ):
                await send(message)  # type: ignore[arg-type]
                return
            raw = True
            cycle.response_started = True
            head = [STATUS_LINE[message["status"]]]
            head += [name + b": " + value + b"\r\n" for name, value in headers]
            head.append(b"connection: close\r\n\r\n")
            cycle.keep_alive = False
            cycle.transport.write(b"".join(head))
            return
        if not raw:
            await send(message)  # type: ignore[arg-type]
            return
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected or cycle.response_complete:
            return
        body = message.get("body", b"")
        if body:
            cycle.transport.write(body)
        if not message.get("more_body", False):
            cycle.response_complete = True
            cycle.message_event.set()
            cycle.transport.close()
            cycle.on_response()

    setattr(cycle, "send", send_delimited_by_close)  # noqa: B010 - shadows the bound method


class HttpServer:
    """One ASGI app on one listening socket, with `limits`; `await start()`, `await stop()`."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        sock: socket.socket,
        *,
        caps: HttpCaps,
        name: str,
        what: str,
        grace: float,
    ) -> None:
        self.refusals = Refusals(what, caps.fitted())
        protocol = type(
            "LimitedProtocol", (_LimitedProtocol,), {"refusals": self.refusals, "clients": {}}
        )
        self._server = AsgiServer(app, sock, name=name, what=what, http=protocol, grace=grace)

    @property
    def started(self) -> bool:
        return self._server.started

    @property
    def open_connections(self) -> int:
        """Client connections open now (those over the cap, refused, not counted)."""
        return self._server.open_connections

    async def start(self) -> None:
        """Serve; returns once the socket accepts connections."""
        await self._server.start()

    async def stop(self) -> None:
        """Stop accepting, let requests in progress finish (up to the grace), then return."""
        await self._server.stop()
