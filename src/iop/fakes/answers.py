"""Deterministic OpenAI answers: response, chunk and error objects for a request.

Shared by the `fake` adapter and the fake upstream (`iop fake-upstream`), so both send the
same bytes and a test can predict every one of them. Pure functions of the request and settings:
the text is a fixed cycle of words, one word per token; the natural answer is `completion_tokens`
long and a smaller `max_tokens` (or `max_completion_tokens`) cuts it short with finish_reason
"length". An embedding is a unit vector of `dimensions` (default `EMBEDDING_DIMENSIONS`) numbers
drawn from the BLAKE2b of its input, as float32: a list of floats, or their little-endian bytes
in base64 (`encoding_format`), as OpenAI sends them.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

#: The words of every fake answer, in order, one per token, cycled.
WORDS: Final = (
    "The quick brown fox jumps over the lazy dog while a patient gateway streams every token "
    "in order"
).split()

#: Numbers in a fake embedding when the request names no `dimensions`.
EMBEDDING_DIMENSIONS: Final = 16
#: Most inputs in one embeddings request, as OpenAI allows.
_MAX_INPUTS: Final = 2048
_FINGERPRINT: Final = "fp_iopfake"
_ids = itertools.count(1)

Kind = Literal["chat", "completion"]


class OpenAIError(Exception):
    """A request the fake refuses the way OpenAI does: a status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type=type, param=param, code=code)


def error_body(
    message: str, *, type: str = "server_error", param: str | None = None, code: str | None = None
) -> bytes:
    """An OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def tokens(count: int) -> Iterator[str]:
    """The first `count` tokens of the fake's answer; each but the first starts with a space."""
    for index in range(count):
        word = WORDS[index % len(WORDS)]
        yield word if index == 0 else f" {word}"


@dataclass(frozen=True, slots=True)
class Completion:
    """One accepted request and everything needed to answer it."""

    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    id: str
    created: int
    overrides: dict[str, Any]
    #: Prompt tokens the server had in its prefix cache (the simulated GPU server's).
    cached_tokens: int = 0

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _usage_document(self) -> dict[str, Any]:
        usage: dict[str, Any] = self.usage
        if self.kind == "chat":
            usage = {
                **usage,
                "prompt_tokens_details": {
                    "cached_tokens": self.cached_tokens,
                    "audio_tokens": 0,
                },
                "completion_tokens_details": {
                    "reasoning_tokens": 0,
                    "audio_tokens": 0,
                    "accepted_prediction_tokens": 0,
                    "rejected_prediction_tokens": 0,
                },
            }
        return usage

    def response(self) -> bytes:
        """The whole non-streaming response body."""
        text = "".join(tokens(self.completion_tokens))
        if self.kind == "chat":
            return orjson.dumps(
                {
                    "id": self.id,
                    "object": "chat.completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": text,
                                "refusal": None,
                                "annotations": [],
                            },
                            "logprobs": None,
                            "finish_reason": self.finish_reason,
                        }
                    ],
                    "usage": self._usage_document(),
                    "service_tier": "default",
                    "system_fingerprint": _FINGERPRINT,
                }
            )
        return orjson.dumps(
            {
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "text": text,
                        "index": 0,
                        "logprobs": None,
                        "finish_reason": self.finish_reason,
                    }
                ],
                "usage": self.usage,
                "system_fingerprint": _FINGERPRINT,
            }
        )

    def first_chunk(self) -> bytes | None:
        """Chat streams open with a chunk that carries only the role; completions have none."""
        if self.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": "", "refusal": None}, None)

    def token_chunk(self, token: str) -> bytes:
        if self.kind == "chat":
            return self._chunk({"content": token}, None)
        return self._chunk(token, None)

    def final_chunk(self) -> bytes:
        return self._chunk({} if self.kind == "chat" else "", self.finish_reason)

    def usage_chunk(self) -> bytes | None:
        """The usage-only chunk (empty choices) when the client asked for include_usage."""
        if not self.include_usage:
            return None
        document = self._envelope()
        document["choices"] = []
        document["usage"] = self._usage_document()
        return orjson.dumps(document)

    def _envelope(self) -> dict[str, Any]:
        if self.kind == "chat":
            return {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "service_tier": "default",
                "system_fingerprint": _FINGERPRINT,
            }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": _FINGERPRINT,
        }

    def _chunk(self, delta: dict[str, Any] | str, finish_reason: str | None) -> bytes:
        document = self._envelope()
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"text": delta, "index": 0, "logprobs": None, "finish_reason": finish_reason}
        document["choices"] = [choice]
        if self.include_usage:
            document["usage"] = None
        return orjson.dumps(document)


def parse_request(
    kind: Kind, body: bytes, *, default_tokens: int, models: tuple[str, ...], now: int
) -> Completion:
    """Check a request body the way OpenAI does; raise `OpenAIError` for a bad one."""
    document = _document(body)
    model = _model(document, models)
    if kind == "chat":
        messages = document.get("messages")
        if not isinstance(messages, list) or not messages:
            raise OpenAIError(
                400, "Missing required parameter: 'messages'.", param="messages", code=None
            )
        prompt_tokens = 3 + sum(4 + _count_words(message) for message in messages)
        limit = document.get("max_completion_tokens", document.get("max_tokens"))
        id_prefix = "chatcmpl-"
    else:
        prompt = document.get("prompt")
        if not isinstance(prompt, str | list):
            raise OpenAIError(400, "Missing required parameter: 'prompt'.", param="prompt")
        prompt_tokens = _count_words(prompt)
        limit = document.get("max_tokens")
        id_prefix = "cmpl-"
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise OpenAIError(
            400,
            f"Invalid 'max_tokens': integer below minimum value. Got {limit!r}.",
            param="max_tokens",
        )
    completion_tokens = default_tokens if limit is None else min(limit, default_tokens)
    finish_reason = "length" if limit is not None and limit <= default_tokens else "stop"
    stream = document.get("stream") is True
    options = document.get("stream_options")
    include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    overrides = document.get("fake_upstream")
    return Completion(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        finish_reason=finish_reason,
        id=f"{id_prefix}iopfake{next(_ids):016d}",
        created=now,
        overrides=overrides if isinstance(overrides, dict) else {},
    )


def _count_words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_count_words(item) for item in value)
    if isinstance(value, dict):
        return _count_words(value.get("content")) + _count_words(value.get("text"))
    return 0


def embedding_vector(text: str, dimensions: int) -> list[float]:
    """The fake embedding of `text`: a unit vector of float32 values, a function of the text."""
    raw = b""
    counter = 0
    while len(raw) < 2 * dimensions:
        raw += hashlib.blake2b(text.encode() + counter.to_bytes(4, "little")).digest()
        counter += 1
    values = [
        (int.from_bytes(raw[2 * i : 2 * i + 2], "little") - 32767.5) for i in range(dimensions)
    ]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    # Round through float32, so a float answer and a base64 one decode to the same numbers.
    return list(
        struct.unpack(
            f"<{dimensions}f", struct.pack(f"<{dimensions}f", *(v / norm for v in values))
        )
    )


def embedding_response(body: bytes, *, models: tuple[str, ...]) -> tuple[bytes, int]:
    """The whole answer of POST /v1/embeddings and its prompt tokens (one per word of input, a
    token id counting one); `OpenAIError` for a request OpenAI would refuse."""
    document = _document(body)
    model = _model(document, models)
    value = document.get("input")
    inputs: list[str]
    if isinstance(value, str):
        inputs = [value]
    elif isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        inputs = list(value)
    elif isinstance(value, list) and value and all(_token_ids(item) for item in value):
        inputs = [" ".join(map(str, item)) for item in value]
    elif isinstance(value, list) and _token_ids(value):
        inputs = [" ".join(map(str, value))]
    else:
        raise OpenAIError(
            400,
            "'input' must be a string, an array of strings, an array of token ids or an array "
            "of arrays of token ids.",
            param="input",
        )
    if len(inputs) > _MAX_INPUTS:
        raise OpenAIError(400, f"'input' may hold at most {_MAX_INPUTS} items.", param="input")
    if any(not text for text in inputs):
        raise OpenAIError(400, "'input' cannot be an empty string.", param="input")
    encoding = document.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise OpenAIError(
            400, "'encoding_format' must be 'float' or 'base64'.", param="encoding_format"
        )
    dimensions = document.get("dimensions", EMBEDDING_DIMENSIONS)
    if (
        not isinstance(dimensions, int)
        or isinstance(dimensions, bool)
        or not 1 <= dimensions <= 4096
    ):
        raise OpenAIError(
            400, "'dimensions' must be an integer from 1 to 4096.", param="dimensions"
        )
    data = []
    for index, text in enumerate(inputs):
        vector = embedding_vector(text, dimensions)
        encoded: list[float] | str = vector
        if encoding == "base64":
            encoded = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    prompt_tokens = sum(max(1, len(text.split())) for text in inputs)
    answer = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return orjson.dumps(answer), prompt_tokens


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    )


def _document(body: bytes) -> dict[str, Any]:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise OpenAIError(
            400,
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
        ) from None
    if not isinstance(document, dict):
        raise OpenAIError(400, "The request body must be a JSON object.")
    return document


def _model(document: dict[str, Any], models: tuple[str, ...]) -> str:
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "you must provide a model parameter", param="model")
    if models and model not in models:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            code="model_not_found",
        )
    return model
