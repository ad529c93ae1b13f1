"""Hostile HTTP on the public OpenAI listener, over raw sockets: no header, connection or framing
can stall the Edge, and every refusal is an OpenAI-shaped answer.

What one unauthenticated client can do: send an endless header, thousands of headers, a head
that never ends, connections that send nothing (more than the Edge can hold open), bytes that
are not HTTP, a body nested deeper than the serializer goes; and an HTTP/1.0 client must get a
stream it can read.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import httpx
import orjson
import pytest

from testkit import CLIENT_TOKEN

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]

SLACK_S = 5.0
HEADERS = b"host: edge\r\nauthorization: Bearer " + CLIENT_TOKEN.encode() + b"\r\n"


async def edge_with(document_of, start_edge, start_node, until, **openai: Any) -> Any:
    """An Edge with `openai` settings, and a node serving model `m`."""
    document = document_of(
        [
            {
                "id": "p1",
                "adapter": {"type": "fake", "completion_tokens": 6},
                "served_models": ["served"],
                "capacity": 8,
            }
        ],
        openai=openai,
        edge={"admin": {"listen": "127.0.0.1:0"}},
    )
    edge = await start_edge(document)
    await start_node(edge.hub)
    await until(lambda: edge.dispatcher.available == {"p1"})
    return edge


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def answer_of(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one answer before the connection ends."""
    data = await asyncio.wait_for(reader.read(), 30)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def openai_error(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


async def test_an_endless_header_is_refused_with_431_before_it_is_read(
    document_of, start_edge, start_node, until
) -> None:
    edge = await edge_with(document_of, start_edge, start_node, until)
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, b"GET /v1/models HTTP/1.1\r\n" + HEADERS + b"x-big: ")
    piece, sent, budget = b"a" * 65536, 0, 64 * 1024 * 1024
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
        answer = b""
        try:
            while sent < budget and not answer:
                await loop.sock_sendall(sock, piece)
                sent += len(piece)
                try:
                    answer = sock.recv(65536)
                except BlockingIOError:
                    pass
                if sent % (4 * 1024 * 1024) == 0:  # the Edge keeps serving others meanwhile
                    assert (await http.get("/healthz")).status_code == 200
        except (BrokenPipeError, ConnectionResetError):
            pass
        while not answer.endswith(b"}"):
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
            if not chunk:
                break
            answer += chunk
        sock.close()
        assert (await http.get("/healthz")).status_code == 200
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    error = openai_error(answer.partition(b"\r\n\r\n")[2])
    assert error["code"] == "request_header_fields_too_large"
    assert sent < budget  # refused long before the end of the header
    assert edge.http_server.refusals.counts["too_large"] == 1


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        pytest.param(b"".join(b"x-h%d: v\r\n" % i for i in range(150)), "headers", id="count"),
        pytest.param(b"x-one: " + b"a" * 20_000 + b"\r\n", "one header", id="one-header"),
        pytest.param(
            b"".join(b"x-h%d: %s\r\n" % (i, b"a" * 9000) for i in range(9)), "bytes", id="total"
        ),
    ],
)
async def test_too_many_or_too_large_headers_get_431(
    document_of, start_edge, start_node, until, extra: bytes, why: str
) -> None:
    edge = await edge_with(document_of, start_edge, start_node, until)
    reader, writer = await connect(edge.url)
    writer.write(b"GET /v1/models HTTP/1.1\r\n" + HEADERS + extra + b"\r\n")
    status, headers, body = await answer_of(reader)
    writer.close()
    assert status == 431
    assert headers["connection"] == "close"
    assert why in openai_error(body)["message"]


async def test_a_head_that_never_ends_gets_408_and_an_idle_connection_is_closed(
    document_of, start_edge, start_node, until
) -> None:
    edge = await edge_with(document_of, start_edge, start_node, until, header_timeout_ms=1000)
    idle_reader, idle_writer = await connect(edge.url)
    slow_reader, slow_writer = await connect(edge.url)
    opened = time.monotonic()
    slow_writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\n")
    status, _, body = await answer_of(slow_reader)
    assert status == 408
    assert openai_error(body)["code"] == "request_timeout"
    assert await asyncio.wait_for(idle_reader.read(), 30) == b""  # closed, nothing said
    assert time.monotonic() - opened < 1.0 + SLACK_S
    for writer in (idle_writer, slow_writer):
        writer.close()


async def test_connections_beyond_the_cap_get_503_and_real_requests_are_served_after(
    document_of, start_edge, start_node, until
) -> None:
    edge = await edge_with(
        document_of, start_edge, start_node, until, max_connections=8, header_timeout_ms=60_000
    )
    idle = [await connect(edge.url) for _ in range(8)]
    await until(lambda: edge.http_server.open_connections == 8)
    reader, writer = await connect(edge.url)
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
    status, headers, body = await answer_of(reader)
    writer.close()
    assert status == 503
    assert headers["retry-after"] == "1"
    assert openai_error(body)["code"] == "too_many_connections"
    for _, idle_writer in idle:
        idle_writer.close()
    await until(lambda: edge.http_server.open_connections == 0)
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
        assert (await http.get("/healthz")).status_code == 200


async def test_an_http_1_0_client_gets_a_stream_it_can_read(
    document_of, start_edge, start_node, until
) -> None:
    edge = await edge_with(document_of, start_edge, start_node, until)
    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    reader, writer = await connect(edge.url)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\n"
        + HEADERS
        + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body
    )
    status, headers, stream = await answer_of(reader)  # the connection's end ends the answer
    writer.close()
    assert status == 200
    assert "transfer-encoding" not in headers and headers["connection"] == "close"
    events = [line for line in stream.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(orjson.loads(event.removeprefix("data: ")) for event in events[:-1])


async def test_malformed_framing_gets_an_openai_400_and_the_log_stays_quiet(
    document_of, start_edge, start_node, until, caplog: pytest.LogCaptureFixture
) -> None:
    edge = await edge_with(document_of, start_edge, start_node, until)
    caplog.set_level(logging.INFO)
    for _ in range(40):
        reader, writer = await connect(edge.url)
        writer.write(b"\x16\x03\x01 NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = await answer_of(reader)
        writer.close()
        assert status == 400 and headers["content-type"] == "application/json"
        assert openai_error(body)["code"] == "malformed_http_request"
    assert edge.http_server.refusals.counts["malformed"] == 40
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # one line a minute, counted


async def test_a_body_nested_deeper_than_the_serializer_goes_gets_an_openai_400(
    document_of, start_edge, start_node, until
) -> None:
    edge = await edge_with(document_of, start_edge, start_node, until)
    deep: Any = []
    for _ in range(300):
        deep = [deep]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": deep}
    async with httpx.AsyncClient(
        base_url=edge.url, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, timeout=10
    ) as http:
        answer = await http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400, answer.text
        assert openai_error(answer.content)["type"] == "invalid_request_error"
        assert (await http.get("/healthz")).status_code == 200
    assert edge.dispatcher.in_flight("p1") == 0


@pytest.mark.parametrize(
    "coding",
    [
        pytest.param(b"gzip", id="gzip"),
        pytest.param(b"gzip, chunked", id="gzip-then-chunked"),
        pytest.param(b"identity", id="identity"),
    ],
)
async def test_a_transfer_encoding_other_than_chunked_gets_an_openai_400(
    document_of, start_edge, start_node, until, coding: bytes
) -> None:
    edge = await edge_with(document_of, start_edge, start_node, until)
    reader, writer = await connect(edge.url)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HEADERS
        + b"content-type: application/json\r\ntransfer-encoding: "
        + coding
        + b"\r\n\r\n\x1f\x8b\x08\x00compressed?"
    )
    status, headers, body = await answer_of(reader)
    writer.close()
    assert status == 400 and headers["connection"] == "close"
    error = openai_error(body)
    assert error["code"] == "malformed_http_request"
    assert "Transfer-Encoding" in error["message"] and coding.decode() in error["message"]
    assert edge.dispatcher.in_flight("p1") == 0
    # A chunked body is still read.
    reader, writer = await connect(edge.url)
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        + HEADERS
        + b"content-type: application/json\r\ntransfer-encoding: chunked\r\n"
        + b"connection: close\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(chat), chat)
    )
    status, _, body = await answer_of(reader)
    writer.close()
    assert status == 200, body
