"""How the `openai` adapter reads an upstream's answer: a body's JSON object, a stream's events.

`decode` and `finish_reason` read a whole answer, or one event. `StreamDecoder` turns a chat or
completion SSE body, fed read by read, into run events: each read's whole events passed through
as the upstream wrote them when they are plain `data:` lines, otherwise parsed and framed anew,
the usage and finish reason taken from the stream's last events. `ResponseEvents` does the same
for a Responses API stream, parsing only the event that ends it. No I/O here: `openai_http.py`
feeds them what it reads; what they raise (`Malformed`, `TooLarge`) `upstreamfailures.py`
translates. docs/architecture.md ("The data path of one request") says why it is so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Final

import orjson

from iop.wire import RunChunk, RunDone, RunEvent, RunUsage

from .base import usage_from
from .upstreamfailures import Malformed, TooLarge

#: The last event of a chat or completion stream; what follows it counts for nothing.
_DONE: Final = b"[DONE]"


def decode(data: bytes) -> dict[str, Any]:
    """`data` as a JSON object; `Malformed` when it is not JSON, or not an object."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise Malformed("the upstream sent something that is not JSON") from None
    if not isinstance(document, dict):
        raise Malformed("the upstream sent JSON that is not an object")
    return document


def finish_reason(document: dict[str, Any]) -> str | None:
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


class StreamDecoder:
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
        """The chunks `piece` completes. Raises `TooLarge` when an event grows past the
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
                    raise TooLarge
                return iter(())
            piece = bytes(buffer)
        cut = _after_last_event(piece, len(piece))
        if len(piece) - cut > self._limit:
            raise TooLarge
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
        except Malformed:
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
            document = decode(data)
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
            self._finish = finish_reason(document) or self._finish
            yield data, False


#: The events that end a Responses stream, each with the whole response (its usage, its status).
_RESPONSE_END: Final = re.compile(
    rb'"type"\s*:\s*"response\.(?:completed|incomplete|failed|cancelled)"'
)


class ResponseEvents:
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
        """The chunks of whole events `piece` completes; `TooLarge` past the limit."""
        buffer = self._buffer
        buffer += piece
        if b"\r" in piece:  # CRLF as LF: the blank line between events is then one pattern
            buffer[:] = buffer.replace(b"\r\n", b"\n")
        cut = _after_last_event(buffer, len(buffer))
        if len(buffer) - cut > self._limit:
            raise TooLarge
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
                raise TooLarge
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
        response = decode(data).get("response")
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
