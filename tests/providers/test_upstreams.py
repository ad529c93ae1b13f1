"""The adapter's HTTP/1.1 client (`iop.providers.adapters.upstreams`) against real sockets.

Each server here is a raw asyncio server on loopback that answers with the bytes a test scripts,
so the framings an upstream may use (Content-Length, chunked, the end of the connection, a 1xx
before the answer) and its misbehaviours (silence, a drop, bytes that are not HTTP) are all
exercised. Every test runs on asyncio's own event loop and on uvloop, which the Edge and the
Node run on (their transports differ).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvloop

from iop.providers.adapters.upstreams import (
    BadResponse,
    ConnectFailed,
    ConnectTimeout,
    DeadlinePassed,
    Disconnected,
    PoolTimeout,
    ReadTimeout,
    Response,
    UpstreamClient,
)

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Any], Any]:
    """Run a coroutine to its end on the event loop the test is parametrized with."""
    if request.param == "uvloop":
        return uvloop.run
    return asyncio.run


class Server:
    """A loopback server: each connection is handed to `handler`; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request (head and Content-Length body), kept in `requests`."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


@contextlib.asynccontextmanager
async def serving(
    handler: Callable[[Server, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[Server]:
    server = Server(lambda r, w: handler(server, r, w))
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()


def client(port: int, **options: Any) -> UpstreamClient:
    settings: dict[str, Any] = {
        "max_connections": 4,
        "connect_timeout": 2.0,
        "read_timeout": 2.0,
        "keepalive_s": 4.0,
        **options,
    }
    return UpstreamClient(
        f"http://127.0.0.1:{port}/v1", {"content-type": "application/json"}, **settings
    )


async def body_of(response: Response) -> bytes:
    parts = []
    while piece := await response.read_some():
        parts.append(piece)
    return b"".join(parts)


def answer(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status.encode(),
        len(body),
        extra,
        body,
    )


async def keep_answering(server: Server, reader: Any, writer: Any) -> None:
    """Answer every request on the connection with its own body's length."""
    while True:
        request = await server.read_request(reader)
        body = request.split(b"\r\n\r\n", 1)[1]
        writer.write(answer(b'{"got":%d}' % len(body)))
        await writer.drain()


def test_a_post_is_sent_under_the_base_path_and_its_connection_is_kept(run) -> None:
    async def main() -> None:
        async with serving(keep_answering) as server:
            upstream = client(server.port)
            for size in (1, 10, 1000):
                response = await upstream.post("/chat/completions", b"x" * size)
                assert response.status == 200 and response.content_length == len(
                    b'{"got":%d}' % size
                )
                assert await body_of(response) == b'{"got":%d}' % size
                response.close()
            await upstream.aclose()
        assert server.connections == 1
        head = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
        assert head[0] == b"POST /v1/chat/completions HTTP/1.1"
        assert f"host: 127.0.0.1:{server.port}".encode() in head
        assert b"content-type: application/json" in head and b"content-length: 1" in head

    run(main())


def test_chunked_and_connection_delimited_bodies_and_a_1xx_first(run) -> None:
    async def chunked(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await keep_answering(server, reader, writer)

    async def until_closed(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async def main() -> None:
        async with serving(chunked) as server:
            upstream = client(server.port)
            response = await upstream.post("/x", b"{}")
            assert response.status == 200 and response.content_length is None
            assert await body_of(response) == b"data: 1\n\ndata: 2\n\n"
            again = await upstream.post("/x", b"{}")  # the same connection, kept alive
            assert await body_of(again) == b'{"got":2}'
            assert server.connections == 1
            await upstream.aclose()
        async with serving(until_closed) as server:
            upstream = client(server.port)
            response = await upstream.post("/x", b"{}")
            assert await body_of(response) == b"all of it"
            await upstream.aclose()

    run(main())


def test_a_large_answer_is_read_whole_while_the_socket_waits_for_the_reader(run) -> None:
    big = bytes(range(256)) * 8192  # 2 MiB, far past the bytes held before reading pauses

    async def large(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(answer(big))
        await writer.drain()
        await keep_answering(server, reader, writer)

    async def main() -> None:
        async with serving(large) as server:
            upstream = client(server.port)
            response = await upstream.post("/x", b"{}")
            received = bytearray()
            while piece := await response.read_some():
                received += piece
                await asyncio.sleep(0)  # a reader slower than the socket
            assert bytes(received) == big
            assert await body_of(await upstream.post("/x", b"{}")) == b'{"got":2}'
            assert server.connections == 1
            await upstream.aclose()

    run(main())


def test_an_answer_not_read_to_its_end_closes_its_connection(run) -> None:
    async def main() -> None:
        async with serving(keep_answering) as server:
            upstream = client(server.port)
            response = await upstream.post("/x", b"{}")
            response.close()  # nothing read
            assert await body_of(await upstream.post("/x", b"{}")) == b'{"got":2}'
            assert server.connections == 2
            await upstream.aclose()

    run(main())


def test_an_idle_connection_is_closed_by_the_client_before_the_server_would(run) -> None:
    async def main() -> None:
        async with serving(keep_answering) as server:
            upstream = client(server.port, keepalive_s=0.1)
            await body_of(await upstream.post("/x", b"{}"))
            await asyncio.sleep(0.2)
            await body_of(await upstream.post("/x", b"{}"))
            assert server.connections == 2
            await upstream.aclose()

    run(main())


def test_a_connection_the_server_closed_while_idle_is_not_used_again(run) -> None:
    async def once(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(answer(b"{}"))
        await writer.drain()  # then closes, keep-alive notwithstanding

    async def main() -> None:
        async with serving(once) as server:
            upstream = client(server.port)
            for _ in range(3):
                await body_of(await upstream.post("/x", b"{}"))
                await asyncio.sleep(0.05)  # the close reaches the client
            assert server.connections == 3
            await upstream.aclose()

    run(main())


def test_a_full_pool_waits_for_a_connection_then_gives_up(run) -> None:
    async def main() -> None:
        release = asyncio.Event()

        async def slow(server: Server, reader: Any, writer: Any) -> None:
            while True:
                await server.read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
                await writer.drain()
                await release.wait()  # the body once the test says so
                writer.write(b"{}")
                await writer.drain()

        async with serving(slow) as server:
            upstream = client(server.port, max_connections=1, read_timeout=0.3)
            first = await upstream.post("/x", b"{}")  # holds the pool's one connection
            began = time.monotonic()
            with pytest.raises(PoolTimeout):
                await upstream.post("/x", b"{}")
            assert 0.25 < time.monotonic() - began < 1.5
            # A waiter gets the connection the moment it is given back.
            waiting = asyncio.create_task(upstream.post("/x", b"{}"))
            await asyncio.sleep(0.05)
            release.set()
            assert await body_of(first) == b"{}"
            assert await body_of(await waiting) == b"{}"
            assert server.connections == 1
            await upstream.aclose()

    run(main())


def test_silence_is_a_read_timeout_and_the_deadline_bounds_the_whole_exchange(run) -> None:
    async def dribble(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:  # a byte every 0.1 s: never silent for the read timeout
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)

    async def silent(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        await asyncio.sleep(10)

    async def main() -> None:
        async with serving(silent) as server:
            upstream = client(server.port, read_timeout=0.2)
            with pytest.raises(ReadTimeout, match=r"nothing for 0\.2s"):
                await upstream.post("/x", b"{}")
            await upstream.aclose()
        async with serving(dribble) as server:
            upstream = client(server.port, read_timeout=0.5)
            response = await upstream.post("/x", b"{}", deadline=time.time() + 0.35)
            began = time.monotonic()
            with pytest.raises(DeadlinePassed):
                await body_of(response)
            assert time.monotonic() - began < 1.0
            response.close()
            await upstream.aclose()

    run(main())


def test_drops_and_garbage_are_told_apart(run) -> None:
    async def drop_before(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)

    async def drop_mid(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly some")
        await writer.drain()

    async def garbage(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with serving(drop_before) as server:
            upstream = client(server.port)
            with pytest.raises(Disconnected) as before:
                await upstream.post("/x", b"{}")
            assert not before.value.answered
            await upstream.aclose()
        async with serving(drop_mid) as server:
            upstream = client(server.port)
            response = await upstream.post("/x", b"{}")
            with pytest.raises(Disconnected) as mid:
                await body_of(response)
            assert mid.value.answered
            await upstream.aclose()
        async with serving(garbage) as server:
            upstream = client(server.port)
            with pytest.raises(BadResponse, match=r"not HTTP/1\.1"):
                await upstream.post("/x", b"{}")
            await upstream.aclose()

    run(main())


def test_connect_failures_say_why(run) -> None:
    async def main() -> None:
        async with serving(keep_answering) as server:
            port = server.port
        refused = client(port)  # nothing listens there any more
        with pytest.raises(ConnectFailed) as caught:
            await refused.post("/x", b"{}")
        assert caught.value.os_error.errno == errno.ECONNREFUSED
        await refused.aclose()

        async def mute(server: Server, reader: Any, writer: Any) -> None:
            await reader.read()  # accepts, then never answers the TLS handshake

        async with serving(mute) as server:
            hurried = UpstreamClient(
                f"https://127.0.0.1:{server.port}/v1",
                {},
                max_connections=1,
                connect_timeout=0.2,
                read_timeout=2.0,
                keepalive_s=4.0,
            )
            with pytest.raises(ConnectTimeout, match=r"no connection within 0\.2s"):
                await hurried.post("/x", b"{}")
            await hurried.aclose()

    run(main())


def test_cancelling_an_exchange_closes_its_connection_and_frees_its_place(run) -> None:
    async def main() -> None:
        closed = asyncio.Event()

        async def hold(server: Server, reader: Any, writer: Any) -> None:
            if server.connections == 1:
                await server.read_request(reader)
                await reader.read()  # until the client closes
                closed.set()
                return
            await keep_answering(server, reader, writer)

        async with serving(hold) as server:
            upstream = client(server.port, max_connections=1)
            exchange = asyncio.create_task(upstream.post("/x", b"{}"))
            await asyncio.sleep(0.05)
            exchange.cancel()
            with pytest.raises(asyncio.CancelledError):
                await exchange
            await asyncio.wait_for(closed.wait(), 2)
            # Its place in the pool (of one) is free for the next exchange.
            assert await body_of(await upstream.post("/x", b"{}")) == b'{"got":2}'
            await upstream.aclose()

    run(main())


async def _hostile_head(writer: Any, what: str) -> None:
    """A head past one of the client's bounds, as a hostile upstream writes it."""
    if what == "one-long-header":  # 64 MiB in one value, in 64 KiB writes
        writer.write(b"HTTP/1.1 200 OK\r\nx-long: ")
        piece = b"a" * 65536
        for _ in range(1024):
            writer.write(piece)
            await writer.drain()
        writer.write(b"\r\ncontent-length: 2\r\n\r\n{}")
    elif what == "many-headers":  # small headers, each head under the size bound
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 150 + b"content-length: 2\r\n\r\n{}")
    elif what == "many-continues":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 11 + answer(b"{}"))
    elif what == "long-continues":  # interim heads under both counts, over the size bound
        head = b"HTTP/1.1 103 Early Hints\r\n" + b"link: <" + b"a" * 8000 + b">\r\n" * 1 + b"\r\n"
        writer.write(head * 9 + answer(b"{}"))
    await writer.drain()


@pytest.mark.parametrize(
    ("what", "message"),
    [
        pytest.param("one-long-header", r"head is larger than 65536 bytes", id="64MiB-header"),
        pytest.param("many-headers", r"more than 100 headers", id="150-headers"),
        pytest.param("many-continues", r"more than 10 interim \(1xx\)", id="11-continues"),
        pytest.param("long-continues", r"head is larger than 65536 bytes", id="long-interims"),
    ],
)
def test_a_response_head_past_a_bound_is_refused_and_its_connection_closed(
    run, what: str, message: str
) -> None:
    async def main() -> None:
        async def hostile(server: Server, reader: Any, writer: Any) -> None:
            if server.connections == 1:
                await server.read_request(reader)
                await _hostile_head(writer, what)
                await reader.read()
                return
            await keep_answering(server, reader, writer)

        async with serving(hostile) as server:
            upstream = client(server.port, max_connections=1)
            with pytest.raises(BadResponse, match=message):
                await upstream.post("/x", b"{}")
            # Its place in the pool is free, and a fair answer comes on a new connection.
            assert await body_of(await upstream.post("/x", b"{}")) == b'{"got":2}'
            assert server.connections == 2
            await upstream.aclose()

    run(main())


def test_heads_under_the_bounds_are_read(run) -> None:
    async def fair(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        interim = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        extra = b"x-long: " + b"a" * 30000 + b"\r\n" + b"x: y\r\n" * 97
        writer.write(interim * 10 + answer(b"{}", extra=extra))
        await writer.drain()
        await keep_answering(server, reader, writer)

    async def main() -> None:
        async with serving(fair) as server:
            upstream = client(server.port)
            response = await upstream.post("/x", b"{}")
            assert response.status == 200 and await body_of(response) == b"{}"
            assert await body_of(await upstream.post("/x", b"{}")) == b'{"got":2}'
            assert server.connections == 1
            await upstream.aclose()

    run(main())


@pytest.mark.parametrize("status", [b"000", b"099"])
def test_a_status_under_100_is_not_interim_but_refused(run, status: bytes) -> None:
    async def odd(server: Server, reader: Any, writer: Any) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 %s X\r\n\r\n" % status + answer(b"{}"))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with serving(odd) as server:
            upstream = client(server.port)
            with pytest.raises(BadResponse, match=f"status {status.decode()}, not HTTP's"):
                await upstream.post("/x", b"{}")
            await upstream.aclose()

    run(main())


@pytest.mark.parametrize(
    "after",
    [
        pytest.param("idle", id="while-idle"),
        pytest.param("with-the-answer", id="glued-to-the-answer"),
    ],
)
def test_a_connection_that_speaks_out_of_turn_is_closed_and_not_used_again(run, after: str) -> None:
    stray = answer(b'{"stray":1}')

    async def main() -> None:
        closed = asyncio.Event()

        async def talkative(server: Server, reader: Any, writer: Any) -> None:
            if server.connections > 1:
                await keep_answering(server, reader, writer)
                return
            await server.read_request(reader)
            if after == "idle":
                writer.write(answer(b"{}"))
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(stray)  # while the connection waits in the pool
            else:
                writer.write(answer(b"{}") + stray)
            await writer.drain()
            await reader.read()  # until the client closes the connection
            closed.set()

        async with serving(talkative) as server:
            upstream = client(server.port)
            assert await body_of(await upstream.post("/x", b"{}")) == b"{}"
            await asyncio.wait_for(closed.wait(), 2)
            assert await body_of(await upstream.post("/x", b"{}")) == b'{"got":2}'
            assert server.connections == 2
            await upstream.aclose()

    run(main())
