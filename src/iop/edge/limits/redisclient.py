"""A lean Redis client for the limit store: one pipelined connection, hiredis's parser.

Why not redis-py's asyncio client: on the admission path its connection pool, per-command locks
and response callbacks cost far more than the round trip (docs/benchmarks.md, "Limits per
principal", has the figures). The store needs a handful of commands (AUTH, SELECT, EVALSHA,
SCRIPT LOAD, SET): written as RESP arrays on one connection, each waits on a future that the
replies, in order, resolve first in, first out, so concurrent admissions share the connection
and its round trips; `hiredis.Reader` parses the replies. Every failure is a `RedisError` of
this module; the connection is dropped on any but an error reply, and the next call dials again.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import urlsplit

import hiredis

Arg = str | bytes | int | float


class RedisError(Exception):
    """Redis could not be reached or did not answer in time."""


class ReplyError(RedisError):
    """Redis answered with an error (`-ERR ...`)."""


def _encode(args: Sequence[Arg]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.reader = hiredis.Reader()
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no subclass of asyncio.Transport, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(RedisError(f"malformed reply: {exc}"))
                if self.transport is not None:
                    self.transport.close()
                return
            if reply is False:
                return
            if not self.waiting:
                continue  # an answer nobody waits for (its caller timed out): dropped
            future = self.waiting.popleft()
            if future.done():
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(ReplyError(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("connection closed")
        self._fail(RedisError(f"connection lost: {self.lost!r}"))

    def _fail(self, error: RedisError) -> None:
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)


def _abandon(futures: list[asyncio.Future[Any]]) -> None:
    """Nobody waits for these any more: a failure that reached them, or reaches them later (the
    connection's end), is retrieved here, so asyncio logs no "exception was never retrieved"."""
    for future in futures:
        if not future.done():
            future.cancel()  # its reply, if one comes, is skipped (`data_received`)
        elif not future.cancelled():
            future.exception()


class RedisClient:
    """`await client.call("SET", "k", "v")`; one connection, dialled on first use."""

    def __init__(
        self,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 0.25,
    ) -> None:
        parts = urlsplit(url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 6379
        self._tls = parts.scheme == "rediss"
        self._db = int(parts.path.strip("/") or 0)
        self._username = username
        self._password = password
        self._timeout = timeout
        self._protocol: _Protocol | None = None
        self._dialing: asyncio.Lock | None = None
        self._scripts: dict[str, str] = {}

    async def call(self, *args: Arg) -> Any:
        """One command's reply; raises `RedisError` (and drops the connection) on failure."""
        (reply,) = await self.pipeline([args])
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Each command's reply (an error reply as a `ReplyError` in its place), in one write."""
        try:
            async with asyncio.timeout(self._timeout):
                protocol = await self._connected()
                return await self._send(protocol, commands)
        except TimeoutError as exc:
            self._drop()
            raise RedisError(f"no answer within {self._timeout * 1000:g} ms") from exc
        except OSError as exc:
            self._drop()
            raise RedisError(f"{type(exc).__name__}: {exc}") from exc

    async def _send(self, protocol: _Protocol, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        transport = protocol.transport
        if transport is None or transport.is_closing():
            raise RedisError("connection closed")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        protocol.waiting.extend(futures)
        transport.write(b"".join(_encode(command) for command in commands))
        replies: list[Any] = []
        try:
            for future in futures:
                try:
                    replies.append(await future)
                except ReplyError as error:
                    replies.append(error)
        except RedisError:
            _abandon(futures)
            self._drop()
            raise
        except BaseException:  # a timeout or a cancellation: later replies are skipped
            _abandon(futures)
            raise
        return replies

    def script(self, source: str) -> str:
        """Register a Lua script; its SHA-1 for `evalsha`."""
        digest = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        self._scripts[digest] = source
        return digest

    async def evalsha(self, digest: str, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run a registered script, loading it first when Redis does not have it (a restart)."""
        command = ("EVALSHA", digest, len(keys), *keys, *args)
        try:
            return await self.call(*command)
        except ReplyError as error:
            if not str(error).startswith("NOSCRIPT"):
                raise
        await self.call("SCRIPT", "LOAD", self._scripts[digest])
        return await self.call(*command)

    def evalsha_command(self, digest: str, args: Sequence[Arg]) -> tuple[Arg, ...]:
        return ("EVALSHA", digest, 0, *args)

    async def load_scripts(self) -> None:
        for source in self._scripts.values():
            await self.call("SCRIPT", "LOAD", source)

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.lost is None:
            return protocol
        if self._dialing is None:
            self._dialing = asyncio.Lock()
        async with self._dialing:
            protocol = self._protocol
            if protocol is not None and protocol.lost is None:
                return protocol
            loop = asyncio.get_running_loop()
            context = ssl.create_default_context() if self._tls else None
            _, protocol = await loop.create_connection(
                _Protocol, self._host, self._port, ssl=context
            )
            hello: list[Sequence[Arg]] = []
            if self._password is not None:
                auth: tuple[Arg, ...] = ("AUTH", self._password)
                if self._username is not None:
                    auth = ("AUTH", self._username, self._password)
                hello.append(auth)
            if self._db:
                hello.append(("SELECT", self._db))
            for reply in await self._send(protocol, hello) if hello else []:
                if isinstance(reply, ReplyError):
                    if protocol.transport is not None:
                        protocol.transport.close()
                    raise RedisError(f"refused: {reply}")
            self._protocol = protocol
            return protocol

    def _drop(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()

    async def close(self) -> None:
        self._drop()
