"""The chaos suite's tools (the `kit` fixture): faults injected into real processes and sockets.

Every test here injects one fault class of docs/reliability.md (a frozen process, a duplicate
node, a slow client, a hostile request) and checks what the product does about it. Each test is
bounded (`pytest.mark.timeout`), waits for positive signals, and asserts bounds that are
correctness properties ("detected before the deadline plus a generous slack"), never speed.

- `two_nodes_document(document_of)`: the config of one model on two nodes (`node-1`,
  `node-2`), each with one fake-adapter provider, over the tests' mutual TLS; `token_files`
  writes their tokens.
- `frozen(process)`: SIGSTOP while inside the block, SIGCONT on the way out (always).
- `rss_mb(pid)`: a process's resident memory, from /proc.
- `chat(...)`: one chat completion over httpx, as a tuple of (status, body text), streamed or not.
- `open_stream(url, max_tokens, ...)`: a raw streaming request whose client reads nothing.
- `Load`: clients sending requests back to back (streamed and not) until stopped, recording
  every outcome; `failed` lists what did not end well.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from testkit import CLIENT_TOKEN, node_token_of, provider

NODE_TOKENS = {node_id: node_token_of(node_id) for node_id in ("node-1", "node-2")}


def two_nodes_document(
    build_document: Callable[..., dict[str, Any]],
    *,
    adapter: dict[str, Any] | None = None,
    priorities: tuple[int, int] = (0, 0),
    capacity: int = 8,
    **options: Any,
) -> dict[str, Any]:
    """Model `m` served by p1 on node-1 and p2 on node-2 (fake adapters unless `adapter`)."""
    settings = adapter or {"type": "fake", "completion_tokens": 4}
    nodes = {
        f"node-{n}": [provider(f"p{n}", settings, capacity=capacity, priority=priority)]
        for n, priority in enumerate(priorities, start=1)
    }
    return build_document(nodes=nodes, **options)


def token_files(folder: Path) -> dict[str, Path]:
    """The nodes' token files in `folder`."""
    files = {}
    for node_id, token in NODE_TOKENS.items():
        path = folder / f"{node_id}.token"
        path.write_text(token)
        files[node_id] = path
    return files


@contextlib.asynccontextmanager
async def frozen(pid: int) -> AsyncIterator[None]:
    """The process is stopped (SIGSTOP: its sockets stay open) inside the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid`, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no VmRSS for process {pid}")


async def chat(
    http: httpx.AsyncClient, *, stream: bool = False, model: str = "m", **body: Any
) -> tuple[int, str]:
    """POST /v1/chat/completions; (status, whole body text). A stream is read to its end."""
    document = {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}
    if stream:
        document["stream"] = True
        async with http.stream("POST", "/v1/chat/completions", json=document) as response:
            text = "".join([part async for part in response.aiter_text()])
            return response.status_code, text
    response = await http.post("/v1/chat/completions", json=document)
    return response.status_code, response.text


async def open_stream(
    url: str,
    max_tokens: int,
    *,
    receive_buffer: int | None = None,
    model: str = "m",
    key: str = CLIENT_TOKEN,
    source: str | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw client that sends one streaming request and reads nothing until told to (from
    address `source`, a loopback address other than 127.0.0.1 to be another client)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    if source is not None:
        sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    # A reader buffering at most 16 KiB: past that the kernel's buffers fill and the Edge's
    # writes stall, as with a client that stops reading.
    reader, writer = await asyncio.open_connection(sock=sock, limit=8 * 1024)
    body = orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": max_tokens,
        }
    )
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + key.encode() + b"\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    await writer.drain()
    return reader, writer


def stream_ok(status: int, text: str) -> bool:
    """A stream that ended well: 200, no error event, and `[DONE]`."""
    return status == 200 and '"error"' not in text and text.rstrip().endswith("data: [DONE]")


def error_code(text: str) -> str | None:
    """The OpenAI error code in a body or the last SSE event of a stream, if any."""
    for line in reversed(text.strip().splitlines()):
        payload = line.removeprefix("data: ")
        if payload.startswith("{"):
            document = orjson.loads(payload)
            error = document.get("error") if isinstance(document, dict) else None
            return error.get("code") if isinstance(error, dict) else None
    return None


@dataclass
class Load:
    """`workers` clients of `http`, each sending requests back to back until `stop()`."""

    http: httpx.AsyncClient
    workers: int = 4
    outcomes: list[tuple[bool, int, str]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> Load:
        for index in range(self.workers):
            self._tasks.append(asyncio.create_task(self._client(index), name=f"load-{index}"))
        return self

    async def _client(self, index: int) -> None:
        stream = bool(index % 2)
        while not self._stopping.is_set():
            try:
                status, text = await chat(self.http, stream=stream)
            except httpx.HTTPError as exc:
                self.outcomes.append((False, 0, repr(exc)))
                continue
            ok = stream_ok(status, text) if stream else status == 200
            self.outcomes.append((ok, status, "" if ok else text[-300:]))

    @property
    def served(self) -> int:
        return sum(ok for ok, _, _ in self.outcomes)

    @property
    def failed(self) -> list[tuple[bool, int, str]]:
        return [outcome for outcome in self.outcomes if not outcome[0]]

    async def stop(self) -> None:
        """Let every request in flight finish, then stop."""
        self._stopping.set()
        await asyncio.gather(*self._tasks)


class ChaosKit:
    """The helpers above, for the tests (fixture `kit`)."""

    node_tokens = NODE_TOKENS
    two_nodes_document = staticmethod(two_nodes_document)
    token_files = staticmethod(token_files)
    frozen = staticmethod(frozen)
    rss_mb = staticmethod(rss_mb)
    chat = staticmethod(chat)
    open_stream = staticmethod(open_stream)
    stream_ok = staticmethod(stream_ok)
    error_code = staticmethod(error_code)
    Load = Load


@pytest.fixture(scope="session")
def kit() -> ChaosKit:
    return ChaosKit()
