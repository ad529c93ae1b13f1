"""`StreamPump`: the writer and the reader of one side of a stream, until the first ends."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from iop.wire import CoalescingWriter, StreamPump

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


async def test_the_peer_ending_its_half_ends_the_wait_and_reads_as_its_end() -> None:
    sent: list[Sequence[str]] = []
    peer_done = asyncio.Event()

    async def send(batch: Sequence[str]) -> None:
        sent.append(batch)

    async def read(writer: CoalescingWriter[str]) -> str:
        writer.put("hello")
        await peer_done.wait()
        return "eof"

    async with StreamPump(send, read, side="test", peer="a") as pump:
        await pump.writer.wait_flushed()
        peer_done.set()
        await pump.wait()
        assert pump.read_to_its_end and pump.reader.result() == "eof"
    assert sent == [["hello"]]


async def test_a_broken_send_ends_the_wait_with_the_writers_error() -> None:
    async def send(batch: Sequence[str]) -> None:
        raise ConnectionResetError("the peer went away")

    async def read(writer: CoalescingWriter[str]) -> None:
        await asyncio.Event().wait()  # reads forever

    async with StreamPump(send, read, side="test", peer="b") as pump:
        pump.writer.put("x")
        await pump.wait()
        assert isinstance(pump.writer.error, ConnectionResetError)
        assert not pump.read_to_its_end
    assert pump.reader.cancelled()  # leaving the block stopped it


async def test_a_watcher_ending_first_ends_the_wait_and_leaves_both_running() -> None:
    async def send(batch: Sequence[str]) -> None:
        pass

    async def read(writer: CoalescingWriter[str]) -> None:
        await asyncio.Event().wait()

    deadline = asyncio.get_running_loop().create_future()
    async with StreamPump(send, read, side="test", peer="c") as pump:
        deadline.set_result("silent")
        await pump.wait(deadline)
        assert not pump.reader.done() and not pump.writer.task.done()
    assert pump.reader.cancelled() and pump.writer.task.done()
