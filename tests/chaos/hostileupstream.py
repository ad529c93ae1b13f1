"""An OpenAI-compatible server that answers too much, run as a process of its own.

    python tests/chaos/hostileupstream.py [--size BYTES]

It prints one JSON line once it listens, `{"port": N}`, and answers each chat completion as
the request's `model` says: `length` (a body of `size` bytes, with its length), `chunked` (the
same without one), `event` (a stream whose first event never ends: `size` bytes without a blank
line), `error` (a 500 whose body is `size` bytes), `whole` (a valid answer whose content is
5 MiB: larger than a wire message, under the tests' bound). What a model server that cannot run
here would do at its worst; the stand-in for it in `test_bounded_answers.py` and
`bench/hostile.py`.
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
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
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
            await answer(writer, str(orjson.loads(body).get("model", "whole")), size)
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
