"""One HTTP request and its answer, as the Edge's apps see them: `Exchange`.

The Edge's HTTP server (`http/server.py`, `http/connections.py`) parses a request's head and
hands the app an `Exchange`; the app reads the body with `read_body` and answers with
`respond` (a whole body, one write) or `start`, `write` and `end` (a stream, chunked). No ASGI
messages, no task per request beyond the one that runs the app: a client that disconnects is
told to the app through a callback it gives `on_gone` (the OpenAI app cancels its request's
task).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from ..authenticating import Principal

Headers = Sequence[tuple[bytes, bytes]]

_JSON: Final = b"application/json"
_CHUNKED: Final = (b"transfer-encoding", b"chunked")
_CLOSE: Final = (b"connection", b"close")
_LAST_CHUNK: Final = b"0\r\n\r\n"
#: What the parser buffers of a body the app has not asked for yet before it stops reading.
BODY_HIGH_WATER: Final = 64 * 1024
#: The status recorded for a request whose client went away before its answer.
CLIENT_GONE: Final = 499


class ClientGone(Exception):
    """The client disconnected before its request's body arrived."""


class Disconnect:
    """Given to `Exchange.on_gone`: when the client leaves mid-answer, cancel the request's
    task (its run and its slot with it), and remember that it was this that cancelled it."""

    __slots__ = ("seen", "task")

    def __init__(self) -> None:
        self.seen = False
        self.task: asyncio.Task[None] | None = None

    def __call__(self) -> None:
        if self.task is not None:
            self.seen = True
            self.task.cancel()

    def cancelled_it(self) -> bool:
        """In the request's task, handling its CancelledError: whether the client's leaving
        cancelled it (and nothing else did: the cancellation is then consumed)."""
        task = asyncio.current_task()
        return self.seen and task is not None and task.uncancel() == 0


class Connection(Protocol):
    """What an exchange asks of the connection it came on (`http/connections.py`)."""

    client: tuple[str, int] | None
    #: A streamed answer's head, sent with its first part.
    pending_head: bytes
    #: The client has not taken enough of what was written: wait with `drain()`.
    write_paused: bool

    def head(self, status: int, headers: Headers, lines: bytes = b"") -> bytes: ...
    def write(self, data: bytes) -> None: ...
    def write_part(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def want_body(self, exchange: Exchange) -> None: ...
    def answered(self, exchange: Exchange) -> None: ...


class Exchange:
    """A request (`method`, `path`, `query`, `headers` with lowercase names, `client`) and the
    one answer to it; made by the connection that parsed it."""

    __slots__ = (
        "_body",
        "_body_done",
        "_body_size",
        "_chunked",
        "_connection",
        "_continue",
        "_on_gone",
        "_waiter",
        "client",
        "discarding",
        "finished",
        "gone",
        "head_only",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "principal",
        "query",
        "started",
    )

    def __init__(
        self,
        connection: Connection,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        http_version: str,
        keep_alive: bool,
        expect_continue: bool,
    ) -> None:
        self._connection = connection
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.http_version = http_version
        self.client: tuple[str, int] | None = connection.client
        #: The connection serves another request after this answer.
        self.keep_alive = keep_alive
        self.head_only = method == "HEAD"
        self._continue = expect_continue
        self._body: list[bytes] = []
        self._body_size = 0
        self._body_done = False
        self._waiter: asyncio.Future[None] | None = None
        #: The answer began (its head is written or waits for its first part).
        self.started = False
        #: The answer is complete.
        self.finished = False
        #: The client disconnected.
        self.gone = False
        #: The rest of the body is dropped as it arrives (the answer came first).
        self.discarding = False
        self._chunked = False
        self._on_gone: Callable[[], object] | None = None
        #: The principal of the request's key, once a layer in front of the app (the client
        #: guard) authenticated it: the app need not hash the key again.
        self.principal: Principal | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of request header `name` (lowercase), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    # -- the body --------------------------------------------------------------------------------

    async def read_body(self, limit: int, too_large: Callable[[], Exception]) -> bytes:
        """The whole body; raises `too_large()` once it is known to exceed `limit` bytes (from
        its Content-Length, or as it arrives) and `ClientGone` if the client leaves first."""
        length = self.header(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large()
        if self._continue:
            self._continue = False
            self._connection.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while not self._body_done:
            if self.gone:
                raise ClientGone
            if self._body_size > limit:
                raise too_large()
            self._connection.want_body(self)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._body_size > limit:
            raise too_large()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        return body

    def body_received(self, part: bytes) -> int:
        """The connection parsed `part` of the body: what is buffered now."""
        if not self.discarding:
            self._body.append(part)
            self._body_size += len(part)
            self._wake()
        return self._body_size

    def body_complete(self) -> None:
        self._body_done = True
        self._wake()

    @property
    def body_done(self) -> bool:
        """The whole body has arrived (or been dropped)."""
        return self._body_done

    @property
    def reading(self) -> bool:
        """The app waits for more of the body."""
        return self._waiter is not None

    def on_gone(self, callback: Callable[[], object] | None) -> None:
        """Call `callback` once if the client disconnects before the answer is complete (at
        once if it has already); None: no longer."""
        self._on_gone = callback
        if callback is not None and self.gone and not self.finished:
            self._on_gone = None
            callback()

    def disconnected(self) -> None:
        """The connection was lost: tell whoever waits, and the `on_gone` callback if the answer
        was not complete."""
        if self.gone:
            return
        self.gone = True
        self._wake()
        callback, self._on_gone = self._on_gone, None
        if callback is not None and not self.finished:
            callback()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the answer ------------------------------------------------------------------------------

    def respond(
        self,
        status: int,
        body: bytes,
        content_type: bytes = _JSON,
        headers: Headers = (),
    ) -> None:
        """The whole answer in one write: status, content type and length, `headers`, `body`."""
        if self.started:
            raise RuntimeError("the answer to this request has begun already")
        self.started = self.finished = True
        connection = self._connection
        if headers or not self.keep_alive:
            head = self._head(
                status,
                [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *headers],
            )
        else:  # the usual answer: its two header lines made at once
            lines = b"content-type: %b\r\ncontent-length: %d\r\n" % (content_type, len(body))
            head = connection.head(status, (), lines)
        connection.write(head if self.head_only else head + body)
        connection.answered(self)

    def start(self, status: int, headers: Headers) -> None:
        """Begin a streamed answer (no length): its head goes out with the first `write`."""
        if self.started:
            raise RuntimeError("the answer to this request has begun already")
        self.started = True
        if self.keep_alive:
            self._chunked = True
            headers = [*headers, _CHUNKED]
        self._connection.pending_head = self._head(status, headers)

    async def write(self, data: bytes) -> None:
        """A part of a streamed answer, once the client has taken what came before."""
        connection = self._connection
        if connection.write_paused:
            await connection.drain()
        if self.gone or not data:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        connection.write_part(b"" if self.head_only else data)

    async def end(self, data: bytes = b"") -> None:
        """The last part of a streamed answer: the answer is complete."""
        connection = self._connection
        if connection.write_paused:
            await connection.drain()
        if self.finished:
            return
        self.finished = True
        if not self.gone:
            if self._chunked:
                data = (b"%x\r\n%b\r\n" % (len(data), data) if data else b"") + _LAST_CHUNK
            connection.write_part(b"" if self.head_only else data)
        connection.answered(self)

    def _head(self, status: int, headers: Headers) -> bytes:
        if not self.keep_alive:
            headers = [*headers, _CLOSE]
        return self._connection.head(status, headers)
