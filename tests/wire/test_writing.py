"""The coalescing writer sends at once when idle and batches only what queued during a write."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from iop.wire import CoalescingWriter
from iop.wire.writing import ITEM_OVERHEAD

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


async def test_an_item_put_while_idle_goes_out_alone_and_at_once() -> None:
    sent: list[list[int]] = []

    async def send(batch: Sequence[int]) -> None:
        sent.append(list(batch))

    async with CoalescingWriter(send, name="test-writer") as writer:
        writer.put(1)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sent == [[1]]


async def test_items_queued_during_a_write_go_out_as_one_message() -> None:
    sent: list[list[int]] = []
    release = asyncio.Event()

    async def send(batch: Sequence[int]) -> None:
        sent.append(list(batch))
        await release.wait()
        release.clear()

    async with CoalescingWriter(send, name="test-writer") as writer:
        writer.put(1)
        await asyncio.sleep(0.01)
        for item in (2, 3, 4):
            writer.put(item)
        release.set()
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.sleep(0.01)
        assert sent == [[1], [2, 3, 4]]
        assert (writer.messages_sent, writer.items_sent) == (2, 4)


async def test_items_put_in_one_step_share_a_message() -> None:
    sent: list[list[str]] = []

    async def send(batch: Sequence[str]) -> None:
        sent.append(list(batch))

    async with CoalescingWriter(send, name="test-writer") as writer:
        writer.put("chunk")
        writer.put("usage")
        writer.put("done")
        await asyncio.sleep(0.01)
    assert sent == [["chunk", "usage", "done"]]


async def test_a_failed_send_stops_the_writer_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def send(batch: Sequence[int]) -> None:
        raise ConnectionError("stream broken")

    async with CoalescingWriter(send, name="test-writer") as writer:
        writer.put(1)
        await writer.task  # ends quietly: a broken stream is its owner's news
        assert isinstance(writer.error, ConnectionError)
        assert writer.closed
        assert writer.put(2) is False
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_put_after_stop_is_ignored() -> None:
    async def send(batch: Sequence[int]) -> None:
        pass

    writer: CoalescingWriter[int] = CoalescingWriter(send, name="test-writer")
    async with writer:
        pass
    assert writer.put(1) is False


async def test_an_item_put_without_waking_rides_with_the_next_write() -> None:
    sent: list[list[str]] = []
    wrote = asyncio.Event()

    async def send(batch: Sequence[str]) -> None:
        sent.append(list(batch))
        wrote.set()

    async with CoalescingWriter(send, name="test-writer") as writer:
        writer.put("accepted", wake=False)
        writer.put("first chunk")  # wakes the writer: both go out as one message
        await asyncio.wait_for(wrote.wait(), 5)
    assert sent == [["accepted", "first chunk"]]


async def test_wait_flushed_returns_once_everything_put_was_written() -> None:
    """What a drained Node waits for before it closes its links: its last words sent."""
    written: list[int] = []
    gate = asyncio.Event()

    async def send(batch: Sequence[int]) -> None:
        await gate.wait()  # a slow link: each write waits for the gate
        written.extend(batch)

    async with CoalescingWriter(send, name="test-writer") as writer:
        writer.put(1)
        await asyncio.sleep(0)
        writer.put(2)
        writer.put(3, wake=False)
        flushed = asyncio.create_task(writer.wait_flushed())
        await asyncio.sleep(0.01)
        assert not flushed.done()  # 1 is in flight, 2 and 3 wait
        gate.set()
        await asyncio.wait_for(flushed, 5)
        assert written == [1, 2, 3]
        assert writer.backlog == 0
        await writer.wait_flushed()  # nothing left: at once


async def test_wait_flushed_returns_when_the_stream_breaks() -> None:
    async def send(batch: Sequence[int]) -> None:
        raise ConnectionResetError("the peer went away")

    async with CoalescingWriter(send, name="test-writer") as writer:
        writer.put(1)
        writer.put(2)
        await asyncio.wait_for(writer.wait_flushed(), 5)
        assert isinstance(writer.error, ConnectionResetError)


async def test_finish_writes_everything_queued_and_never_cuts_a_write_short() -> None:
    """How a Node ends its half of a stream: its last words whole (a grpc.aio write cancelled
    midway would cancel the call, and the peer would lose what it had not read yet)."""
    written: list[int] = []
    cut: list[int] = []
    gate = asyncio.Event()
    writing = asyncio.Event()

    async def send(batch: Sequence[int]) -> None:
        writing.set()
        try:
            await gate.wait()  # a slow link
        except asyncio.CancelledError:
            cut.extend(batch)
            raise
        written.extend(batch)

    async with CoalescingWriter(send, name="test-writer") as writer:
        writer.put(1)
        await writing.wait()  # 1 is in flight
        writer.put(2)
        writer.put(3, wake=False)
        finishing = asyncio.create_task(writer.finish())
        await asyncio.sleep(0)
        assert writer.put(4) is False  # finishing: nothing more is taken
        gate.set()
        await asyncio.wait_for(finishing, 5)
        assert writer.task.done() and writer.error is None
    assert written == [1, 2, 3]
    assert cut == []


async def test_finish_of_an_idle_writer_returns_at_once() -> None:
    async def send(batch: Sequence[int]) -> None:
        pass

    async with CoalescingWriter(send, name="test-writer") as writer:
        await asyncio.wait_for(writer.finish(), 5)
        assert writer.task.done()


async def test_a_writer_with_max_bytes_cuts_a_batch_before_it_passes_the_bound() -> None:
    sent: list[list[int]] = []

    async def send(batch: Sequence[int]) -> None:
        sent.append(list(batch))

    overhead = ITEM_OVERHEAD
    async with CoalescingWriter(send, name="test-writer", max_bytes=1000 + 3 * overhead) as writer:
        for item, size in enumerate([400, 400, 400, 100, 2000, 10]):
            writer.put(item, size=size, wake=False)
        writer.put(6)
        await writer.wait_flushed()
    # 400+400 fit, the third 400 would pass 1000; the 2000 goes alone (an item is never split).
    assert sent == [[0, 1], [2, 3], [4], [5, 6]]
