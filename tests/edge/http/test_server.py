"""The Edge's own HTTP/1.1 server (`iop.edge.http.HttpServer`) over real sockets, with apps
written for each rule: keep-alive and its idle end, pipelining, a body read in parts (chunked,
`Expect: 100-continue`, past a limit with the rest dropped), HEAD, a streamed answer (chunked on
HTTP/1.1), an app that fails or answers nothing, a client that leaves before or during its answer,
and a stop that lets an answer in progress finish. The limits of `http/caps.py` are tested
through the Edge in tests/chaos/test_http_limits.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

from iop.edge.http import HttpCaps, HttpServer
from iop.edge.http.exchanges import ClientGone, Exchange

App = Callable[[Exchange], Awaitable[None]]


class Served:
    """An `HttpServer` on a loopback port serving whatever app the test sets."""

    def __init__(self) -> None:
        self.app: App = self.echo
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = HttpServer(self._route, sock, caps=HttpCaps(), what="the test", grace=1.0)

    async def _route(self, exchange: Exchange) -> None:
        await self.app(exchange)

    @staticmethod
    async def echo(exchange: Exchange) -> None:
        body = await exchange.read_body(1000, lambda: ValueError("too large"))
        method, path = exchange.method.encode(), exchange.path.encode()
        exchange.respond(200, b"%s %s %s" % (method, path, body))

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    served = Served()
    await served.server.start()
    yield served
    await served.server.stop()


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One answer with a Content-Length body: status, headers, body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines[1:] if line)
    body = await reader.readexactly(int(headers[b"content-length"]))
    return int(lines[0].split()[1]), headers, body


async def test_a_keep_alive_connection_serves_requests_one_after_another(served: Served) -> None:
    reader, writer = await served.connect()
    for n in range(3):
        writer.write(b"POST /n HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\n%d" % n)
        status, headers, body = await answer(reader)
        assert (status, body) == (200, b"POST /n %d" % n)
        assert b"connection" not in headers and b"date" in headers
    writer.close()


async def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    gate = asyncio.Event()

    async def slow_first(exchange: Exchange) -> None:
        if exchange.path == "/first":
            await gate.wait()
        exchange.respond(200, exchange.path.encode())

    served.app = slow_first
    reader, writer = await served.connect()
    writer.write(b"GET /first HTTP/1.1\r\nhost: x\r\n\r\nGET /second HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.sleep(0.1)
    gate.set()
    assert (await answer(reader))[2] == b"/first"
    assert (await answer(reader))[2] == b"/second"
    writer.close()


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100-continue"])
async def test_a_chunked_body_is_read_whole(served: Served, expect: bool) -> None:
    reader, writer = await served.connect()
    head = b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
    writer.write(head + (b"expect: 100-continue\r\n" if expect else b"") + b"\r\n")
    if expect:
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
    writer.write(b"3\r\nabc\r\n")
    await asyncio.sleep(0.05)
    writer.write(b"2\r\nde\r\n0\r\n\r\n")
    assert (await answer(reader))[2] == b"POST /c abcde"
    writer.close()


async def test_a_body_past_the_limit_is_refused_and_the_rest_dropped(served: Served) -> None:
    async def limited(exchange: Exchange) -> None:
        try:
            await exchange.read_body(10, ValueError)
        except ValueError:
            exchange.respond(413, b"too large")

    served.app = limited
    reader, writer = await served.connect()
    writer.write(b"POST /big HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
    writer.write(b"14\r\n" + b"x" * 20 + b"\r\n")
    assert (await answer(reader))[:1] == (413,)
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (200_000, b"y" * 200_000))  # dropped, not kept
    served.app = served.echo
    writer.write(b"GET /next HTTP/1.1\r\nhost: x\r\n\r\n")
    assert (await answer(reader))[2] == b"GET /next "  # the connection serves on
    writer.close()


async def test_head_gets_the_headers_without_the_body(served: Served) -> None:
    reader, writer = await served.connect()
    writer.write(b"HEAD /h HTTP/1.1\r\nhost: x\r\n\r\nGET /g HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b"content-length: 8\r\n" in head
    assert (await answer(reader))[2] == b"GET /g "  # no body came between the two
    writer.close()


async def test_a_stream_is_chunked_on_http_1_1_and_ended_by_the_close_on_http_1_0(
    served: Served,
) -> None:
    async def stream(exchange: Exchange) -> None:
        exchange.start(200, [(b"content-type", b"text/event-stream")])
        await exchange.write(b"data: 1\n\n")
        await exchange.end(b"data: 2\n\n")

    served.app = stream
    reader, writer = await served.connect()
    writer.write(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert b"transfer-encoding: chunked" in head
    chunks = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
    assert chunks == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
    writer.close()
    reader, writer = await served.connect()
    writer.write(b"GET /s HTTP/1.0\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head and b"transfer-encoding" not in head
    assert body == b"data: 1\n\ndata: 2\n\n"
    writer.close()


async def test_an_app_that_fails_or_answers_nothing_gets_its_client_a_500(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(exchange: Exchange) -> None:
        if exchange.path == "/bug":
            raise RuntimeError("a bug")

    served.app = broken
    for path in (b"/bug", b"/nothing"):
        reader, writer = await served.connect()
        writer.write(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path)
        status, headers, body = await answer(reader)
        assert status == 500 and headers[b"connection"] == b"close"
        assert b'"code":"internal_error"' in body
        assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection ends
        writer.close()
    messages = [record.getMessage() for record in caplog.records]
    assert any("a bug" in message for message in messages)
    assert any("without answering GET /nothing" in message for message in messages)


async def test_a_client_that_left_before_its_app_watched_is_told_at_once(
    served: Served,
) -> None:
    """`on_gone` given after the client left calls back at once: a request whose client is
    gone is never run to its end for nobody."""
    read = asyncio.Event()
    watch = asyncio.Event()
    told: list[str] = []

    async def late_watcher(exchange: Exchange) -> None:
        await exchange.read_body(100, ValueError)
        read.set()
        await watch.wait()
        exchange.on_gone(lambda: told.append("gone"))

    served.app = late_watcher
    _, writer = await served.connect()
    writer.write(b"POST /w HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
    await asyncio.wait_for(read.wait(), 5)
    writer.close()
    while served.server.open_connections:
        await asyncio.sleep(0.01)
    assert not told
    watch.set()
    await asyncio.sleep(0.05)
    assert told == ["gone"]


async def test_a_client_that_leaves_while_its_body_is_awaited_is_told(served: Served) -> None:
    outcome: list[str] = []
    done = asyncio.Event()

    async def reader_app(exchange: Exchange) -> None:
        try:
            await exchange.read_body(1000, ValueError)
        except ClientGone:
            outcome.append("gone")
        done.set()

    served.app = reader_app
    _, writer = await served.connect()
    writer.write(b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nhalf")
    await asyncio.sleep(0.05)
    writer.close()
    await asyncio.wait_for(done.wait(), 5)
    assert outcome == ["gone"]


async def test_a_stop_lets_the_answer_in_progress_finish_and_closes_idle_connections() -> None:
    served = Served()
    began = asyncio.Event()

    async def slow(exchange: Exchange) -> None:
        began.set()
        await asyncio.sleep(0.3)
        exchange.respond(200, b"finished")

    served.app = slow
    await served.server.start()
    idle_reader, idle_writer = await served.connect()
    reader, writer = await served.connect()
    writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(began.wait(), 5)
    await served.server.stop()
    status, headers, body = await answer(reader)
    assert (status, body, headers[b"connection"]) == (200, b"finished", b"close")
    assert await asyncio.wait_for(idle_reader.read(), 5) == b""
    for w in (idle_writer, writer):
        w.close()
