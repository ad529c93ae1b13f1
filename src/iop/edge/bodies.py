"""OpenAI request bodies: validated, passed on as the client sent them.

`parse_request` bounds a body's structure before it is parsed (`bodybounds`), parses it, bounds
its bulk, and checks it against the pydantic models' rules, by hand first (`bodymodels`): every
refusal names its field. Every field the Edge does not check passes through untouched (the raw
document is what is forwarded). The Edge changes the document in exactly these ways: `model`
becomes the served name, the model's generation policy applies (`apply_policy`), a server that
schedules by priority gets the request's class as `priority` (`ParsedRequest.encode`), and an
embeddings request gets only its `model`. The context class and the token limits read one
estimate of every part the model reads (`estimate_tokens`). docs/edge.md ("The API",
"Dispatch") gives the rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

import orjson
from pydantic import ValidationError

from iop.edgeconfig import GenerationPolicy
from iop.wire import RunKind

from .bodybounds import BodyBounds, check_fields, check_structure
from .bodymodels import MODELS, bad_request, conforms, input_problem
from .errors import BadRequest

#: The cheap token estimate's ratio: UTF-8 bytes of input text per token.
BYTES_PER_TOKEN: Final = 4
#: The estimate of a content part that is not text (an image, audio, a file): what a model
#: reads of one 1024x1024 image at high detail, in OpenAI's accounting.
MEDIA_PART_TOKENS: Final = 765


@dataclass(slots=True)
class ParsedRequest:
    """A valid request: its raw document (forwarded) and what the Edge reads from it."""

    kind: RunKind
    model: str
    stream: bool
    include_usage: bool
    document: dict[str, Any]
    size: int
    #: More input tokens than the estimate can ever come to (`_most_tokens`): a request below a
    #: threshold by it is below by the estimate, which need not be made.
    most_tokens: int = 0
    #: What `apply_policy` changed, to undo before another policy: (field, the client's value,
    #: or `_ABSENT`), None while it changed nothing.
    policy_changes: list[tuple[str, Any]] | None = None
    #: The input-token estimate, once `estimate_tokens` made it.
    estimate: int | None = None
    #: A Responses request's `previous_response_id`: the stored response it continues.
    previous_response_id: str | None = None
    #: The client's own `priority` (or `_ABSENT`) while `encode` has put the Edge's there;
    #: None while it has not.
    client_priority: Any = None

    def encode(self, served_model: str, priority: int | None = None) -> bytes:
        """The body to forward to a provider that serves the model as `served_model`, with
        `priority` as its `priority` field (vLLM's: lower is served first) in place of the
        client's; None leaves the client's (put back if an earlier try replaced it).

        A document nested deeper than the serializer goes (orjson stops at 255 levels, while
        its parser reads 1,024) is the client's problem, not the Edge's: a 400.
        """
        document = self.document
        document["model"] = served_model
        if priority is not None:
            if self.client_priority is None:
                self.client_priority = document.get("priority", _ABSENT)
            document["priority"] = priority
        elif self.client_priority is not None:
            if self.client_priority is _ABSENT:
                del document["priority"]
            else:
                document["priority"] = self.client_priority
            self.client_priority = None
        try:
            return orjson.dumps(document)
        except orjson.JSONEncodeError as exc:
            raise BadRequest(
                f"The request body cannot be forwarded: {exc}. Nest it less deeply."
            ) from exc


def parse_request(kind: RunKind, raw: bytes, bounds: BodyBounds | None = None) -> ParsedRequest:
    """Parse and validate a request body; `BadRequest` names the first wrong field."""
    bounds = bounds or _BOUNDS
    containers = check_structure(raw, bounds)
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(
            "We could not parse the JSON body of your request: "
            f"{exc.msg} at line {exc.lineno} column {exc.colno}. The body must be a JSON object."
        ) from exc
    if not isinstance(document, dict):
        raise BadRequest("The request body must be a JSON object.")
    check_fields(kind, document, bounds, containers)
    if not conforms(kind, document):
        try:  # the models accept it after all, or name what is wrong in their words
            MODELS[kind].model_validate(document)
        except ValidationError as exc:
            raise bad_request(exc.errors(include_url=False)) from exc
        if kind == "response" and (problem := input_problem(document["input"])):
            param, reason = problem
            raise BadRequest(f"Invalid value for '{param}': {reason}.", param)
    model: str = document["model"]
    most = _most_tokens(len(raw), containers)
    if kind == "embedding":
        return ParsedRequest(kind, model, False, False, document, len(raw), most)
    if kind == "response":
        return ParsedRequest(
            kind=kind,
            model=model,
            stream=bool(document.get("stream")),
            include_usage=False,
            document=document,
            size=len(raw),
            most_tokens=most,
            previous_response_id=document.get("previous_response_id"),
        )
    stream = bool(document.get("stream"))
    options = document.get("stream_options") if stream else None
    return ParsedRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        document=document,
        size=len(raw),
        most_tokens=most,
    )


def _most_tokens(size: int, containers: int) -> int:
    """A bound on `estimate_tokens` of a body of `size` bytes with at most `containers` objects
    and arrays: text counts a quarter of a token per byte, a token id at most one per byte, JSON
    re-encoded at most 4.5 bytes per byte (a float such as 1e15), so a quarter of that; a media
    part `MEDIA_PART_TOKENS` per object."""
    return 2 * size + MEDIA_PART_TOKENS * containers


_BOUNDS: Final = BodyBounds()

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
        if request.kind == "chat":
            keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
        elif request.kind == "response":
            keys = ("max_output_tokens",)
        else:
            keys = ("max_tokens",)
        named = False
        for key in keys:
            value = document.get(key)
            if value is not None:
                named = True
                if value > cap:
                    _change(request, key, cap)
        if not named:
            _change(request, keys[-1], cap)
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


#: The top-level fields of a chat request that the model reads besides its messages.
_CHAT_EXTRAS: Final = ("tools", "functions", "tool_choice", "response_format")
#: The content parts counted at a flat cost (`image_url`, `input_audio`, `video_url`, `file`...).
_MEDIA: Final = re.compile(r"image|audio|video|^file$")
#: A message's fields that are not read as tokens.
_NOT_READ: Final = frozenset({"role", "content"})


def estimate_tokens(request: ParsedRequest) -> int:
    """The cheap input-token estimate of every part the model reads (docs/edge.md, "Dispatch":
    long context), made once per request: text as UTF-8 bytes / 4; a message's tool calls,
    name and the like, and the request's tools, functions and response format, as their JSON
    bytes / 4; a content part that is not text at a flat `MEDIA_PART_TOKENS`."""
    if request.estimate is not None:
        return request.estimate
    document = request.document
    size = 0
    tokens = 0
    if request.kind == "chat":
        for message in document["messages"]:  # validated: objects with a content
            content = message.get("content")
            if isinstance(content, str):
                size += _utf8_len(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text")
                    if isinstance(text, str):
                        size += _utf8_len(text)
                    elif _MEDIA.search(part["type"]):
                        tokens += MEDIA_PART_TOKENS
                    else:
                        size += _json_len(part)
            if len(message) > 2 or not message.keys() <= _NOT_READ:
                for key, value in message.items():
                    if key not in _NOT_READ and value is not None:
                        size += _json_len(value)
        for key in _CHAT_EXTRAS:
            value = document.get(key)
            if value is not None:
                size += _json_len(value)
    elif request.kind == "response":
        size, tokens = _response_input(document)
    else:
        prompt = document["prompt" if request.kind == "completion" else "input"]
        for item in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(item, str):
                size += _utf8_len(item)
            elif isinstance(item, int):
                tokens += 1
            else:
                tokens += len(item)
    request.estimate = tokens + -(-size // BYTES_PER_TOKEN)
    return request.estimate


#: The top-level fields of a Responses request that the model reads besides its input.
_RESPONSE_EXTRAS: Final = ("tools", "tool_choice", "text")
#: An input item's fields that are not read as tokens.
_ITEM_NOT_READ: Final = frozenset({"role", "content", "type", "id", "status"})


def _response_input(document: dict[str, Any]) -> tuple[int, int]:
    """(bytes of text, flat tokens) a Responses request gives its model: its instructions, its
    input (text, or items: their text parts, media parts at a flat cost, any other field as
    JSON, as a function call's arguments or output) and its tools."""
    size = 0
    tokens = 0
    instructions = document.get("instructions")
    if isinstance(instructions, str):
        size += _utf8_len(instructions)
    value = document["input"]  # validated: text or items
    for item in [value] if isinstance(value, str) else value:
        if isinstance(item, str):
            size += _utf8_len(item)
            continue
        content = item.get("content")
        if isinstance(content, str):
            size += _utf8_len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text")
                kind = part["type"]
                if isinstance(text, str):
                    size += _utf8_len(text)
                elif _MEDIA.search(kind) or kind == "input_file":
                    tokens += MEDIA_PART_TOKENS
                else:
                    size += _json_len(part)
        for key, field in item.items():
            if key not in _ITEM_NOT_READ and field is not None:
                size += _json_len(field)
    for key in _RESPONSE_EXTRAS:
        extra = document.get(key)
        if extra is not None:
            size += _json_len(extra)
    return size, tokens


def is_long(request: ParsedRequest, threshold_tokens: int) -> bool:
    """True when the request is `context_class=long`."""
    if request.most_tokens < threshold_tokens:
        return False
    return estimate_tokens(request) >= threshold_tokens


def _json_len(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(orjson.dumps(value))


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())
