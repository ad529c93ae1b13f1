"""Deterministic answers of OpenAI's Responses API, and the responses a fake server keeps.

`POST /v1/responses` as OpenAI and vLLM answer it: a `response` object, or with `"stream": true`
typed server-sent events (`event: response.created` ... `event: response.completed`, each with
its `sequence_number`, no `[DONE]`). The text is the fake's word cycle (`answers.tokens`), one
token a word; `input_tokens` count the words of `instructions`, of `input` and of the
conversation the request continues (`previous_response_id`: its input and output), as a real
server reads them again. `ResponseStore` keeps what a server answered (unless `"store":
false`), bounded, for `previous_response_id` and for retrieve, delete and cancel; an unknown id
gets vLLM's 404. Shared by the fake upstream and the `fake` adapter: the same bytes for the same
request.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import orjson

from .answers import OpenAIError, tokens

#: Most responses a `ResponseStore` keeps (the oldest go first).
MAX_STORED: Final = 10_000
_ids = itertools.count(1)
#: Ids differ between processes, as a real server's do: two fake servers never share one.
_ID_PREFIX: Final = os.urandom(6).hex()


@dataclass(frozen=True, slots=True)
class ResponseAnswer:
    """One accepted `POST /v1/responses` and everything needed to answer it."""

    id: str
    model: str
    stream: bool
    store: bool
    input_tokens: int
    output_tokens: int
    status: str  # completed, or incomplete when max_output_tokens cut it short
    created_at: int
    request: dict[str, Any]
    overrides: dict[str, Any]

    @property
    def message_id(self) -> str:
        return "msg_" + self.id.removeprefix("resp_")

    @property
    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    def text(self) -> str:
        return "".join(tokens(self.output_tokens))

    def document(self, *, final: bool = True) -> dict[str, Any]:
        """The response object: as it ends (`final`), or as `response.created` shows it."""
        request = self.request
        item = self._message(self.text(), "completed")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status if final else "in_progress",
            "background": bool(request.get("background")),
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if final and self.status == "incomplete" else None
            ),
            "instructions": request.get("instructions"),
            "max_output_tokens": request.get("max_output_tokens"),
            "model": self.model,
            "output": [item] if final else [],
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": request.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "store": self.store,
            "temperature": request.get("temperature", 1.0),
            "text": {"format": {"type": "text"}},
            "tool_choice": request.get("tool_choice", "auto"),
            "tools": request.get("tools", []),
            "top_p": request.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": self.usage if final else None,
            "user": None,
            "metadata": request.get("metadata") or {},
        }

    def body(self) -> bytes:
        """The whole non-streaming answer."""
        return orjson.dumps(self.document())

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" else [],
        }

    def opening_events(self) -> list[bytes]:
        """The events before the first delta: created, in progress, the message and its part."""
        created = self.document(final=False)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            _event("response.created", 0, response=created),
            _event("response.in_progress", 1, response=created),
            _event(
                "response.output_item.added",
                2,
                output_index=0,
                item=self._message("", "in_progress"),
            ),
            _event(
                "response.content_part.added",
                3,
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def delta_events(self, words: Iterable[str], first_index: int) -> list[bytes]:
        """`response.output_text.delta` of each of `words`, the first being token number
        `first_index` of the answer."""
        return [
            _event(
                "response.output_text.delta",
                4 + first_index + offset,
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                delta=word,
                logprobs=[],
            )
            for offset, word in enumerate(words)
        ]

    def closing_events(self) -> list[bytes]:
        """The events after the last delta, `response.completed` (or `.incomplete`) last."""
        text = self.text()
        number = 4 + self.output_tokens
        final = self.document()
        part = final["output"][0]["content"][0]
        ending = "response.completed" if self.status == "completed" else "response.incomplete"
        return [
            _event(
                "response.output_text.done",
                number,
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            _event(
                "response.content_part.done",
                number + 1,
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
            _event(
                "response.output_item.done", number + 2, output_index=0, item=final["output"][0]
            ),
            _event(ending, number + 3, response=final),
        ]

    def events(self) -> Iterator[bytes]:
        """Every event of the stream, each framed `event: TYPE\\ndata: {...}\\n\\n`."""
        yield from self.opening_events()
        yield from self.delta_events(tokens(self.output_tokens), 0)
        yield from self.closing_events()


def _event(kind: str, number: int, **fields: Any) -> bytes:
    data = orjson.dumps({"type": kind, "sequence_number": number, **fields})
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), data)


class ResponseStore:
    """The responses one server keeps, by id (the oldest forgotten past `limit`)."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self._limit = limit
        self._kept: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, document: dict[str, Any]) -> None:
        self._kept[document["id"]] = document
        self._kept.move_to_end(document["id"])
        while len(self._kept) > self._limit:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any]:
        document = self._kept.get(response_id)
        if document is None:
            raise not_found(response_id)
        return document

    def status(self, response_id: str) -> str | None:
        document = self._kept.get(response_id)
        return document["status"] if document is not None else None

    def retrieve(self, response_id: str) -> bytes:
        return orjson.dumps(self.get(response_id))

    def delete(self, response_id: str) -> bytes:
        self.get(response_id)
        del self._kept[response_id]
        return orjson.dumps({"id": response_id, "object": "response.deleted", "deleted": True})

    def cancel(self, response_id: str) -> bytes:
        """Cancel a response still under way (`in_progress` or `queued`); OpenAI refuses to
        cancel one that ended, and so does the fake."""
        document = self.get(response_id)
        if document["status"] not in ("in_progress", "queued"):
            raise OpenAIError(
                400,
                f"Cannot cancel a response with status '{document['status']}': only a "
                "response in progress can be cancelled.",
                param="response_id",
            )
        document = {**document, "status": "cancelled"}
        self.keep(document)
        return orjson.dumps(document)


def not_found(response_id: str) -> OpenAIError:
    """vLLM's answer for a response id it does not hold."""
    return OpenAIError(
        404,
        f"Response with id '{response_id}' not found.",
        type="invalid_request_error",
        code="response_not_found",
    )


def parse_response_request(
    body: bytes,
    *,
    default_tokens: int,
    models: tuple[str, ...],
    now: int,
    store: ResponseStore,
) -> ResponseAnswer:
    """Check a `POST /v1/responses` body as OpenAI does (`OpenAIError` for a bad one); a
    `previous_response_id` must name a response `store` holds."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise OpenAIError(400, "We could not parse the JSON body of your request.") from None
    if not isinstance(document, dict):
        raise OpenAIError(400, "The request body must be a JSON object.")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "Missing required parameter: 'model'.", param="model")
    if models and model not in models:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            code="model_not_found",
        )
    value = document.get("input")
    if not isinstance(value, str | list):
        raise OpenAIError(400, "Missing required parameter: 'input'.", param="input")
    input_tokens = _words(value) + _words(document.get("instructions"))
    previous = document.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise OpenAIError(
                400, "Invalid type for 'previous_response_id'.", param="previous_response_id"
            )
        before = store.get(previous)
        usage = before.get("usage") or {}
        input_tokens += int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
    limit = document.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise OpenAIError(
            400,
            f"Invalid 'max_output_tokens': integer below minimum value. Got {limit!r}.",
            param="max_output_tokens",
        )
    output_tokens = default_tokens if limit is None else min(limit, default_tokens)
    overrides = document.get("fake_upstream")
    return ResponseAnswer(
        id=f"resp_{_ID_PREFIX}{next(_ids):010d}",
        model=model,
        stream=document.get("stream") is True,
        store=document.get("store") is not False,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        status="incomplete" if limit is not None and limit < default_tokens else "completed",
        created_at=now,
        request=document,
        overrides=overrides if isinstance(overrides, dict) else {},
    )


def _words(value: Any) -> int:
    """Words of an input: text, items with a `content` (text or parts with `text`)."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(item) for item in value)
    if isinstance(value, dict):
        return _words(value.get("content")) + _words(value.get("text"))
    return 0
