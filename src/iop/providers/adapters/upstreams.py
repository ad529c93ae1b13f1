"""A lean HTTP/1.1 client for one upstream: what the `openai` adapter sends a run with.

It does only the adapter's exchange, a POST of a JSON body to a path under its base URL whose
answer is read as it arrives, on httptools and the event loop's transports: a keep-alive pool
(`max_connections`, idle ones closed past `keepalive_s`), every wait bounded by a timer
(`PoolTimeout`, `ConnectTimeout`, `ConnectFailed`, `ReadTimeout`, `DeadlinePassed`), bodies by
length, chunked or to the connection's end, reads paused past `_HIGH_WATER` bytes, drops as
`Disconnected` and garbage as `BadResponse`; a response head past `MAX_HEAD_BYTES`,
`MAX_HEADERS` or `MAX_INTERIM` is refused before it is parsed further, and a connection that
speaks out of turn (bytes while idle, or after its answer) is closed, never reused. Given an
upstream policy, it resolves the host itself and dials only addresses the policy allows
(`NotAllowed` when there is none).
docs/architecture.md, "The HTTP client", has the rules; docs/benchmarks.md, "Candidate 3: the
HTTP layers", why it replaced aiohttp's client.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import time
from collections import deque
from typing import Final, cast
from urllib.parse import urlsplit

import httptools

from iop.edgeconfig import UpstreamPolicy

#: Bytes of an answer held for the caller before the socket is read no more.
_HIGH_WATER: Final = 256 * 1024
#: What a timer leaves in a waiter it expired.
_EXPIRED: Final = "expired"
#: Most bytes of an answer's heads (its status lines and headers, 1xx heads included) read
#: before it is refused: Envoy's default is 60 KiB, browsers' 256 KiB. Bytes past it are never
#: handed to httptools, which joins a header value's pieces by repeated concatenation.
MAX_HEAD_BYTES: Final = 64 * 1024
#: Most header lines of one head (Envoy's default, `max_headers_count`).
MAX_HEADERS: Final = 100
#: Most interim (1xx) answers before the final one.
MAX_INTERIM: Final = 10


class UpstreamError(Exception):
    """What an exchange with the upstream raised (the adapter maps each kind once)."""


class PoolTimeout(UpstreamError):
    """Every connection of the pool stayed busy for as long as a request may wait."""


class ConnectTimeout(UpstreamError):
    """The TCP (and TLS) connect took longer than the connect timeout."""


class ConnectFailed(UpstreamError):
    """The connect failed: `os_error` says why (refused, unreachable, a name not found)."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class NotAllowed(UpstreamError):
    """The upstream policy refuses every address the upstream's host resolved to."""


class ReadTimeout(UpstreamError):
    """The upstream sent nothing for the read timeout."""


class DeadlinePassed(UpstreamError):
    """The run's deadline passed during the exchange."""


class Disconnected(UpstreamError):
    """The connection dropped; `answered`: after the status line had arrived."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


class BadResponse(UpstreamError):
    """The upstream's answer is not HTTP/1.1 this client reads."""


class _OutOfTurn(Exception):
    """Bytes of an answer nobody asked for (raised inside httptools' callbacks)."""


def _head_bound() -> str:
    return f"{MAX_HEAD_BYTES} bytes (the HTTP client's bound, with its interim responses)"


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the answer being read on it."""

    def __init__(self, client: UpstreamClient) -> None:
        self._client = client
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.length: int | None = None
        self.answered = False
        self.complete = False
        self.keep_alive = False
        self.chunked = False
        self.parts: list[bytes] = []
        self.size = 0
        self.paused = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[object] | None = None
        #: When the wait under way expires (loop time). The connection's one timer is moved
        #: from wait to wait, not made and cancelled for each: when it fires early it is armed
        #: again for this.
        self.due = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        #: An exchange is under way and its answer has not ended: bytes are expected.
        self.expecting = False
        #: Bytes of the current answer's heads so far, header lines of its current head, and
        #: interim answers before it.
        self.head_bytes = 0
        self.headers = 0
        self.interim = 0

    def begin(self) -> None:
        """Ready for the next exchange (a pooled connection is reused)."""
        self.status, self.length, self.answered, self.complete = 0, None, False, False
        self.keep_alive, self.chunked = False, False
        self.parts, self.size = [], 0
        self.head_bytes, self.headers, self.interim = 0, 0, 0
        self.expecting = True

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport, so no isinstance).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.expecting:
            self._out_of_turn()
            return
        if self.answered:
            self._feed(data)
            return
        # The heads: only as many bytes as the bound leaves are parsed, and what follows the
        # final head (the body's first bytes) once it has arrived.
        room = MAX_HEAD_BYTES - self.head_bytes
        if len(data) <= room:
            self.head_bytes += len(data)
            self._feed(data)
            return
        self.head_bytes = MAX_HEAD_BYTES
        if self._feed(data[:room]):
            self._feed(data[room:])
        elif not self.closed:
            self.fail(BadResponse(f"the upstream's response head is larger than {_head_bound()}"))

    def _feed(self, data: bytes) -> bool:
        """Parse `data`; whether the answer's final head has arrived and the connection is
        still open."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.fail(BadResponse("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _OutOfTurn):
                self._out_of_turn()
            elif isinstance(exc.__context__, BadResponse):
                self.fail(exc.__context__)
            elif not self.expecting:  # garbage after the answer's end
                self._out_of_turn()
            else:
                self.fail(BadResponse(f"the upstream's answer is not HTTP/1.1 ({exc})"))
        return self.answered and not self.closed

    def _out_of_turn(self) -> None:
        """The upstream sent what nobody asked for: the connection is never used again (the
        answer already read, if any, stands)."""
        self.keep_alive = False
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if self.answered and not self.complete and self.length is None and not self.chunked:
            self.complete, self.expecting = True, False  # a body delimited by the connection's end
            self._wake()
        elif not self.complete or self.waiter is not None:
            when = "mid-response" if self.answered else "before it answered"
            reason = f": {exc}" if exc else ""
            self.fail(
                Disconnected(
                    f"the upstream closed the connection {when}{reason}", answered=self.answered
                )
            )
        self._client._lost(self)

    # -- httptools' callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self.expecting:
            raise _OutOfTurn
        self.headers = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers += 1
        if self.headers > MAX_HEADERS:
            raise BadResponse(f"the upstream's response head has more than {MAX_HEADERS} headers")
        name = name.lower()
        if name == b"content-length":
            self.length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            self.chunked = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 100:
            raise BadResponse(f"the upstream answered status {self.status:03d}, not HTTP's")
        if self.status < 200:  # 1xx: informational, the answer follows
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise BadResponse(
                    f"the upstream sent more than {MAX_INTERIM} interim (1xx) responses"
                )
            self.length, self.chunked = None, False
            return
        self.answered = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)
        self.size += len(body)
        if self.size > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.answered:
            return  # the end of a 1xx
        self.complete = True
        self.expecting = False
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # -- the connection's side of an exchange ----------------------------------------------------

    def take(self) -> bytes:
        """The bytes of the answer that arrived and were not taken yet."""
        parts = self.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.parts, self.size = [], 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.close()
        self._wake()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self._stop_timer()

    def watch(self, waiter: asyncio.Future[object], due: float) -> None:
        """`waiter` waits for news until `due` (loop time), then gets `_EXPIRED`."""
        self.waiter = waiter
        self.due = due
        timer = self._timer
        if timer is None or due < self._timer_at:
            if timer is not None:
                timer.cancel()
            self._timer = asyncio.get_running_loop().call_at(due, self._timed_out)
            self._timer_at = due

    def _timed_out(self) -> None:
        self._timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # no wait under way: the next one arms the timer anew
        loop = asyncio.get_running_loop()
        if loop.time() < self.due:
            self._timer = loop.call_at(self.due, self._timed_out)
            self._timer_at = self.due
            return
        waiter.set_result(_EXPIRED)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Response:
    """An answer being read: its status, its Content-Length (if any), its body in pieces."""

    __slots__ = ("_client", "_connection", "_deadline", "_done", "content_length", "status")

    def __init__(
        self, client: UpstreamClient, connection: _Connection, deadline: float | None
    ) -> None:
        self._client = client
        self._connection = connection
        self._deadline = deadline
        self._done = False
        self.status = connection.status
        self.content_length = connection.length

    async def read_some(self) -> bytes:
        """What arrived of the body since the last call, waiting for something; b"" at its end
        (the connection then goes back to the pool)."""
        if self._done:
            return b""  # its connection may serve another exchange by now
        connection = self._connection
        while True:
            if connection.parts:
                return connection.take()
            if connection.error is not None:
                raise connection.error
            if connection.complete:
                self._finish()
                return b""
            await self._client._wait(connection, self._deadline)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._client._release(self._connection)

    def close(self) -> None:
        """Done with the answer: a connection whose answer was not read to its end is closed
        (whatever is left of it is never read)."""
        if not self._done:
            self._done = True
            connection = self._connection
            if connection.complete and not connection.parts and connection.error is None:
                self._client._release(connection)
            else:
                self._client._discard(connection)


class UpstreamClient:
    """POSTs to one upstream over a pool of keep-alive HTTP/1.1 connections."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
        keepalive_s: float,
        policy: UpstreamPolicy | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        #: Checked against every address the host resolves to, before a connection is made.
        self._policy = policy
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        default = parts.port is None
        host = self._host if ":" not in self._host else f"[{self._host}]"
        authority = host if default else f"{host}:{self._port}"
        lines = [f"host: {authority}", *(f"{k}: {v}" for k, v in headers.items())]
        self._head = ("\r\n".join(lines) + "\r\ncontent-length: ").encode("latin-1")
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None
        self._limit = max_connections
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._keepalive = keepalive_s
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        #: Connects under way (they count toward the limit).
        self._connecting = 0
        self._waiters: deque[asyncio.Future[_Connection | None]] = deque()
        self.closed = False

    async def post(
        self, path: str, body: bytes, deadline: float | None = None, head: bytes = b""
    ) -> Response:
        """Send `body` to `path` (under the base URL's path) and wait for the status line;
        `deadline` (Unix time) bounds the whole exchange, reads of the body included. `head`:
        header lines of this request only (each ending in CRLF, checked by the caller)."""
        loop = asyncio.get_running_loop()
        due = None if deadline is None else loop.time() + (deadline - time.time())
        connection = await self._acquire(due)
        try:
            connection.begin()
            assert connection.transport is not None
            request = b"POST %s HTTP/1.1\r\n%s%s%d\r\n\r\n" % (
                (self._prefix + path).encode("latin-1"),
                head,
                self._head,
                len(body),
            )
            connection.transport.writelines((request, body))
            while not connection.answered:
                if connection.error is not None:
                    raise connection.error
                await self._wait(connection, due)
        except BaseException:
            self._discard(connection)
            raise
        return Response(self, connection, due)

    async def aclose(self) -> None:
        """Close every connection; waiters for one fail at once."""
        self.closed = True
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolTimeout("the client is closed"))

    # -- the pool --------------------------------------------------------------------------------

    async def _acquire(self, due: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle
        while idle:
            connection = idle.pop()
            if not connection.closed and loop.time() - connection.idle_since < self._keepalive:
                return connection
            self._discard(connection)
        if len(self._open) + self._connecting < self._limit:
            return await self._connect(due)
        waiter: asyncio.Future[_Connection | None] = loop.create_future()
        self._waiters.append(waiter)
        limit, by_deadline = self._bound(loop.time() + self._read_timeout, due)
        timer = loop.call_at(limit, _fail_waiter, waiter, by_deadline)
        try:
            handed = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                given = waiter.result()
                if given is not None:
                    self._release(given)
                else:
                    self._pass_on()
            raise
        finally:
            timer.cancel()
            if not waiter.done():
                waiter.cancel()
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass
        if handed is None:  # a connection closed: its place is this run's
            return await self._connect(due)
        return handed

    def _bound(self, limit: float, due: float | None) -> tuple[float, bool]:
        if due is not None and due <= limit:
            return due, True
        return limit, False

    async def _connect(self, due: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        self._connecting += 1
        limit, by_deadline = self._bound(loop.time() + self._connect_timeout, due)
        try:
            async with asyncio.timeout_at(limit):
                connection = await self._dial(loop)
        except TimeoutError:
            self._pass_on()
            if by_deadline:
                raise DeadlinePassed("the run's deadline passed") from None
            raise ConnectTimeout(f"no connection within {self._connect_timeout:g}s") from None
        except OSError as exc:
            self._pass_on()
            raise ConnectFailed(exc) from None
        except BaseException:
            self._pass_on()
            raise
        finally:
            self._connecting -= 1
        self._open.add(connection)
        return connection

    async def _dial(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        """A connection to the upstream; with a policy, to an address of its host that the
        policy allows (resolved here, so the address checked is the address dialled)."""
        server_hostname = self._host if self._tls else None
        hosts = [self._host] if self._policy is None else await self._allowed_addresses(loop)
        failed: OSError | None = None
        for host in hosts:
            try:
                _, connection = await loop.create_connection(
                    lambda: _Connection(self),
                    host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=server_hostname,
                )
            except OSError as exc:
                failed = exc
                continue
            return connection
        assert failed is not None
        raise failed

    async def _allowed_addresses(self, loop: asyncio.AbstractEventLoop) -> list[str]:
        policy = self._policy
        assert policy is not None
        infos = await loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        allowed: dict[str, None] = {}
        refused = ""
        for *_, sockaddr in infos:
            text = str(sockaddr[0]).split("%", 1)[0]
            address = ipaddress.ip_address(text)
            problem = policy.address_problem(self._host.rstrip("."), self._port, address)
            if problem is None:
                allowed[text] = None
            else:
                refused = refused or problem
        if not allowed:
            raise NotAllowed(refused or f"{self._host} resolved to no address")
        return list(allowed)

    def _release(self, connection: _Connection) -> None:
        """An exchange ended with the answer read whole: the connection serves the next."""
        if connection.closed or not connection.keep_alive or self.closed:
            self._discard(connection)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.append(connection)

    def _discard(self, connection: _Connection) -> None:
        """Close `connection` (its answer was cut short, failed or ended the connection)."""
        connection.close()
        if connection in self._open:
            self._open.discard(connection)
            self._pass_on()

    def _lost(self, connection: _Connection) -> None:
        """The transport closed (either side): its place in the pool is free."""
        if connection in self._idle:
            self._idle.remove(connection)
        if connection in self._open:
            self._open.discard(connection)
            self._pass_on()

    def _pass_on(self) -> None:
        """A place in the pool freed: the first waiter connects."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _wait(self, connection: _Connection, due: float | None) -> None:
        """Until `connection` has news, bounded by the read timeout and the deadline."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[object] = loop.create_future()
        limit, by_deadline = self._bound(loop.time() + self._read_timeout, due)
        connection.watch(waiter, limit)
        try:
            result = await waiter
        finally:
            connection.waiter = None
        if result == _EXPIRED:
            if by_deadline:
                raise DeadlinePassed("the run's deadline passed")
            raise ReadTimeout(f"nothing for {self._read_timeout:g}s")


def _fail_waiter(waiter: asyncio.Future[_Connection | None], by_deadline: bool) -> None:
    if not waiter.done():
        error: UpstreamError = (
            DeadlinePassed("the run's deadline passed")
            if by_deadline
            else PoolTimeout("every connection stayed busy")
        )
        waiter.set_exception(error)
