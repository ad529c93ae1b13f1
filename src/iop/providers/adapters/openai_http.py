"""The `openai` adapter: any OpenAI-compatible HTTP server (vLLM, Ollama, llama.cpp, TGI, OpenAI).

One `UpstreamClient` (`upstreams.py`) per adapter. A stream's reads are passed on whole, as
`RunChunk(sse=True)`, when the Edge asks for `sse_chunks` and each read is plain `data:` lines;
otherwise each event is parsed and sent as its JSON object (`_StreamDecoder`). Usage is always
asked of a streaming upstream, and the usage-only chunk forwarded only when the client asked.
The client's errors become `RunFailed`s here, once (`_failure`). docs/architecture.md ("The data
path of one request", "The providers") says why it is so.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any, Final
from urllib.parse import quote

import orjson

from iop.edgeconfig import OpenAIAdapterSettings as OpenAISettings
from iop.edgeconfig import UpstreamPolicy
from iop.wire import (
    ADAPTER_ERROR,
    DEFAULT_MAX_RESPONSE_BYTES,
    RESPONSE_LOOKUPS,
    ProviderHealth,
    RunChunk,
    RunDone,
    RunEvent,
    RunFailed,
    RunRequest,
    RunUsage,
    statuses,
)

from .base import Upstream, client_wants_usage, usage_from
from .upstreams import (
    BadResponse,
    ConnectFailed,
    ConnectTimeout,
    DeadlinePassed,
    Disconnected,
    NotAllowed,
    PoolTimeout,
    ReadTimeout,
    Response,
    UpstreamClient,
    UpstreamError,
)

_PATHS: Final = {
    "chat": "/chat/completions",
    "completion": "/completions",
    "embedding": "/embeddings",
    "response": "/responses",
}
_DONE: Final = b"[DONE]"
#: The list every OpenAI answer of a kind holds: what tells a model server's 2xx from another's.
_ANSWER_LIST: Final = {
    "chat": "choices",
    "completion": "choices",
    "embedding": "data",
    "response": "output",
}
#: A stored response's routes: (method, the path after /responses/{id}).
_LOOKUPS: Final = {
    "response_retrieve": (b"GET", ""),
    "response_delete": (b"DELETE", ""),
    "response_cancel": (b"POST", "/cancel"),
}
#: Idle seconds after which the pool closes a keep-alive connection instead of using it: below
#: the 5 s idle timeout of uvicorn (vLLM's server) and most others, so the client, not the
#: server, ends an idle connection, and a POST (never retried) rarely meets one being closed.
_KEEPALIVE_S: Final = 4.0
#: Most bytes of an upstream's error body read (its message is what the Edge shows).
_ERROR_BODY_BYTES: Final = 64 * 1024


class OpenAIAdapter:
    """Implements `Adapter` for `adapter: {type: openai}`."""

    def __init__(
        self, provider_id: str, settings: OpenAISettings, policy: UpstreamPolicy | None = None
    ) -> None:
        self.provider_id = provider_id
        self.settings = settings
        self.closed = False
        self._policy = policy
        self._problem = ""
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        #: Why the upstream policy refuses this provider (never probed, never called then).
        self._refused = "; ".join(
            problem for _, problem in (policy.url_problems(provider_id, settings) if policy else ())
        )
        if self._refused:
            self._problem = self._refused  # and its key, whatever it is, is never read
        elif settings.api_key_env is not None:
            key = os.environ.get(settings.api_key_env)
            if key and ("\r" in key or "\n" in key):
                self._problem = f"environment variable {settings.api_key_env} holds a line break"
            elif key:
                self._headers["authorization"] = f"Bearer {key}"
            else:
                self._problem = f"environment variable {settings.api_key_env} is not set"
        self._client: UpstreamClient | None = None

    @property
    def problem(self) -> str:
        return self._problem

    @property
    def health(self) -> ProviderHealth:
        if self.closed:
            return ProviderHealth(self.provider_id, False, "adapter closed", ADAPTER_ERROR)
        if self._problem:
            return ProviderHealth(self.provider_id, False, self._problem, ADAPTER_ERROR)
        return ProviderHealth(self.provider_id, True)

    @property
    def upstream(self) -> Upstream | None:
        if self._refused:
            return None
        return Upstream(self.settings.base_url, self._headers)

    async def aclose(self) -> None:
        self.closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _open(self) -> UpstreamClient:
        """The adapter's client; made in the running loop on the first run."""
        settings = self.settings
        return UpstreamClient(
            settings.base_url,
            self._headers,
            max_connections=settings.max_connections,
            connect_timeout=settings.connect_timeout_s,
            # Also how long a run may wait for a free connection of a full pool.
            read_timeout=settings.request_timeout_s,
            keepalive_s=_KEEPALIVE_S,
            policy=self._policy,
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
        if request.kind in RESPONSE_LOOKUPS:
            async for event in self._lookup(request, limit):
                yield event
            return
        if request.stream and request.kind != "response":  # a Responses stream has its usage
            prepared = _asking_for_usage(body)
            if isinstance(prepared, RunFailed):
                yield prepared
                return
            body, wants_usage = prepared
        if request.deadline is not None and request.deadline <= time.time():
            yield statuses.failure(statuses.UPSTREAM_TIMEOUT, "the run's deadline passed")
            return
        client = self._client
        if client is None:
            client = self._client = self._open()
        settings = self.settings
        response: Response | None = None
        sent_chunk = False
        try:
            traceparent = request.traceparent
            head = b"traceparent: %s\r\n" % traceparent.encode("ascii") if traceparent else b""
            response = await client.post(_PATHS[request.kind], body, request.deadline, head)
            if response.status >= 300:  # a redirect's body is not the answer either
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
                if not isinstance(document.get(_ANSWER_LIST[request.kind]), list):
                    # Not an answer of this kind: a server that is not a model server (an API
                    # server, a metadata service) answering 2xx, whose body is not for the client.
                    raise _Malformed(
                        f"the upstream's answer has no {_ANSWER_LIST[request.kind]} list: "
                        f"not an OpenAI {request.kind} answer"
                    )
                yield RunChunk(data)
                usage = usage_from(document)
                if usage is not None:
                    yield RunUsage(*usage)
                yield RunDone(_finish_reason(document))
                return
            if request.kind == "response":
                decoder: _StreamDecoder | _ResponseEvents = _ResponseEvents(limit)
            else:
                decoder = _StreamDecoder(wants_usage, limit, request.sse_chunks)
            # Everything that arrived is split at each turn (often a whole burst of events).
            # Read to the end even after [DONE], which the end of the body follows at once:
            # only a response read to its end gives its connection back to the pool.
            # Comments and empty events are not news: the read timeout bounds the wait for the
            # next chunk, or an upstream sending only those would hold the run for ever.
            news = time.monotonic()
            while piece := await response.read_some():
                for chunk in decoder.feed(piece):
                    sent_chunk = True
                    news = time.monotonic()
                    yield chunk
                if time.monotonic() - news > settings.request_timeout_s:
                    raise _NoEvents
            for event in decoder.end():
                yield event
        except (UpstreamError, _Malformed, _TooLarge, _NoEvents) as exc:
            failed = _failure(exc, settings, limit)
            if sent_chunk and failed.retryable:  # the client has bytes: another try cannot help
                failed = RunFailed(failed.code, failed.message, False, failed.status)
            yield failed
        finally:
            if response is not None:
                # A response read to its end gave its connection back to the pool already;
                # otherwise (cancelled, failed, cut short) this closes the connection at once.
                response.close()

    async def _lookup(self, request: RunRequest, limit: int) -> AsyncGenerator[RunEvent, None]:
        """A stored response's retrieve, delete or cancel: the upstream's answer, whole."""
        method, suffix = _LOOKUPS[request.kind]
        path = f"/responses/{quote(request.response_id, safe='')}{suffix}"
        client = self._client
        if client is None:
            client = self._client = self._open()
        response: Response | None = None
        try:
            response = await client.send(method, path, b"", request.deadline)
            if response.status >= 300:
                detail = await _read_at_most(response, _ERROR_BODY_BYTES) or b""
                yield statuses.upstream_http_failure(response.status, detail)
                return
            data = await _read_at_most(response, limit)
            if data is None:
                yield _too_large(limit)
                return
            _decode(data)  # an object, as every answer of these routes is
            yield RunChunk(data)
            yield RunDone(None)
        except (UpstreamError, _Malformed) as exc:
            yield _failure(exc, self.settings, limit)
        finally:
            if response is not None:
                response.close()


def _asking_for_usage(body: bytes) -> tuple[bytes, bool] | RunFailed:
    """A streaming request's body as sent upstream, which always asks for the usage chunk, and
    whether the client asked for it too (then it is forwarded); or why the body cannot go."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return statuses.failure(statuses.BAD_REQUEST, "the request body is not JSON")
    if not isinstance(document, dict):
        return statuses.failure(statuses.BAD_REQUEST, "the request body is not an object")
    if client_wants_usage(document):
        return body, True
    options = document.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    document["stream_options"] = options
    return orjson.dumps(document), False


def _reason(error: OSError) -> str:
    """`Connection refused` rather than `Connect call failed ('10.0.0.1', 8000)`."""
    if isinstance(error, socket.gaierror) or not error.errno or error.errno < 0:
        return error.strerror or str(error)
    return os.strerror(error.errno)


class _Malformed(Exception):
    """The upstream answered something that is not OpenAI's response format."""


class _NoEvents(Exception):
    """The upstream's stream went on without an event for the client for the read timeout."""


class _TooLarge(Exception):
    """The upstream's answer (or one event of its stream) is larger than the run allows."""


def _too_large(limit: int) -> RunFailed:
    return statuses.failure(
        statuses.RESPONSE_TOO_LARGE,
        f"the upstream's answer is larger than {limit} bytes (openai.max_response_bytes); "
        "ask for a stream",
    )


async def _read_at_most(response: Response, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes: nothing more is read (the connection is
    closed, not pooled), so memory is bounded by the limit whatever the upstream sends."""
    length = response.content_length
    if length is not None and length > limit:
        return None
    parts: list[bytes] = []
    size = 0
    while piece := await response.read_some():
        size += len(piece)
        if size > limit:
            return None
        parts.append(piece)
    return b"".join(parts)


def _failure(error: Exception, settings: OpenAISettings, limit: int) -> RunFailed:
    """The one translation of what a run's exchange with the upstream raised into a
    `RunFailed`."""
    if isinstance(error, PoolTimeout):
        message = f"all {settings.max_connections} connections to the upstream are busy"
        return statuses.failure(statuses.PROVIDER_BUSY, message)
    if isinstance(error, ConnectTimeout):
        return statuses.failure(
            statuses.UPSTREAM_UNAVAILABLE,
            f"no connection to {settings.base_url} within {settings.connect_timeout_s:g}s",
        )
    if isinstance(error, ConnectFailed):
        return statuses.failure(
            statuses.UPSTREAM_UNAVAILABLE,
            f"cannot connect to {settings.base_url}: {_reason(error.os_error)}",
        )
    if isinstance(error, NotAllowed):
        return statuses.failure(
            statuses.UPSTREAM_UNAVAILABLE, f"cannot connect to {settings.base_url}: {error}"
        )
    if isinstance(error, ReadTimeout):
        return statuses.failure(
            statuses.UPSTREAM_TIMEOUT,
            f"the upstream sent nothing for {settings.request_timeout_s:g}s",
        )
    if isinstance(error, _NoEvents):
        return statuses.failure(
            statuses.UPSTREAM_TIMEOUT,
            f"the upstream's stream sent no event for {settings.request_timeout_s:g}s, only "
            "comments or empty events (request_timeout_s)",
        )
    if isinstance(error, DeadlinePassed):
        return statuses.failure(statuses.UPSTREAM_TIMEOUT, "the run's deadline passed")
    if isinstance(error, Disconnected):
        when = "mid-response" if error.answered else "before it answered"
        return statuses.failure(
            statuses.UPSTREAM_ERROR, f"the upstream dropped the connection {when} ({error})"
        )
    if isinstance(error, BadResponse | _Malformed):
        return statuses.failure(statuses.UPSTREAM_ERROR, str(error))
    if isinstance(error, _TooLarge):
        return _too_large(limit)
    return statuses.failure(statuses.UPSTREAM_ERROR, f"upstream request failed: {error!r}")


def _decode(data: bytes) -> dict[str, Any]:
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _Malformed("the upstream sent something that is not JSON") from None
    if not isinstance(document, dict):
        raise _Malformed("the upstream sent JSON that is not an object")
    return document


def _finish_reason(document: dict[str, Any]) -> str | None:
    """A choice's finish reason; a response's status (completed, incomplete, failed...)."""
    status = document.get("status")
    if isinstance(status, str) and document.get("object") == "response":
        return status
    choices = document.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                return str(choice["finish_reason"])
    return None


#: A usage object or a finish reason (JSON with or without spaces): what a stream's last
#: events hold, and the reason to parse an event that would otherwise pass through.
_TAIL: Final = re.compile(rb'"(?:usage"\s*:\s*\{|finish_reason"\s*:\s*")')
#: How many of a read's last events are searched for those: the finish chunk, the usage chunk
#: and `[DONE]` are a stream's last three, so each is among the last three of the read it
#: arrives in (an earlier usage or finish reason in the stream is superseded by the last).
_TAIL_EVENTS: Final = 3


class _StreamDecoder:
    """An SSE body, fed as it arrives, as run events: its chunks, then the usage and `RunDone`
    at the end. Plain generators: a malformed event fails after the good ones before it went
    out.

    Two ways out. Per event (`sse=False`, for an Edge that predates `RunChunk.sse`): every
    event is parsed and sent as its JSON object. Passed through (`sse=True`): each read's whole
    events go out as one chunk of bytes, as the upstream wrote them, when they are all single
    `data: {...}` lines (what OpenAI, vLLM and the others send: the client gets exactly the
    bytes the per-event way would frame). Only a read's last events are searched, and parsed
    from the first one that holds a usage object, a finish reason or `[DONE]` (where the usage,
    the finish reason and the usage-only chunk the client did not ask for are). A read framed
    otherwise (comments, other fields, CRLF, a lone CR, data on several lines) is parsed event by
    event and framed anew, each object on one line. What passes through is not checked to be
    JSON: a malformed object reaches the client as the upstream wrote it (one in a read's last
    events, or in a read framed otherwise, still fails the run with `upstream_error`).
    """

    def __init__(self, wants_usage: bool, limit: int, sse: bool = False) -> None:
        self._wants_usage = wants_usage
        self._limit = limit
        self._sse = sse
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
        if buffer:
            start = len(buffer) - 1
            buffer += piece
            if buffer.find(b"\n\n", start) < 0:
                if len(buffer) > self._limit:
                    raise _TooLarge
                return iter(())
            piece = bytes(buffer)
        cut = _after_last_event(piece, len(piece))
        if len(piece) - cut > self._limit:
            raise _TooLarge
        if not cut:
            if not buffer:
                self._buffer = bytearray(piece)
            return iter(())
        self._buffer = bytearray(piece[cut:])
        if self._sse:
            return self._passed(piece[:cut])
        return self._objects(piece[: cut - 2].split(b"\n\n"))

    def end(self) -> Iterator[RunEvent]:
        """The last events once the body ended (its last event may lack the blank line)."""
        rest, self._buffer = bytes(self._buffer), bytearray()
        if rest:
            if self._sse:
                yield from self._framed([rest])
            else:
                yield from self._objects([rest])
        if self._usage is not None:
            yield RunUsage(*self._usage)
        yield RunDone(self._finish)

    def _passed(self, events: bytes) -> Iterator[RunChunk]:
        """Whole events (each ending with a blank line) as chunks of SSE bytes: those before
        the read's last ones as they came, when that is safe, the rest parsed."""
        if self._done:
            return  # nothing after [DONE] counts
        # The read's last events are searched for what must be parsed: from the first that
        # holds a usage object, a finish reason or [DONE] on, the events are parsed.
        tail = len(events)
        for _ in range(_TAIL_EVENTS):
            tail = _after_last_event(events, tail - 2)
            if not tail:
                break
        head = len(events)
        found = _TAIL.search(events, tail)
        if found is not None:
            head = _after_last_event(events, found.start())
        done = events.find(_DONE, tail, head)
        if done >= 0:
            head = _after_last_event(events, done)
        if head > self._limit or not _plain(events, head):
            head = 0
        if head:
            yield RunChunk(events[:head], sse=True)
        if head < len(events):
            yield from self._framed(events[head:-2].split(b"\n\n"))

    def _framed(self, events: list[bytes]) -> Iterator[RunChunk]:
        """Parsed events framed anew as SSE, in chunks of at most the limit (an object too large
        for that with its framing goes alone, as an object, which the Edge frames)."""
        parts: list[bytes] = []
        size = 0
        limit = self._limit
        try:
            for data, usage_only in self._parsed(events):
                framed = b"data: " + data + b"\n\n"
                if size + len(framed) > limit and parts:
                    yield RunChunk(b"".join(parts), sse=True)
                    parts, size = [], 0
                if len(framed) > limit:
                    yield RunChunk(data, usage_only)
                    continue
                parts.append(framed)
                size += len(framed)
        except _Malformed:
            if parts:  # the good events before the bad one still go out
                yield RunChunk(b"".join(parts), sse=True)
            raise
        if parts:
            yield RunChunk(b"".join(parts), sse=True)

    def _objects(self, events: list[bytes]) -> Iterator[RunChunk]:
        for data, usage_only in self._parsed(events):
            yield RunChunk(data, usage_only)

    def _parsed(self, events: list[bytes]) -> Iterator[tuple[bytes, bool]]:
        """Each event's JSON object that goes to the client, and whether it is the usage-only
        chunk; notes the usage, the finish reason and `[DONE]` on the way."""
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
            if b"\r" in data or b"\n" in data:
                # JSON whitespace that would end the line the object is framed on (data on
                # several lines, a CR between tokens): the object goes out on one line.
                data = orjson.dumps(document)
            choices = document.get("choices")
            # Most chunks carry no usage or `"usage": null`: skip the lookup for those.
            found = None if document.get("usage") is None else usage_from(document)
            if found is not None:
                self._usage = found
                if not choices:
                    if self._wants_usage:
                        yield data, True
                    continue
            self._finish = _finish_reason(document) or self._finish
            yield data, False


#: The events that end a Responses stream, each with the whole response (its usage, its status).
_RESPONSE_END: Final = re.compile(
    rb'"type"\s*:\s*"response\.(?:completed|incomplete|failed|cancelled)"'
)


class _ResponseEvents:
    """A Responses API stream (`event: response.created`, `data: {...}` ...), fed as it
    arrives: whole events passed through as the upstream wrote them (their `event:` lines
    too), a read's events in one chunk of at most the limit; only the event that ends the
    response is parsed, for its usage and status. It has no `[DONE]`, nor a usage-only chunk."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buffer = bytearray()
        self._usage: tuple[int, int, int] | None = None
        self._status: str | None = None

    def feed(self, piece: bytes) -> Iterator[RunChunk]:
        """The chunks of whole events `piece` completes; `_TooLarge` past the limit."""
        buffer = self._buffer
        buffer += piece
        if b"\r" in piece:  # CRLF as LF: the blank line between events is then one pattern
            buffer[:] = buffer.replace(b"\r\n", b"\n")
        cut = _after_last_event(buffer, len(buffer))
        if len(buffer) - cut > self._limit:
            raise _TooLarge
        if not cut:
            return iter(())
        events = bytes(buffer[:cut])
        del buffer[:cut]
        return self._chunks(events)

    def end(self) -> Iterator[RunEvent]:
        rest, self._buffer = bytes(self._buffer), bytearray()
        if rest.strip():
            yield from self._chunks(rest.rstrip(b"\n") + b"\n\n")
        if self._usage is not None:
            yield RunUsage(*self._usage)
        yield RunDone(self._status)

    def _chunks(self, events: bytes) -> Iterator[RunChunk]:
        found = _RESPONSE_END.search(events)
        if found is not None:
            self._read_end(events[_after_last_event(events, found.start()) :])
        limit = self._limit
        if len(events) <= limit:
            yield RunChunk(events, sse=True)
            return
        parts: list[bytes] = []
        size = 0
        for event in events[:-2].split(b"\n\n"):
            framed = event + b"\n\n"
            if len(framed) > limit:
                raise _TooLarge
            if size + len(framed) > limit and parts:
                yield RunChunk(b"".join(parts), sse=True)
                parts, size = [], 0
            parts.append(framed)
            size += len(framed)
        if parts:
            yield RunChunk(b"".join(parts), sse=True)

    def _read_end(self, events: bytes) -> None:
        """The usage and status of the response in the first of `events` (the ending one)."""
        data = _event_data(events[: events.find(b"\n\n")])
        if data is None:
            return
        response = _decode(data).get("response")
        if isinstance(response, dict):
            self._usage = usage_from(response) or self._usage
            status = response.get("status")
            self._status = status if isinstance(status, str) else self._status


def _after_last_event(data: bytes | bytearray, end: int) -> int:
    """Where the bytes after the last blank line before `end` start (0: none before it)."""
    boundary = data.rfind(b"\n\n", 0, end)
    return boundary + 2 if boundary >= 0 else 0


def _plain(events: bytes, end: int) -> bool:
    """Whether `events[:end]` (whole events) are all single `data: {...}` lines, each ending
    with a blank line: then they reach the client byte for byte as the per-event way would
    frame them. Counted, not split: every newline must belong to a boundary between two such
    events, or to the last one's end."""
    if not end:
        return False
    return (
        # A lone CR ends a line in SSE (CRLF became LF in `feed`): `data: {...}\rid: 7`
        # would reach the client as two fields, where the per-event way refuses the JSON.
        events.find(b"\r", 0, end) < 0
        and events.startswith(b"data: {")
        and events.startswith(b"}\n\n", end - 3)
        and events.count(b"\n", 0, end) == 2 * events.count(b"}\n\ndata: {", 0, end) + 2
    )


def _event_data(event: bytes) -> bytes | None:
    """The `data` of one server-sent event, as bytes (multi-line data joined by newlines)."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None
