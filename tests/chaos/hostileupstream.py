"""An OpenAI-compatible server that answers too much, run as a process of its own.

    python tests/chaos/hostileupstream.py [--size BYTES]

It prints one JSON line once it listens, `{"port": N}`, and answers each chat completion as
the request's `model` says: `length` (a body of `size` bytes, with its length), `chunked` (the
same without one), `event` (a stream whose first event never ends: `size` bytes without a blank
line), `error` (a 500 whose body is `size` bytes), `whole` (a valid answer whose content is
5 MiB: larger than a wire message, under the tests' bound).

Its heads and framings are hostile in these: `long-header` (a 64 MiB header value, then a fair
answer), `many-headers` (100 MB of small headers), `continues` (2 million `100 Continue` heads),
`redirect` (a 301 whose body is a fair completion), `status-000` and `status-099` (a head of
that status, then a fair answer), `cr` (a stream with an event whose data line holds a lone CR
and fields after it), `comments` (a stream of SSE comments that never ends) and `idle-bytes` (a
fair answer, then, while the connection is idle, the head of another; it prints
`{"stray": "closed"}` once the client closes that connection). `fair` is a small valid answer.
What a model server that cannot run here would do at its worst; the stand-in for it in
`test_bounded_answers.py`, `test_hostile_heads.py` and `bench/hostile.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

import orjson

PIECE = b"a" * (1024 * 1024)
#: The content of a `whole` answer.
WHOLE_BYTES = 5 * len(PIECE)


def completion_parts() -> tuple[bytes, bytes]:
    """The head and tail of a chat completion around its content."""
    head = b'{"id":"chatcmpl-big","object":"chat.completion","created":0,"model":"served",'
    head += b'"choices":[{"index":0,"message":{"role":"assistant","content":"'
    tail = b'"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
    tail += b'"total_tokens":2}}'
    return head, tail


def head_of(status: int, kind: bytes, length: int | None) -> bytes:
    framing = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\n%s\r\n\r\n" % (status, kind, framing)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def fair() -> bytes:
    """A small valid chat completion, head and body."""
    head, tail = completion_parts()
    body = head + b"fair" + tail
    return head_of(200, b"application/json", len(body)) + body


def delta(content: bytes, finish: bytes = b"null") -> bytes:
    return (
        b'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"served",'
        b'"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":%s}]}\n\n'
        % (content, finish)
    )


#: What the hostile head modes write, in pieces, after which a fair answer follows.
HEAD_BYTES = 64 * 1024 * 1024
SMALL_HEADERS_BYTES = 100 * 1000 * 1000
CONTINUES = 2_000_000


async def hostile_head(writer: asyncio.StreamWriter, mode: str) -> None:
    if mode == "long-header":
        writer.write(b"HTTP/1.1 200 OK\r\nx-long: ")
        for _ in range(HEAD_BYTES // len(PIECE)):
            writer.write(PIECE)
            await writer.drain()
        writer.write(b"\r\n")
    elif mode == "many-headers":
        writer.write(b"HTTP/1.1 200 OK\r\n")
        lines = b"x: y\r\n" * (len(PIECE) // 6)
        for _ in range(SMALL_HEADERS_BYTES // len(lines)):
            writer.write(lines)
            await writer.drain()
    else:  # continues
        heads = b"HTTP/1.1 100 Continue\r\n\r\n" * 10_000
        for _ in range(CONTINUES // 10_000):
            writer.write(heads)
            await writer.drain()
    answer = fair()
    writer.write(answer[answer.index(b"\r\n") + 2 :] if mode != "continues" else answer)
    await writer.drain()


async def odd(writer: asyncio.StreamWriter, mode: str) -> None:
    """The modes whose framing, not size, is hostile."""
    if mode in ("status-000", "status-099"):
        writer.write(b"HTTP/1.1 %s X\r\n\r\n" % mode[-3:].encode() + fair())
    elif mode == "redirect":
        answer = fair()
        moved = b"HTTP/1.1 301 Moved Permanently\r\nlocation: /elsewhere"
        writer.write(moved + answer[answer.index(b"\r\n") :])
    elif mode == "cr":
        # Events after the one with the CR: it is not among the last ones of the read.
        slipped = b'data: {"choices":[]}\revent: error\rdata: {"error":{"message":"injected"}}\n\n'
        events = delta(b"a") + slipped + delta(b"b") + delta(b"c") + delta(b"d", b'"stop"')
        writer.write(head_of(200, b"text/event-stream", None) + chunk(events))
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    elif mode == "comments":
        writer.write(head_of(200, b"text/event-stream", None))
        while True:
            writer.write(chunk(b": still thinking\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)
    await writer.drain()


ODD = ("status-000", "status-099", "redirect", "cr", "comments")


async def answer(writer: asyncio.StreamWriter, mode: str, size: int) -> None:
    head, tail = completion_parts()
    if mode == "whole":
        body = head + PIECE * (WHOLE_BYTES // len(PIECE)) + tail
        writer.write(head_of(200, b"application/json", len(body)) + body)
        await writer.drain()
        return
    if mode in ("length", "error"):
        status = 200 if mode == "length" else 500
        writer.write(head_of(status, b"application/json", len(head) + size + len(tail)) + head)
        for _ in range(size // len(PIECE)):
            writer.write(PIECE)
            await writer.drain()
        writer.write(PIECE[: size % len(PIECE)] + tail)
        await writer.drain()
        return
    kind = b"text/event-stream" if mode == "event" else b"application/json"
    event = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"'
    writer.write(head_of(200, kind, None) + chunk(event if mode == "event" else head))
    for _ in range(size // len(PIECE)):
        writer.write(chunk(PIECE))
        await writer.drain()
    writer.write(chunk(tail) + b"0\r\n\r\n")
    await writer.drain()


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, size: int) -> None:
    stray = False
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                if stray:  # the client closed the connection that spoke out of turn
                    sys.stdout.write('{"stray": "closed"}\n')
                    sys.stdout.flush()
                raise
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length)
            if head.startswith(b"GET"):
                listing = b'{"object":"list","data":[]}'
                writer.write(head_of(200, b"application/json", len(listing)) + listing)
                await writer.drain()
                continue
            mode = str(orjson.loads(body).get("model", "whole"))
            if mode in ("long-header", "many-headers", "continues"):
                await hostile_head(writer, mode)
            elif mode in ODD:
                await odd(writer, mode)
            elif mode == "fair" or (mode == "idle-bytes" and stray):
                writer.write(fair())
                await writer.drain()
            elif mode == "idle-bytes":
                writer.write(fair())
                await writer.drain()
                await asyncio.sleep(0.2)  # the connection waits in the client's pool
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
                await writer.drain()
                stray = True
            else:
                await answer(writer, mode, size)
    writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=108 * 1000 * 1000)
    args = parser.parse_args()
    server = await asyncio.start_server(
        lambda r, w: serve(r, w, args.size), "127.0.0.1", 0, limit=1024 * 1024
    )
    port = server.sockets[0].getsockname()[1]
    sys.stdout.write(orjson.dumps({"port": port}).decode() + "\n")
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
