"""The `openai` adapter: any OpenAI-compatible HTTP server (vLLM, Ollama, llama.cpp, TGI, OpenAI).

One `aiohttp.ClientSession` per adapter, opened on its first run, over a keep-alive pool of at
most `max_connections` connections. aiohttp rather than httpx: on this path the client's own
cost per request is most of the Node's, and httpx's (httpcore's pool, its layers of async
iterators) capped Edge -> Node -> upstream at a few hundred requests per second on two cores,
a tenth of what the Edge and the wire carry; aiohttp's C-parsed client costs a fraction of it.

Streaming runs read the upstream's SSE as it arrives, split it into events in one pass over each
read, and forward each event's `data` JSON object as a `RunChunk`. The Node always asks a
streaming upstream for usage (`stream_options.include_usage`) so the Edge can meter; it forwards
the usage-only chunk, marked, only when the client asked for it. aiohttp's errors are translated
here, once, into `RunFailed`s: connection refused, timeouts, a dropped connection and every
upstream error status get a code and a message that names what happened. Cancelling a run closes
its upstream connection at once (the upstream sees the client leave); a run that read its
response to the end gives the connection back to the pool. The API key is read from the
environment variable the config names, at build time; the key itself never travels or gets
logged.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any, Final

import aiohttp
import orjson

from iop.edgeconfig import OpenAIAdapterSettings as OpenAISettings
from iop.wire import (
    DEFAULT_MAX_RESPONSE_BYTES,
    ProviderHealth,
    RunChunk,
    RunDone,
    RunEvent,
    RunFailed,
    RunRequest,
    RunUsage,
    statuses,
)
from iop.wire.nodestates import ADAPTER_ERROR

from .base import Upstream, client_wants_usage, usage_from

__all__ = ["OpenAIAdapter"]

_PATHS: Final = {"chat": "/chat/completions", "completion": "/completions"}
_DONE: Final = b"[DONE]"
#: Idle seconds before the pool closes a keep-alive connection itself: below the 5 s idle
#: timeout of uvicorn (vLLM's server) and most others, so the Node, not the server, ends an idle
#: connection, and a POST (which aiohttp never retries) rarely meets one the server is closing.
_KEEPALIVE_S: Final = 4.0
#: Most bytes of an upstream's error body read (its message is what the Edge shows).
_ERROR_BODY_BYTES: Final = 64 * 1024


class OpenAIAdapter:
    """Implements `Adapter` for `adapter: {type: openai}`."""

    def __init__(self, provider_id: str, settings: OpenAISettings) -> None:
        self.provider_id = provider_id
        self.settings = settings
        self.closed = False
        self._problem = ""
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        if settings.api_key_env is not None:
            key = os.environ.get(settings.api_key_env)
            if key:
                self._headers["authorization"] = f"Bearer {key}"
            else:
                self._problem = f"environment variable {settings.api_key_env} is not set"
        self._urls = {kind: settings.base_url.rstrip("/") + path for kind, path in _PATHS.items()}
        self._session: aiohttp.ClientSession | None = None
        # The timeouts of every request; a run with a deadline adds `total` (see `run`).
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            # `connect` bounds the wait for a free pooled connection (httpx's pool timeout);
            # `sock_connect` the TCP connect itself; `sock_read` every wait for bytes.
            connect=settings.request_timeout_s,
            sock_connect=settings.connect_timeout_s,
            sock_read=settings.request_timeout_s,
        )
        # Runs holding or waiting for a pooled connection: tells a wait for a free connection
        # from a slow connect when aiohttp reports either as the same connection timeout.
        self._in_use = 0

    @property
    def health(self) -> ProviderHealth:
        if self.closed:
            return ProviderHealth(self.provider_id, False, "adapter closed", ADAPTER_ERROR)
        if self._problem:
            return ProviderHealth(self.provider_id, False, self._problem, ADAPTER_ERROR)
        return ProviderHealth(self.provider_id, True)

    @property
    def upstream(self) -> Upstream:
        return Upstream(self.settings.base_url, self._headers)

    async def aclose(self) -> None:
        self.closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _open(self) -> aiohttp.ClientSession:
        """The adapter's session; created in the running loop on the first run (aiohttp's
        connector binds to the loop it is created in)."""
        settings = self.settings
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=settings.max_connections, keepalive_timeout=_KEEPALIVE_S
            ),
            headers=self._headers,
            timeout=self._timeout,
            # Cookies an upstream sets for one client's run must never ride along on another's.
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )

    async def run(self, request: RunRequest) -> AsyncGenerator[RunEvent, None]:
        if self._problem:
            yield statuses.failure(statuses.PROVIDER_UNHEALTHY, self._problem)
            return
        if self.closed:
            yield statuses.failure(statuses.PROVIDER_UNHEALTHY, "the adapter is closed")
            return
        body = request.body
        limit = request.max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES
        wants_usage = False
        if request.stream:
            try:
                document = orjson.loads(body)
            except orjson.JSONDecodeError:
                yield statuses.failure(statuses.BAD_REQUEST, "the request body is not JSON")
                return
            if not isinstance(document, dict):
                yield statuses.failure(statuses.BAD_REQUEST, "the request body is not an object")
                return
            wants_usage = client_wants_usage(document)
            if not wants_usage:
                options = document.get("stream_options")
                options = dict(options) if isinstance(options, dict) else {}
                options["include_usage"] = True
                document["stream_options"] = options
                body = orjson.dumps(document)
        session = self._session
        if session is None:
            session = self._session = self._open()
        settings = self.settings
        timeout = self._timeout
        if request.deadline is not None:
            remaining = request.deadline - time.time()
            if remaining <= 0:
                yield statuses.failure(statuses.UPSTREAM_TIMEOUT, "the run's deadline passed")
                return
            # aiohttp's own `total` bounds the whole exchange, reads included, and never cancels
            # the consumer of this generator: an asyncio.timeout() here would stay armed across
            # each `yield` and could fire inside the caller's code instead.
            timeout = aiohttp.ClientTimeout(
                total=remaining,
                connect=timeout.connect,
                sock_read=timeout.sock_read,
                sock_connect=timeout.sock_connect,
            )
        queued = self._in_use >= settings.max_connections
        self._in_use += 1
        response: aiohttp.ClientResponse | None = None
        sent_chunk = False
        try:
            response = await session.post(
                self._urls[request.kind], data=body, allow_redirects=False, timeout=timeout
            )
            if response.status >= 400:
                detail = await _read_at_most(response, _ERROR_BODY_BYTES) or b""
                yield statuses.upstream_http_failure(response.status, detail)
                return
            if not request.stream:
                read = await _read_at_most(response, limit)
                if read is None:
                    yield _too_large(limit)
                    return
                data = read
                document = _decode(data)
                yield RunChunk(data)
                usage = usage_from(document)
                if usage is not None:
                    yield RunUsage(*usage)
                yield RunDone(_finish_reason(document))
                return
            # Everything that arrived is split at each turn (often a whole burst of events).
            # Read to the end even after [DONE], which the end of the body follows at once:
            # only a response read to its end gives its connection back to the pool.
            decoder = _StreamDecoder(wants_usage, limit)
            while piece := await response.content.readany():
                for chunk in decoder.feed(piece):
                    sent_chunk = True
                    yield chunk
            for event in decoder.end():
                yield event
        except aiohttp.ConnectionTimeoutError:
            if queued:
                yield _failed(
                    statuses.PROVIDER_BUSY,
                    f"all {settings.max_connections} connections to the upstream are busy",
                    sent_chunk,
                )
            else:
                yield _failed(
                    statuses.UPSTREAM_UNAVAILABLE,
                    f"no connection to {settings.base_url} within {settings.connect_timeout_s:g}s",
                    sent_chunk,
                )
        except aiohttp.ServerTimeoutError:
            yield _failed(
                statuses.UPSTREAM_TIMEOUT,
                f"the upstream sent nothing for {settings.request_timeout_s:g}s",
                sent_chunk,
            )
        except TimeoutError:  # after aiohttp's own timeouts, which are TimeoutErrors too
            yield _failed(statuses.UPSTREAM_TIMEOUT, "the run's deadline passed", sent_chunk)
        except aiohttp.ClientConnectorError as exc:
            yield _failed(
                statuses.UPSTREAM_UNAVAILABLE,
                f"cannot connect to {settings.base_url}: {_reason(exc.os_error)}",
                sent_chunk,
            )
        except (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientPayloadError,
            aiohttp.ClientOSError,
            aiohttp.ClientConnectionResetError,
        ) as exc:
            when = "before it answered" if response is None else "mid-response"
            yield _failed(
                statuses.UPSTREAM_ERROR,
                f"the upstream dropped the connection {when} ({exc or type(exc).__name__})",
                sent_chunk,
            )
        except aiohttp.ClientError as exc:
            yield _failed(statuses.UPSTREAM_ERROR, f"upstream request failed: {exc!r}", sent_chunk)
        except _Malformed as exc:
            yield _failed(statuses.UPSTREAM_ERROR, str(exc), sent_chunk)
        except _TooLarge:
            yield _too_large(limit)
        finally:
            self._in_use -= 1
            if response is not None:
                # A response read to its end gave its connection back to the pool already;
                # otherwise (cancelled, failed, cut short) this closes the connection at once.
                response.close()


def _reason(error: OSError) -> str:
    """`Connection refused` rather than aiohttp's `Connect call failed ('10.0.0.1', 8000)`."""
    if isinstance(error, socket.gaierror) or not error.errno or error.errno < 0:
        return error.strerror or str(error)
    return os.strerror(error.errno)


class _Malformed(Exception):
    """The upstream answered something that is not OpenAI's response format."""


class _TooLarge(Exception):
    """The upstream's answer (or one event of its stream) is larger than the run allows."""


def _too_large(limit: int) -> RunFailed:
    return statuses.failure(
        statuses.RESPONSE_TOO_LARGE,
        f"the upstream's answer is larger than {limit} bytes (openai.max_response_bytes); "
        "ask for a stream",
    )


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes: nothing more is read (the connection is
    closed, not pooled), so memory is bounded by the limit whatever the upstream sends."""
    length = response.content_length
    if length is not None and length > limit:
        return None
    parts: list[bytes] = []
    size = 0
    while piece := await response.content.readany():
        size += len(piece)
        if size > limit:
            return None
        parts.append(piece)
    return b"".join(parts)


def _failed(code: str, message: str, sent_chunk: bool) -> RunFailed:
    failed = statuses.failure(code, message)
    if sent_chunk and failed.retryable:
        return RunFailed(failed.code, failed.message, False, failed.status)
    return failed


def _decode(data: bytes) -> dict[str, Any]:
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _Malformed(f"the upstream sent something that is not JSON: {data[:80]!r}") from None
    if not isinstance(document, dict):
        raise _Malformed("the upstream sent JSON that is not an object")
    return document


def _finish_reason(document: dict[str, Any]) -> str | None:
    choices = document.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                return str(choice["finish_reason"])
    return None


class _StreamDecoder:
    """An SSE body, fed as it arrives, as run events: a chunk per `data` object, then the usage
    and `RunDone` at the end. Plain generators: a malformed event fails after the good ones
    before it went out."""

    def __init__(self, wants_usage: bool, limit: int) -> None:
        self._wants_usage = wants_usage
        self._limit = limit
        # An event not complete yet; grows in place, and only its new bytes are searched for
        # the event's end: an event arriving in thousands of pieces costs linear time.
        self._buffer = bytearray()
        self._cr = False  # the last piece ended with "\r": a "\r\n" may straddle two pieces
        self._done = False
        self._usage: tuple[int, int, int] | None = None
        self._finish: str | None = None

    def feed(self, piece: bytes) -> Iterator[RunChunk]:
        """The chunks `piece` completes. Raises `_TooLarge` when an event grows past the
        limit."""
        if self._cr:
            piece, self._cr = b"\r" + piece, False
        if b"\r" in piece:
            if piece.endswith(b"\r"):
                piece, self._cr = piece[:-1], True
            piece = piece.replace(b"\r\n", b"\n")
        buffer = self._buffer
        if not buffer:
            *events, rest = piece.split(b"\n\n")
        else:
            start = len(buffer) - 1
            buffer += piece
            if buffer.find(b"\n\n", start) < 0:
                if len(buffer) > self._limit:
                    raise _TooLarge
                return iter(())
            *events, rest = bytes(buffer).split(b"\n\n")
        if len(rest) > self._limit:
            raise _TooLarge
        self._buffer = bytearray(rest)
        return self._chunks(events)

    def end(self) -> Iterator[RunEvent]:
        """The last events once the body ended (its last event may lack the blank line)."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        if rest:
            yield from self._chunks([rest])
        if self._usage is not None:
            yield RunUsage(*self._usage)
        yield RunDone(self._finish)

    def _chunks(self, events: list[bytes]) -> Iterator[RunChunk]:
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                data: bytes | None = event[6:]
            else:
                data = _event_data(event)
            if data is None or self._done:
                continue
            if data == _DONE:
                self._done = True
                continue
            document = _decode(data)
            choices = document.get("choices")
            # Most chunks carry no usage or `"usage": null`: skip the lookup for those.
            found = None if document.get("usage") is None else usage_from(document)
            if found is not None:
                self._usage = found
                if not choices:
                    if self._wants_usage:
                        yield RunChunk(data, usage_only=True)
                    continue
            self._finish = _finish_reason(document) or self._finish
            yield RunChunk(data)


def _event_data(event: bytes) -> bytes | None:
    """The `data` of one server-sent event, as bytes (multi-line data joined by newlines)."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None
