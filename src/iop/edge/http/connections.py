"""One client connection of an Edge listener: HTTP/1.1 parsed by httptools, the caps enforced.

`Connection` is an asyncio protocol that parses requests with httptools' parser, hands each to
the listener's app as an `Exchange` (`http/exchanges.py`) in a task of its own, and writes the
answers. It enforces `http/caps.py` on the way in: the head bounded in bytes, headers and time
(431, 408), connections capped overall and per client address (503), a send timeout for a
client that reads nothing, OpenAI-shaped refusals of malformed framing, lingering closes. It
keeps a connection alive between requests (HTTP/1.1) for `KEEP_ALIVE_S`, queues pipelined
requests, pauses reading while an app has a body's worth unread, and ends an HTTP/1.0 stream with
the connection. docs/reliability.md, "The HTTP listeners", says what each bound does and why.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final, cast

import httptools

from ..authfailures import source_of
from ..errors import InternalError
from .caps import Refusals
from .exchanges import BODY_HIGH_WATER, Exchange, Headers
from .responses import answer_error

logger = logging.getLogger(__name__)

#: How long an idle keep-alive connection stays open for the client's next request.
KEEP_ALIVE_S: Final = 5.0
#: How long, and how many of, a refused connection's further bytes are read and dropped before
#: it is closed: closing with them unread would reset the connection and could destroy the
#: answer, while reading them forever would let the client keep the Edge busy.
_LINGER_S: Final = 1.0
_LINGER_BYTES: Final = 1024 * 1024

Handler = Callable[[Exchange], Awaitable[None]]

_STATUS_LINES: Final = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode())
    for status in HTTPStatus
}


class Listener:
    """What the connections of one listener share: the app, the caps and their refusals, the
    open connections (overall and per client address), the date header."""

    def __init__(self, handler: Handler, refusals: Refusals) -> None:
        self.handler = handler
        self.refusals = refusals
        self.caps = refusals.caps
        self.connections: set[Connection] = set()
        self.clients: dict[str, int] = {}
        #: Stopping: answers close their connections, idle ones are closed.
        self.closing = False
        self._date_at = 0
        self._date = b""

    def date(self) -> bytes:
        """The `date` header line, made once a second."""
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._date


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head the listener refuses."""


class Connection(asyncio.Protocol):
    """One client connection of `listener`; see the module docstring."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._caps = listener.caps
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._accepted = False  # counted in the listener's connections
        self._source = ""  # counted in `clients` under this key (when bounded per client)
        # The head being parsed.
        self._in_head = False
        self._head_bytes = 0  # bytes received while the head is incomplete (before parsing)
        self._head_size = 0  # bytes of the head parsed so far (url and headers)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._too_large = ""
        self._unsupported = ""
        self._expect_continue = False
        self._received = False
        # The requests.
        self._parsing: Exchange | None = None  # whose body the parser is reading
        self._active: Exchange | None = None  # whose answer is being written
        self._task: asyncio.Task[None] | None = None
        self._pipeline: collections.deque[Exchange] = collections.deque()
        self._reading_paused = False
        self.pending_head = b""  # a streamed answer's head, sent with its first part
        # Writing.
        self.write_paused = False
        self._drained: asyncio.Future[None] | None = None
        # Timers and refusals.
        self._lingering = False  # answered by the listener itself: what comes next is dropped
        self._dropped = 0
        # The head and idle timers are moved, not cancelled, from one request to the next: each
        # is armed once and, when it fires before its `_due`, armed again for then (a timer
        # made and cancelled per request cost more than the rest of a keep-alive turn's bounds).
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_due: float | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_due: float | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # bytes waiting in the transport when the send timer was armed

    # -- the connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass of it
        listener = self.listener
        refusals = listener.refusals
        if len(listener.connections) >= self._caps.max_connections:
            self._linger(refusals.too_many_connections(len(listener.connections)))
            return
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.client = (str(peer[0]), int(peer[1]))
        per_client = self._caps.max_connections_per_client
        if per_client:
            source = source_of(self.client[0]) if self.client else ""
            open_now = listener.clients.get(source, 0)
            if open_now >= per_client:
                self._linger(refusals.too_many_client_connections(source, open_now))
                return
            listener.clients[source] = open_now + 1
            self._source = source
        listener.connections.add(self)
        self._accepted = True
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)
        for exchange in (self._active, self._parsing, *self._pipeline):
            if exchange is not None:
                exchange.disconnected()
        self._pipeline.clear()
        if not self._accepted:
            return
        self._accepted = False
        listener = self.listener
        listener.connections.discard(self)
        if self._caps.max_connections_per_client:
            left = listener.clients[self._source] - 1
            if left:
                listener.clients[self._source] = left
            else:
                del listener.clients[self._source]

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # answered already: dropped, up to a bound
            self._dropped += len(data)
            if self._dropped > _LINGER_BYTES and self.transport is not None:
                self.transport.close()
            return
        self._received = True
        self._idle_due = None
        if self._in_head or self._parsing is None:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol upgrade is served; the request is answered as a plain one
        except httptools.HttpParserError as exc:
            refusals = self.listener.refusals
            if self._too_large:
                self._refuse(refusals.too_large(self._too_large))
            elif self._unsupported:
                self._refuse(refusals.unsupported(self._unsupported))
            else:
                self._refuse(refusals.malformed(_reason(exc)))
            return
        if self._in_head and self._head_bytes > self._caps.max_header_bytes:
            limit = self._caps.max_header_bytes
            self._refuse(self.listener.refusals.too_large(f"more than {limit} bytes"))

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._send_timer is None:
            self._arm_send_timer()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    # -- parser callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._head_size = 0
        self._url = b""
        self._headers = []
        self._expect_continue = False
        if self._head_due is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        if self._head_size > self._caps.max_header_bytes:
            self._stop(f"more than {self._caps.max_header_bytes} bytes")
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value)
        self._head_size += size
        caps = self._caps
        if size > caps.max_header_field_bytes:
            self._stop(f"one header has more than {caps.max_header_field_bytes} bytes")
        if len(self._headers) >= caps.max_headers:
            self._stop(f"more than {caps.max_headers} headers")
        if self._head_size > caps.max_header_bytes:
            self._stop(f"more than {caps.max_header_bytes} bytes")
        name = name.lower()
        if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
            # Any other coding (gzip, or a list: "gzip, chunked") would reach the app as a
            # body it cannot read.
            self._unsupported = (
                f"Transfer-Encoding {_shown(value)} is not supported; send the body with "
                "Content-Length or Transfer-Encoding: chunked"
            )
            raise _HeadRefused(self._unsupported)
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._head_due = None
        parser = self._parser
        version = parser.get_http_version()
        url = httptools.parse_url(self._url)
        path = url.path.decode("ascii", "replace")
        if "%" in path:
            path = urllib.parse.unquote(path)
        exchange = Exchange(
            self,
            parser.get_method().decode("ascii"),
            path,
            url.query or b"",
            self._headers,
            version,
            version != "1.0" and parser.should_keep_alive() and not self.listener.closing,
            self._expect_continue and version == "1.1",
        )
        self._parsing = exchange
        if self._active is None:
            self._begin(exchange)
        else:  # pipelined: answered in order, once the one before is
            self._pipeline.append(exchange)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self._parsing
        if exchange is None:
            return
        if exchange.body_received(body) > BODY_HIGH_WATER and not exchange.reading:
            self._pause_reading()

    def on_message_complete(self) -> None:
        exchange, self._parsing = self._parsing, None
        if exchange is None:
            return
        exchange.body_complete()
        if exchange is self._active and exchange.finished:
            self._next()

    # -- what an exchange asks of its connection -------------------------------------------------

    def want_body(self, exchange: Exchange) -> None:
        """`exchange`'s app waits for more of its body: read on."""
        if exchange is self._parsing:
            self._resume_reading()

    def head(self, status: int, headers: Headers, lines: bytes = b"") -> bytes:
        """An answer's head: its status line, the date, `lines` (header lines made already)
        and `headers`."""
        line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status
        if not headers:
            return line + self.listener.date() + lines + b"\r\n"
        parts = [line, self.listener.date(), lines]
        parts += [name + b": " + value + b"\r\n" for name, value in headers]
        parts.append(b"\r\n")
        return b"".join(parts)

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing() and not self._lingering:
            transport.write(data)

    def write_part(self, data: bytes) -> None:
        """A part of a streamed answer, after its head if that is still unsent."""
        head = self.pending_head
        if head:
            self.pending_head = b""
            data = head + data
        if data:
            self.write(data)

    async def drain(self) -> None:
        """Return once the client has taken enough of what was written (or is gone)."""
        if not self.write_paused or self.transport is None or self.transport.is_closing():
            return
        drained = self._drained
        if drained is None or drained.done():
            drained = self._drained = self._loop.create_future()
        await drained

    def answered(self, exchange: Exchange) -> None:
        """`exchange`'s answer is complete: close, or go on with the next request."""
        if exchange is not self._active:
            return
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not exchange.keep_alive:
            transport.close()
            return
        if not exchange.body_done:
            exchange.discarding = True  # answered before its body came: drop the rest
            self._resume_reading()
            self._arm_idle_timer()
            return
        self._next()

    # -- requests in order -----------------------------------------------------------------------

    def _begin(self, exchange: Exchange) -> None:
        self._active = exchange
        self._task = self._loop.create_task(self._serve(exchange))

    async def _serve(self, exchange: Exchange) -> None:
        try:
            await self.listener.handler(exchange)
        except asyncio.CancelledError:
            self._abandoned(exchange)
            raise
        except Exception as exc:
            logger.error("the app failed a request with a bug: %r", exc, exc_info=exc)
            self._abandoned(exchange)
            return
        if not exchange.finished and not exchange.gone:
            logger.error("the app returned without answering %s %s", exchange.method, exchange.path)
            self._abandoned(exchange)

    def _abandoned(self, exchange: Exchange) -> None:
        """The app left `exchange` unanswered: a 500 if nothing was sent, else the connection
        ends (the client sees the answer cut)."""
        if exchange.finished or exchange.gone:
            return
        if exchange.started or self.pending_head:
            exchange.finished = True
            if self.transport is not None:
                self.transport.close()
            return
        exchange.keep_alive = False
        answer_error(exchange, InternalError("The server failed this request."))

    def _next(self) -> None:
        """The active exchange is done, answer and body: the next queued one, or wait."""
        self._active = None
        self._task = None
        if self.listener.closing:
            if self.transport is not None:
                self.transport.close()
            return
        if self._pipeline:
            self._begin(self._pipeline.popleft())
            self._resume_reading()
        else:
            self._resume_reading()
            self._arm_idle_timer()

    def shutdown(self) -> None:
        """The listener stops: close now if idle, else once the answer in progress is done
        (which says `connection: close` if it has not begun)."""
        active = self._active
        if active is None and not self._in_head:
            if self.transport is not None:
                self.transport.close()
        elif active is not None and not active.started:
            active.keep_alive = False

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    @property
    def idle(self) -> bool:
        """No request in progress: the listener may close this connection when it stops."""
        return self._active is None and not self._in_head

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    # -- reading ---------------------------------------------------------------------------------

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and not self._pipeline and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()

    # -- timers and refusals ---------------------------------------------------------------------

    def _stop(self, what: str) -> None:
        self._too_large = what
        raise _HeadRefused(what)

    def _arm_idle_timer(self) -> None:
        if self._idle_due is None:
            self._idle_due = due = self._loop.time() + KEEP_ALIVE_S
            if self._idle_timer is None:
                self._idle_timer = self._loop.call_at(due, self._idle_timed_out)

    def _idle_timed_out(self) -> None:
        """No request began since the last answer (whose body may still be arriving, dropped)."""
        self._idle_timer = None
        due = self._idle_due
        if due is None:
            return  # a request came: the next answer arms it again
        if self._loop.time() < due:
            self._idle_timer = self._loop.call_at(due, self._idle_timed_out)
            return
        self._idle_due = None
        active = self._active
        if (active is None or active.finished) and not self._in_head and self.transport:
            self.transport.close()

    def _arm_head_timer(self) -> None:
        self._head_due = due = self._loop.time() + self._caps.header_timeout
        if self._head_timer is None:
            self._head_timer = self._loop.call_at(due, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        due = self._head_due
        if due is None:
            return  # the head came: the next request arms it again
        if self._loop.time() < due:
            self._head_timer = self._loop.call_at(due, self._head_timed_out)
            return
        self._head_due = None
        transport = self.transport
        if transport is None or transport.is_closing() or not (self._in_head or self.idle):
            return
        if self._received:
            self._refuse(self.listener.refusals.header_timeout())
        else:
            self.listener.refusals.idle_closed()
            transport.close()

    def _arm_send_timer(self) -> None:
        assert self.transport is not None
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self._loop.call_later(self._caps.send_timeout, self._send_checked)

    def _send_checked(self) -> None:
        """A send timeout passed with writing paused: cut the client unless it took some."""
        self._send_timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or not self.write_paused:
            return
        if transport.get_write_buffer_size() < self._unsent:
            self._arm_send_timer()  # slow, but reading
            return
        self.listener.refusals.send_timeout()
        transport.abort()

    def _refuse(self, answer: bytes) -> None:
        """The listener's own answer to what it refuses; none if an app's answer is under way
        (there is no room for another one)."""
        active = self._active
        if active is not None and not active.finished:
            if self.transport is not None:
                self.transport.close()
            return
        self._linger(answer)

    def _linger(self, answer: bytes) -> None:
        """Send `answer`, shut the write side, drop what still arrives, close in a moment."""
        transport = self.transport
        assert transport is not None
        self._lingering = True
        self._cancel_timers()
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._head_timer = self._loop.call_later(_LINGER_S, transport.close)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._idle_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._idle_timer = self._send_timer = None
        self._head_due = self._idle_due = None


def _reason(error: httptools.HttpParserError) -> str:
    """The parser's own words (never the client's bytes)."""
    text = str(error).strip() or type(error).__name__
    return text[:120]


def _shown(value: bytes) -> str:
    """A client's header value in a refusal: quoted, printable ASCII only, and short."""
    text = value.decode("ascii", "replace").strip()
    return repr("".join(c if c.isprintable() else "?" for c in text[:40]))
