"""The fake upstream's answers over time: SSE events, one HTTP/1.1 chunk each as OpenAI and vLLM
send them, the one paced writer that completion and Responses API streams share (a latency, then
a token every interval, or a connection dropped halfway), and its counterpart for a whole answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, Protocol

from ..answers import Completion, tokens
from ..responses import ResponseAnswer, ResponseStore
from .connection import Connection
from .settings import Delivery

_DONE: Final = b"data: [DONE]\n\n"
#: The end of a chunked body.
_LAST_CHUNK: Final = b"0\r\n\r\n"


def chunked(event: bytes) -> bytes:
    """One SSE event (`data: ...\\n\\n`) framed as one HTTP/1.1 chunk."""
    return b"%x\r\ndata: %s\n\n\r\n" % (len(event) + 8, event)


def chunked_event(event: bytes) -> bytes:
    """One whole SSE event (its `event:` and `data:` lines) as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(event), event)


def completion_chunks(
    completion: Completion, words: Iterable[str], *, first: bool = False
) -> list[bytes]:
    """The HTTP chunks of a stream's token chunks (after its role chunk when `first`): one SSE
    event per HTTP chunk, as OpenAI and vLLM send them."""
    out = []
    if first and (role := completion.first_chunk()) is not None:
        out.append(chunked(role))
    out += [chunked(completion.token_chunk(word)) for word in words]
    return out


def completion_end(completion: Completion) -> list[bytes]:
    """The finish chunk, the usage chunk when asked for, `[DONE]` and the end of the body."""
    out = [chunked(completion.final_chunk())]
    usage = completion.usage_chunk()
    if usage is not None:
        out.append(chunked(usage))
    out.append(b"%x\r\n%s\r\n%s" % (len(_DONE), _DONE, _LAST_CHUNK))
    return out


class StreamedAnswer(Protocol):
    """An answer as the HTTP chunks of its stream: what opens it, each token's, what closes it."""

    @property
    def count(self) -> int:
        """How many tokens it streams."""

    def opening(self) -> list[bytes]:
        """The chunks before the first token."""

    def token(self, word: str, index: int) -> list[bytes]:
        """The chunks of token number `index`, `word`."""

    def closing(self) -> list[bytes]:
        """The chunks after the last token, and the end of the body."""


@dataclass(frozen=True, slots=True)
class CompletionStream:
    """A chat or text completion's stream: `data:` chunks, then `[DONE]`."""

    completion: Completion

    @property
    def count(self) -> int:
        return self.completion.completion_tokens

    def opening(self) -> list[bytes]:
        return completion_chunks(self.completion, (), first=True)

    def token(self, word: str, index: int) -> list[bytes]:
        return [chunked(self.completion.token_chunk(word))]

    def closing(self) -> list[bytes]:
        return completion_end(self.completion)


@dataclass(frozen=True, slots=True)
class ResponseStream:
    """A Responses API stream: typed events. A stored response is kept as in progress from its
    opening (so it can be retrieved or cancelled meanwhile), and as it ended at its closing
    unless it was cancelled meanwhile."""

    answer: ResponseAnswer
    store: ResponseStore

    @property
    def count(self) -> int:
        return self.answer.output_tokens

    def opening(self) -> list[bytes]:
        if self.answer.store:
            self.store.keep(self.answer.document(final=False))
        return [chunked_event(event) for event in self.answer.opening_events()]

    def token(self, word: str, index: int) -> list[bytes]:
        return [chunked_event(event) for event in self.answer.delta_events((word,), index)]

    def closing(self) -> list[bytes]:
        out = [chunked_event(event) for event in self.answer.closing_events()]
        out.append(_LAST_CHUNK)
        if self.answer.store and self.store.status(self.answer.id) != "cancelled":
            self.store.keep(self.answer.document())
        return out


async def stream(
    connection: Connection, keep_alive: bool, answer: StreamedAnswer, delivery: Delivery
) -> None:
    """Send an answer's stream as `delivery` says (a `drop-mid-stream` fault drops the connection
    after half its tokens); write only when about to wait, so bytes go out in bursts."""
    loop = asyncio.get_running_loop()
    out = [connection.stream_head(keep_alive)]
    if delivery.latency:
        await connection.write(b"".join(out))
        out.clear()
        await asyncio.sleep(delivery.latency)
    out += answer.opening()
    start = loop.time()
    interval = delivery.interval
    drop_at = answer.count // 2 if delivery.fault == "drop-mid-stream" else -1
    for index, word in enumerate(tokens(answer.count)):
        if index == drop_at:
            await connection.write(b"".join(out))
            connection.abort()
            return
        if interval and index:
            await connection.write(b"".join(out))
            out.clear()
            await asyncio.sleep(max(0.0, start + index * interval - loop.time()))
        out += answer.token(word, index)
    out += answer.closing()
    await connection.write(b"".join(out))


async def send_whole(
    connection: Connection,
    keep_alive: bool,
    body: Callable[[], bytes],
    count: int,
    delivery: Delivery,
) -> bool:
    """Send a whole answer of `count` tokens when they would all have been made; only half of it
    before the connection drops for a `drop-mid-stream` fault (False then)."""
    delay = delivery.latency + delivery.interval * count
    if delay:
        await asyncio.sleep(delay)
    whole = body()
    if delivery.fault == "drop-mid-stream":
        connection.write_partial(200, whole, keep_alive)
        connection.abort()
        return False
    connection.write_response(200, whole, keep_alive)
    return True
