"""OpenAI request bodies: validated with pydantic, passed on as the client sent them.

The models check only the fields the Edge reads or that a client most often gets wrong, with
strict types; every other field passes through untouched (`extra="ignore"` on the model, while
the raw document is what is forwarded). The Edge then changes the document in exactly three ways:
`model` becomes the name the chosen provider serves, and the model's generation policy applies
(`max_tokens` capped or defaulted, `temperature` and `top_p` defaulted); an embeddings request
gets only its `model`. The context class comes from an estimate of the input tokens (UTF-8 bytes
/ 4). docs/edge.md ("The API", "Dispatch") gives the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from iop.edgeconfig import GenerationPolicy
from iop.wire import RunKind

from .errors import BadRequest

#: The cheap token estimate's ratio: UTF-8 bytes of input text per token.
BYTES_PER_TOKEN: Final = 4


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class ChatMessage(_Body):
    role: Annotated[str, Field(min_length=1)]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(part, dict) for part in value):
            for part in value:
                if not isinstance(part.get("type"), str):
                    raise ValueError("each content part must be an object with a string 'type'")
            return value
        raise ValueError("must be a string or an array of content parts")


class _Sampling(_Body):
    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(ge=0, le=1)] = None
    n: Annotated[int | None, Field(ge=1, le=128)] = None


class ChatCompletionBody(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None


def _text_or_tokens(value: Any) -> Any:
    """A prompt (or an embeddings input): text, texts, token ids or lists of token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return value
        if all(
            isinstance(item, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in item)
            for item in value
        ):
            return value
    raise ValueError(
        "must be a string, an array of strings, an array of token ids or an array of "
        "arrays of token ids"
    )


class CompletionBody(_Sampling):
    """POST /v1/completions."""

    prompt: Any

    _prompt = field_validator("prompt")(_text_or_tokens)


class EmbeddingBody(_Body):
    """POST /v1/embeddings."""

    model: Annotated[str, Field(min_length=1)]
    input: Any
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int | None, Field(ge=1)] = None
    user: str | None = None

    _input = field_validator("input")(_text_or_tokens)


#: The text of an embeddings request or a completion: what is counted as input tokens.
Prompted = CompletionBody | EmbeddingBody

_MODELS: Final[dict[str, type[ChatCompletionBody] | type[CompletionBody] | type[EmbeddingBody]]] = {
    "chat": ChatCompletionBody,
    "completion": CompletionBody,
    "embedding": EmbeddingBody,
}


@dataclass(slots=True)
class ParsedRequest:
    """A valid request: its raw document (forwarded) and what the Edge reads from it."""

    kind: RunKind
    model: str
    stream: bool
    include_usage: bool
    document: dict[str, Any]
    body: ChatCompletionBody | CompletionBody | EmbeddingBody
    size: int
    #: What `apply_policy` changed, to undo before another policy: (field, the client's value,
    #: or `_ABSENT`), None while it changed nothing.
    policy_changes: list[tuple[str, Any]] | None = None

    def encode(self, served_model: str) -> bytes:
        """The body to forward to a provider that serves the model as `served_model`.

        A document nested deeper than the serializer goes (orjson stops at 255 levels, while
        its parser reads 1,024) is the client's problem, not the Edge's: a 400.
        """
        self.document["model"] = served_model
        try:
            return orjson.dumps(self.document)
        except orjson.JSONEncodeError as exc:
            raise BadRequest(
                f"The request body cannot be forwarded: {exc}. Nest it less deeply."
            ) from exc


def parse_request(kind: RunKind, raw: bytes) -> ParsedRequest:
    """Parse and validate a request body; `BadRequest` names the first wrong field."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(
            "We could not parse the JSON body of your request: "
            f"{exc.msg} at line {exc.lineno} column {exc.colno}. The body must be a JSON object."
        ) from exc
    if not isinstance(document, dict):
        raise BadRequest("The request body must be a JSON object.")
    try:
        body = _MODELS[kind].model_validate(document)
    except ValidationError as exc:
        raise _bad_request(exc.errors(include_url=False)) from exc
    if isinstance(body, EmbeddingBody):
        return ParsedRequest(kind, body.model, False, False, document, body, len(raw))
    stream = bool(body.stream)
    return ParsedRequest(
        kind=kind,
        model=body.model,
        stream=stream,
        include_usage=stream
        and body.stream_options is not None
        and bool(body.stream_options.include_usage),
        document=document,
        body=body,
        size=len(raw),
    )


#: Fields whose problems are named first: what the request is about before how it samples.
_FIRST_FIELDS: Final = ("model", "messages", "prompt", "input")


def _bad_request(errors: list[ErrorDetails]) -> BadRequest:
    errors = sorted(
        errors,
        key=lambda e: (
            _FIRST_FIELDS.index(e["loc"][0])
            if e["loc"] and e["loc"][0] in _FIRST_FIELDS
            else len(_FIRST_FIELDS)
        ),
    )
    first = errors[0]
    param = _param(first["loc"])
    if first["type"] == "missing":
        message = f"Missing required parameter: '{param}'."
    else:
        reason = first["msg"].removeprefix("Value error, ")
        message = f"Invalid value for '{param}': {reason}."
    if len(errors) > 1:
        others = ", ".join(f"'{_param(e['loc'])}'" for e in errors[1:4])
        message += f" Also invalid: {others}{' and more' if len(errors) > 4 else ''}."
    return BadRequest(message, param)


def _param(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


#: A field the client's request did not have (in `ParsedRequest.policy_changes`).
_ABSENT: Final = object()


def apply_policy(request: ParsedRequest, policy: GenerationPolicy) -> None:
    """Apply a model's generation policy to the document that will be forwarded; applied again
    (for a fallback model), it starts from what the client sent. Embeddings have none."""
    if request.kind == "embedding":
        return
    document = request.document
    changes = request.policy_changes
    if changes:
        for key, value in reversed(changes):
            if value is _ABSENT:
                del document[key]
            else:
                document[key] = value
        changes.clear()
    cap = policy.max_tokens
    if cap is not None:
        keys = (
            ("max_completion_tokens", "max_tokens") if request.kind == "chat" else ("max_tokens",)
        )
        named = False
        for key in keys:
            value = document.get(key)
            if value is not None:
                named = True
                if value > cap:
                    _change(request, key, cap)
        if not named:
            _change(request, "max_tokens", cap)
    if policy.temperature is not None and document.get("temperature") is None:
        _change(request, "temperature", policy.temperature)
    if policy.top_p is not None and document.get("top_p") is None:
        _change(request, "top_p", policy.top_p)


def _change(request: ParsedRequest, key: str, value: Any) -> None:
    """Set a field of the forwarded document, remembering what the client had there."""
    document = request.document
    if request.policy_changes is None:
        request.policy_changes = []
    request.policy_changes.append((key, document.get(key, _ABSENT)))
    document[key] = value


def estimate_tokens(request: ParsedRequest) -> int:
    """The cheap input-token estimate (docs/edge.md, "Dispatch": long context)."""
    body = request.body
    size = 0
    tokens = 0
    if isinstance(body, ChatCompletionBody):
        for message in body.messages:
            content = message.content
            if isinstance(content, str):
                size += _utf8_len(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text")
                    if isinstance(text, str):
                        size += _utf8_len(text)
    else:
        prompt = _prompt_of(body)
        for item in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(item, str):
                size += _utf8_len(item)
            elif isinstance(item, int):
                tokens += 1
            else:
                tokens += len(item)
    return tokens + -(-size // BYTES_PER_TOKEN)


def is_long(request: ParsedRequest, threshold_tokens: int) -> bool:
    """True when the request is `context_class=long`."""
    body = request.body
    if isinstance(body, ChatCompletionBody):
        text_only = True
    else:
        prompt = _prompt_of(body)  # validated: text, or a list that is not empty
        text_only = isinstance(prompt, str) or isinstance(prompt[0], str)
    if text_only and -(-request.size // BYTES_PER_TOKEN) < threshold_tokens:
        return False  # the contents are shorter than the whole body
    return estimate_tokens(request) >= threshold_tokens


def _prompt_of(body: CompletionBody | EmbeddingBody) -> Any:
    return body.prompt if isinstance(body, CompletionBody) else body.input


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())
