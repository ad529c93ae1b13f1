"""The single writer of one stream direction, which coalesces without adding latency.

Each direction of a Node-Edge stream has exactly one writer task, since a grpc.aio message costs
far more CPU on each side than the bytes in it (docs/benchmarks.md, "Where the tail comes
from"). Producers `put` items and never wait: an item goes out at once when the writer is idle,
and what queues during a write goes in the next one, as one message, so light load pays no delay
and heavy load shares the per-message cost. With `max_bytes` a batch is bounded in bytes too
(the size each `put` declares, plus `ITEM_OVERHEAD`): the Edge refuses a Node's message past its
receive limit. `wait_for_room(limit)` bounds the queue for a producer that could outrun the
stream, `wait_flushed()` waits for what was put, and `finish()` writes the rest, then stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Final, Generic, Self, TypeVar

from iop.aiokits import guarded_task, stop_tasks

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Bytes counted for each item of a writer with `max_bytes` besides the size its `put` declares:
#: an item's framing, ids and small fields.
ITEM_OVERHEAD: Final = 128


class CoalescingWriter(Generic[T]):
    """Sends the items put into it through `send(batch)`, one batch per write.

    Use it as `async with CoalescingWriter(send, name=...) as writer:`; leaving the block stops
    the writer (items still queued are dropped: the stream is going away). When `send` raises
    (the stream broke: the peer went away, the transport closed), the writer stops, `error`
    holds what was raised, `task` ends (without an error of its own: a broken stream is the
    owner's news, not a dying task's) and further `put`s are ignored.
    """

    def __init__(
        self,
        send: Callable[[Sequence[T]], Awaitable[None]],
        *,
        name: str,
        max_items: int = 2048,
        max_bytes: int | None = None,
    ) -> None:
        self._send = send
        self._name = name
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._queue: list[T] = []
        #: With `max_bytes`: the declared size of each queued item, overhead included.
        self._sizes: list[int] = []
        self._wakeup: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None
        self._flushed: asyncio.Future[None] | None = None
        self._sending = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: What `send` raised, when it did; the writer stopped then.
        self.error: Exception | None = None
        self.messages_sent = 0
        self.items_sent = 0

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def start(self) -> None:
        if self._task is None:
            self._task = guarded_task(self._run(), name=self._name, logger=logger)

    async def stop(self) -> None:
        self._closed = True
        if self._task is not None:
            await stop_tasks([self._task])

    async def finish(self) -> None:
        """Take no more items, write every item queued, then stop (see `error` for how).

        Unlike `stop`, never cancels a write in flight: with grpc.aio, a write cancelled midway
        cancels the whole call, and the peer loses what it had received but not yet read.
        """
        self._closed = True
        task = self._task
        if task is None:
            return
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)
        await asyncio.wait([task])  # our own cancellation propagates; the writer's does not

    @property
    def task(self) -> asyncio.Task[None]:
        """The writer task: done when the writer stopped or its `send` failed (see `error`)."""
        if self._task is None:
            raise RuntimeError(f"writer {self._name} was never started")
        return self._task

    @property
    def closed(self) -> bool:
        return self._closed or (self._task is not None and self._task.done())

    def put(self, item: T, *, wake: bool = True, size: int = 0) -> bool:
        """Queue `item` for the next write; False (and dropped) when the writer has stopped.

        `wake=False` queues an item that need not go out alone: it rides with the next write
        whatever causes it (an item put with `wake`, or one already in flight), which saves a
        message when something else follows soon. `size`: the item's bytes beyond
        `ITEM_OVERHEAD`, for a writer with `max_bytes`.
        """
        if self.closed:
            return False
        self._queue.append(item)
        if self._max_bytes is not None:
            self._sizes.append(size + ITEM_OVERHEAD)
        if wake:
            wakeup = self._wakeup
            if wakeup is not None and not wakeup.done():
                wakeup.set_result(None)
        return True

    @property
    def backlog(self) -> int:
        """Items queued and not yet taken by a write."""
        return len(self._queue)

    async def wait_for_room(self, limit: int) -> None:
        """Return once fewer than `limit` items are queued, or the writer has stopped."""
        while len(self._queue) >= limit and not self.closed:
            room = self._room
            if room is None or room.done():
                room = self._room = asyncio.get_running_loop().create_future()
            await asyncio.shield(room)

    async def wait_flushed(self) -> None:
        """Return once every item put so far has been written, or the writer has stopped."""
        while (self._queue or self._sending) and not self.closed:
            flushed = self._flushed
            if flushed is None or flushed.done():
                flushed = self._flushed = asyncio.get_running_loop().create_future()
            await asyncio.shield(flushed)

    def _wake_flushers(self) -> None:
        flushed = self._flushed
        if flushed is not None and not flushed.done():
            flushed.set_result(None)

    def _wake_producers(self) -> None:
        room = self._room
        if room is not None and not room.done():
            room.set_result(None)

    def _batch_size(self) -> int:
        """How many of the queued items the next write takes (at least one)."""
        count = min(len(self._queue), self._max_items)
        limit = self._max_bytes
        if limit is None:
            return count
        total = 0
        for index, size in enumerate(self._sizes[:count]):
            total += size
            if total > limit and index:
                count = index
                break
        del self._sizes[:count]
        return count

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._queue:
                    if self._closed:
                        return  # finished: everything queued was written
                    self._wakeup = loop.create_future()
                    await self._wakeup
                    self._wakeup = None
                    continue
                count = self._batch_size()
                if count == len(self._queue):
                    batch, self._queue = self._queue, []
                else:
                    batch = self._queue[:count]
                    del self._queue[:count]
                self._wake_producers()
                self._sending = True
                try:
                    await self._send(batch)
                except Exception as exc:
                    logger.debug("writer %s stopped: its stream broke: %r", self._name, exc)
                    self.error = exc
                    return
                finally:
                    self._sending = False
                self.messages_sent += 1
                self.items_sent += len(batch)
                if not self._queue:
                    self._wake_flushers()
        finally:
            self._closed = True
            self._wake_producers()
            self._wake_flushers()
