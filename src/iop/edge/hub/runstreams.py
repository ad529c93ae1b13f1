"""The stream of one run on a Node: its events, in order, for the request path, and their pace.

A `RunStream` is what `NodeHub.run` hands the request path: the run's events, and an early exit
that cancels the run on the Node. Its buffer is bounded: past `buffer_limit` bytes the Node is
asked to pause the run (a `FlowSignal`), and to resume once the client has read half; the run's
end frees the slot (`on_end`) even before a slow client has read everything. The session that
carries the run (`nodesessions.py`) feeds it; the stream sees that session only as a
`RunCarrier`. docs/reliability.md ("Slow stream clients") says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from iop.wire import (
    DEFAULT_MAX_RESPONSE_BYTES,
    TERMINAL_EVENTS,
    RunChunk,
    RunEvent,
    RunFailed,
    RunRequest,
    statuses,
)
from iop.wire import runtime_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FlowSignal:
    """Pause (or resume) one run on its Node: its client reads slower than it produces."""

    run_id: str
    pause: bool


class RunCarrier(Protocol):
    """The session a run travels on (a `NodeSession`), as the run's stream uses it: to send the
    Node its pause, resume and cancel, and to take the run off the session."""

    #: Streams paused for a slow client, by run id.
    paused: dict[str, RunStream]

    @property
    def node_id(self) -> str: ...

    def writer_put(self, item: pb.Cancel | FlowSignal) -> bool: ...

    def forget(self, run_id: str) -> RunStream | None: ...


class RunStream:
    """The events of one run, in order, ending with exactly one `RunDone` or `RunFailed`.

    `async with hub.run(request) as stream: async for event in stream: ...`. Leaving the block
    before the terminal event (the client went away, an error) sends Cancel to the Node at once
    and frees the run on the Edge; the Node then aborts the upstream request. Iterating without
    the `async with` also works, but then only `aclose()` cancels early.
    """

    __slots__ = (
        "_buffered",
        "_ended",
        "_events",
        "_finished",
        "_limit",
        "_on_end",
        "_paused",
        "_pieces",
        "_pieces_size",
        "_saw_chunk",
        "_session",
        "_start_on",
        "_started",
        "_waiter",
        "paused_at",
        "request",
    )

    def __init__(
        self, request: RunRequest, buffer_limit: int, start: Callable[[RunStream], None]
    ) -> None:
        """`start(stream)` sends the run to its Node (the hub's choice of session), or fails it;
        it is called once, when the run is first awaited."""
        self.request = request
        self._start_on = start
        self._session: RunCarrier | None = None
        self._events: deque[RunEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._started = False
        self._finished = False
        self._saw_chunk = False
        # Flow control of streamed runs: bytes of chunks waiting for the consumer.
        self._limit = buffer_limit if request.stream else 0
        self._buffered = 0
        self._paused = False
        #: Loop time since when the run has been paused for its client (None: not paused).
        self.paused_at: float | None = None
        self._ended = False
        self._on_end: list[Callable[[], object]] = []
        # Pieces of a chunk too large for one wire message, until its last piece arrives.
        self._pieces: list[bytes] = []
        self._pieces_size = 0

    async def __aenter__(self) -> RunStream:
        self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    def __aiter__(self) -> RunStream:
        return self

    async def __anext__(self) -> RunEvent:
        if not self._started:
            self._start()
        while not self._events:
            if self._finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._consume()

    def take_ready(self) -> list[RunEvent]:
        """The events that arrived and were not consumed yet, without waiting (up to and with
        the terminal one): what the caller can write out in one go."""
        taken: list[RunEvent] = []
        while self._events and not self._finished:
            taken.append(self._consume())
        return taken

    def _consume(self) -> RunEvent:
        """Hand the oldest event to the consumer. Both ways out (`__anext__`, `take_ready`) go
        through here, so whatever consuming an event must update is updated once, here."""
        event = self._events.popleft()
        if isinstance(event, TERMINAL_EVENTS):
            self._finished = True
        elif self._limit and type(event) is RunChunk:
            self._buffered -= len(event.data)
            if self._paused and self._buffered <= self._limit // 2:
                self._paused = False
                self.paused_at = None
                session = self._session
                if session is not None:
                    session.paused.pop(self.request.run_id, None)
                    session.writer_put(FlowSignal(self.request.run_id, pause=False))
        return event

    async def aclose(self) -> None:
        self.cancel()

    def on_end(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once the run has ended (its last event arrived, or it was cancelled
        or failed), even while the consumer has not read everything; at once if it has."""
        if self._ended:
            callback()
        else:
            self._on_end.append(callback)

    @property
    def buffered(self) -> int:
        """Bytes of chunks that arrived and wait for the consumer."""
        return self._buffered

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def node_id(self) -> str | None:
        """The node the run went to (None when it never left the Edge)."""
        return None if self._session is None else self._session.node_id

    def cancel(self, *, first_byte_timeout: bool = False) -> None:
        """Stop the run now unless it has ended: Cancel goes to the Node, nothing more arrives.
        `first_byte_timeout`: the Node counts the run as its provider's upstream timeout."""
        if not self._started:
            self._started = True
            self._finished = True
            return
        session = self._session
        if session is not None and session.forget(self.request.run_id) is self:
            session.writer_put(
                pb.Cancel(run_id=self.request.run_id, first_byte_timeout=first_byte_timeout)
            )
        self._session = None
        self._pieces, self._pieces_size = [], 0
        self._finished = True
        self._end()
        self._wake()

    def _start(self) -> None:
        self._started = True
        self._start_on(self)

    def attach(self, session: RunCarrier) -> None:
        self._session = session

    def piece(self, data: bytes) -> None:
        """A piece of a chunk too large for one wire message: kept until its last piece, within
        the run's `max_response_bytes` (past it the run fails as `response_too_large`)."""
        self._pieces_size += len(data)
        if self._pieces_size > self._max_response_bytes:
            self._refuse_too_large(self._pieces_size)
            return
        self._pieces.append(data)

    @property
    def _max_response_bytes(self) -> int:
        return self.request.max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES

    def _refuse_too_large(self, size: int) -> None:
        """The Node sent more than the run allows: cancel it there, fail it here."""
        self._pieces, self._pieces_size = [], 0
        session = self._session
        if session is not None and session.forget(self.request.run_id) is self:
            session.writer_put(pb.Cancel(run_id=self.request.run_id))
        self.fail(
            statuses.RESPONSE_TOO_LARGE,
            f"the provider's answer passed {size} bytes, more than the limit of "
            f"{self._max_response_bytes} (openai.max_response_bytes); ask for a stream",
        )

    def stall(self, seconds: float) -> None:
        """The client took too little for `seconds` while the run was paused: cancel the run on
        its Node (its slot is free at once); the client still gets what is held for it, then
        the `stream_stalled` error."""
        session = self._session
        if session is None or self._ended:
            return
        if session.forget(self.request.run_id) is self:
            session.writer_put(pb.Cancel(run_id=self.request.run_id))
        self.fail(
            statuses.STREAM_STALLED,
            f"the client read too little of this stream for {seconds:g}s "
            "(openai.stream_stall_timeout_ms): it was stopped to free its provider",
        )

    def deliver(self, event: RunEvent) -> None:
        """Queue an event for the consumer (called by the session's reader)."""
        if type(event) is RunChunk:
            if self._pieces:
                self._pieces.append(event.data)
                event = RunChunk(b"".join(self._pieces), event.usage_only, event.sse)
                self._pieces, self._pieces_size = [], 0
            if len(event.data) > self._max_response_bytes:
                self._refuse_too_large(len(event.data))
                return
            self._saw_chunk = True
            if self._limit:
                self._buffered += len(event.data)
                if not self._paused and self._buffered > self._limit:
                    session = self._session
                    if session is not None:
                        self._paused = True
                        self.paused_at = asyncio.get_running_loop().time()
                        session.paused[self.request.run_id] = self
                        session.writer_put(FlowSignal(self.request.run_id, pause=True))
        elif isinstance(event, TERMINAL_EVENTS):
            self._session = None
            self._events.append(event)
            self._end()
            self._wake()
            return
        self._events.append(event)
        self._wake()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("an end callback of run %s failed", self.request.run_id)

    def fail(self, code: str, message: str) -> None:
        """End the run with a failure; retryable only while nothing reached the client."""
        failed = statuses.failure(code, message)
        if failed.code == statuses.NODE_DISCONNECTED:
            failed = RunFailed(failed.code, failed.message, not self._saw_chunk, None)
        self.deliver(failed)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
