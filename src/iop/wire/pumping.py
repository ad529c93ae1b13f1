"""One side of a Node-Edge stream at work: its coalescing writer and its reader, run together.

Both ends of the stream (the Edge's node hub, the Node's link to an Edge) run the same loop:
a `CoalescingWriter` for what they send, a reader task for what they receive, and a wait for
the first of them, or of the side's own watchers (a deadline, a goodbye), to end. `StreamPump`
is that loop once: the side says what ended it from `ended_first`, and leaving the block stops
the reader and the writer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

from iop.aiokits import guarded_task, stop_tasks

from .writing import CoalescingWriter

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger(__name__)


class StreamPump(Generic[T, R]):
    """`async with StreamPump(send, read, side=..., peer=...) as pump:` writes what is put in
    `pump.writer` through `send(batch)` and runs `read(writer)` as the reader task (its result,
    `R`, is how the reading ended); `await pump.wait(*watchers)` returns once the reader, the
    writer or one of `watchers` has ended."""

    def __init__(
        self,
        send: Callable[[Sequence[T]], Awaitable[None]],
        read: Callable[[CoalescingWriter[T]], Coroutine[Any, Any, R]],
        *,
        side: str,
        peer: str,
        max_bytes: int | None = None,
    ) -> None:
        """`side` and `peer` name the tasks: `{side}-writer-{peer}`, `{side}-reader-{peer}`."""
        self.writer: CoalescingWriter[T] = CoalescingWriter(
            send, name=f"{side}-writer-{peer}", max_bytes=max_bytes
        )
        self._read = read
        self._reader_name = f"{side}-reader-{peer}"
        self._reader: asyncio.Task[R] | None = None

    async def __aenter__(self) -> Self:
        await self.writer.__aenter__()
        self._reader = guarded_task(self._read(self.writer), name=self._reader_name, logger=logger)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await stop_tasks([self.reader])
        finally:
            await self.writer.__aexit__(kind, error, traceback)

    @property
    def reader(self) -> asyncio.Task[R]:
        assert self._reader is not None, "use the pump in `async with`"
        return self._reader

    async def wait(self, *watchers: asyncio.Future[Any]) -> None:
        """Until the reader, the writer or one of `watchers` has ended."""
        ends: list[asyncio.Future[Any]] = [self.reader, self.writer.task, *watchers]
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)

    @property
    def read_to_its_end(self) -> bool:
        """The reader ended on its own, without an error: the peer ended its half."""
        reader = self.reader
        return reader.done() and not reader.cancelled() and reader.exception() is None
