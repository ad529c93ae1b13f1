"""OpenAI request bodies: validated, passed on as the client sent them.

The pydantic models say what is checked (chat, completions, embeddings and the Responses API):
the fields the Edge reads or that a client most often gets wrong, with strict types; every
other field passes through untouched (the raw document is what is forwarded). A body is first
checked by hand against the same rules (`_conforms`: no objects built); only one that fails
goes through the models, so every refusal names its field in their words. The Edge changes the
document in exactly three ways: `model` becomes the served name, the model's generation policy
applies, and an embeddings request gets only its `model`. The context class and the token
limits read one estimate of every part the model reads. Before any of that a body's structure
is bounded (`BodyBounds`) by counting its brackets and commas. docs/edge.md ("The API",
"Dispatch") gives the rules.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from iop.edgeconfig import GenerationPolicy, OpenAISection
from iop.wire import RunKind

from .errors import BadRequest

#: The cheap token estimate's ratio: UTF-8 bytes of input text per token.
BYTES_PER_TOKEN: Final = 4
#: The estimate of a content part that is not text (an image, audio, a file): what a model
#: reads of one 1024x1024 image at high detail, in OpenAI's accounting.
MEDIA_PART_TOKENS: Final = 765


@dataclass(frozen=True, slots=True)
class BodyBounds:
    """How much structure one request body may have (`openai.max_body_*`, `max_messages`,
    `max_content_parts`, `max_inputs`); the defaults are the config's."""

    containers: int = 50_000
    items: int = 500_000
    depth: int = 64
    messages: int = 10_000
    content_parts: int = 1_000
    inputs: int = 2_048

    @classmethod
    def of(cls, section: OpenAISection) -> BodyBounds:
        return cls(
            containers=section.max_body_containers,
            items=section.max_body_items,
            depth=section.max_body_depth,
            messages=section.max_messages,
            content_parts=section.max_content_parts,
            inputs=section.max_inputs,
        )


#: Every byte but the four a body's structure is counted by.
_NOT_STRUCTURE: Final = bytes(b for b in range(256) if b not in b'"{[,')
#: A JSON string (escapes already taken out).
_STRING: Final = re.compile(rb'"[^"]*"')
#: Strings few enough to read one by one.
_FEW_STRINGS: Final = 4_096


def check_structure(raw: bytes, bounds: BodyBounds) -> int:
    """Refuse a body with more objects and arrays, or items, than `bounds` allow, before it
    is parsed: a parser's cost is per value, so 8 MiB of tiny values costs seconds of CPU. The
    number of objects and arrays it may hold at most (the deepest it can nest).

    Brackets and commas are counted first in every byte, strings included, at memory speed: an
    upper bound, which settles every ordinary body in one pass. Past a bound they are counted
    outside strings: in the gaps between the strings when they are few and hold no escape; else
    in the bytes with the escapes and then the strings taken out (most strings hold no bracket
    or comma: a few passes; else a scan).
    """
    containers = raw.count(b"{") + raw.count(b"[")
    items = raw.count(b",") + containers
    if containers <= bounds.containers and items <= bounds.items:
        return containers  # counted inside strings too: at most this many
    strings = raw.count(b'"') // 2  # escaped quotes too: at least the strings there are
    if strings <= _FEW_STRINGS and b"\\" not in raw:
        containers = items = 0
        start = 0
        for opening, closing in [*_strings(raw), (len(raw), len(raw))]:
            containers += raw.count(b"{", start, opening) + raw.count(b"[", start, opening)
            items += raw.count(b",", start, opening)
            start = closing + 1
        items += containers
    else:
        if strings > 2 * bounds.items:  # each item holds at most two strings, key and value
            raise _too_complex("items", f"more than {bounds.items}", bounds.items)
        bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw
        skeleton = bare.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
        if b'"' in skeleton:  # a string holds a bracket or a comma
            skeleton = _STRING.sub(b"", bare).translate(None, _NOT_STRUCTURE)
        containers = skeleton.count(b"{") + skeleton.count(b"[")
        items = skeleton.count(b",") + containers
    if containers > bounds.containers:
        raise _too_complex("objects and arrays", str(containers), bounds.containers)
    if items > bounds.items:
        raise _too_complex("items", str(items), bounds.items)
    return containers


def _strings(raw: bytes) -> Iterator[tuple[int, int]]:
    """Where each string of a JSON text without escapes is: (its opening and closing quote)."""
    start = raw.find(b'"')
    while start >= 0:
        end = raw.find(b'"', start + 1)
        if end < 0:
            return
        yield start, end
        start = raw.find(b'"', end + 1)


def _too_complex(what: str, count: str, limit: int) -> BadRequest:
    return BadRequest(
        f"The request body has {count} JSON {what}, at most {limit}: send fewer messages, "
        "content parts or inputs in one request.",
        code="request_too_complex",
    )


def _check_fields(
    kind: RunKind, document: dict[str, Any], bounds: BodyBounds, containers: int
) -> None:
    """The bounds of the fields that hold a body's bulk, each refusal naming its field;
    `containers`: at most the objects and arrays it holds (no deeper than that)."""
    if kind == "chat":
        messages = document.get("messages")
        if isinstance(messages, list):
            _at_most("messages", len(messages), bounds.messages)
            for index, message in enumerate(messages):
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, list):
                    _at_most(f"messages[{index}].content", len(content), bounds.content_parts)
    elif kind == "response":
        items = document.get("input")
        if isinstance(items, list):
            _at_most("input", len(items), bounds.inputs)
            for index, item in enumerate(items):
                content = item.get("content") if isinstance(item, dict) else None
                if isinstance(content, list):
                    _at_most(f"input[{index}].content", len(content), bounds.content_parts)
    else:
        name = "input" if kind == "embedding" else "prompt"
        value = document.get(name)
        if isinstance(value, list) and value and not isinstance(value[0], int):
            _at_most(name, len(value), bounds.inputs)
    path = _too_deep(document, 1, bounds.depth) if containers > bounds.depth else None
    if path is not None:
        param = _param(tuple(reversed(path)))
        raise BadRequest(
            f"Invalid value for '{param}': nested deeper than {bounds.depth} levels.", param
        )


def _at_most(param: str, count: int, limit: int) -> None:
    if count > limit:
        raise BadRequest(f"Invalid value for '{param}': {count} items, at most {limit}.", param)


def _too_deep(value: dict[str, Any] | list[Any], depth: int, limit: int) -> list[Any] | None:
    """The path (reversed) to a container deeper than `limit`, if any."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(item, dict | list):
            if depth >= limit:
                return [key]
            found = _too_deep(item, depth + 1, limit)
            if found is not None:
                found.append(key)
                return found
    return None


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


class ResponseBody(_Body):
    """POST /v1/responses (OpenAI's Responses API). `input` is checked by hand
    (`_input_problem`), so a refusal names the item and the part: `input[2].content[0]`."""

    model: Annotated[str, Field(min_length=1)]
    input: Any
    instructions: str | None = None
    stream: bool | None = None
    max_output_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(ge=0, le=1)] = None
    previous_response_id: Annotated[str | None, Field(min_length=1)] = None
    store: bool | None = None
    background: bool | None = None


def _input_problem(value: Any) -> tuple[str, str] | None:
    """What is wrong with a Responses `input`, as (its path, why); None when nothing is: text,
    or input items (objects with a string `type` or `role`) whose `content` is text or content
    parts (objects with a string `type`)."""
    if type(value) is str:
        return None
    if type(value) is not list:
        return "input", "must be a string or an array of input items"
    for index, item in enumerate(value):
        if type(item) is not dict:
            return f"input[{index}]", "must be an object"
        role = item.get("role")
        kind = item.get("type")
        if role is not None and (type(role) is not str or not role):
            return f"input[{index}].role", "must be a non-empty string"
        if kind is not None and (type(kind) is not str or not kind):
            return f"input[{index}].type", "must be a non-empty string"
        if role is None and kind is None:
            return f"input[{index}]", "must have a string 'type' or 'role'"
        content = item.get("content")
        if content is None or type(content) is str:
            continue
        if type(content) is not list:
            return f"input[{index}].content", "must be a string or an array of content parts"
        for number, part in enumerate(content):
            if type(part) is not dict or type(part.get("type")) is not str:
                return (
                    f"input[{index}].content[{number}]",
                    "must be an object with a string 'type'",
                )
    return None


_MODELS: Final[
    dict[
        str,
        type[ChatCompletionBody] | type[CompletionBody] | type[EmbeddingBody] | type[ResponseBody],
    ]
] = {
    "chat": ChatCompletionBody,
    "completion": CompletionBody,
    "embedding": EmbeddingBody,
    "response": ResponseBody,
}


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
    _check_fields(kind, document, bounds, containers)
    if not _conforms(kind, document):
        try:  # the models accept it after all, or name what is wrong in their words
            _MODELS[kind].model_validate(document)
        except ValidationError as exc:
            raise _bad_request(exc.errors(include_url=False)) from exc
        if kind == "response" and (problem := _input_problem(document["input"])):
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


def _conforms(kind: RunKind, document: dict[str, Any]) -> bool:
    """Whether the models would accept `document`, judged without them: True only when every
    field they check holds a value of exactly the type they take, in their bounds; anything
    else (rare: a wrong body, or an unusual spelling of a right one) goes to the models."""
    get = document.get
    model = get("model")
    if type(model) is not str or not model:
        return False
    if kind == "embedding":
        encoding = get("encoding_format")
        user = get("user")
        return (
            _text_or_token_ids(get("input"))
            and (encoding is None or encoding == "float" or encoding == "base64")
            and _optional_int(get("dimensions"), 1, None)
            and (user is None or type(user) is str)
        )
    stream = get("stream")
    if kind == "response":
        instructions = get("instructions")
        previous = get("previous_response_id")
        return (
            (stream is None or type(stream) is bool)
            and (instructions is None or type(instructions) is str)
            and (previous is None or (type(previous) is str and bool(previous)))
            and _optional_int(get("max_output_tokens"), 1, None)
            and _optional_number(get("temperature"), 2)
            and _optional_number(get("top_p"), 1)
            and _optional_bool(get("store"))
            and _optional_bool(get("background"))
            and _input_problem(get("input")) is None
        )
    options = get("stream_options")
    if not (
        (stream is None or type(stream) is bool)
        and _optional_int(get("max_tokens"), 1, None)
        and _optional_number(get("temperature"), 2)
        and _optional_number(get("top_p"), 1)
        and _optional_int(get("n"), 1, 128)
    ):
        return False
    if options is not None:
        if type(options) is not dict:
            return False
        usage = options.get("include_usage")
        if usage is not None and type(usage) is not bool:
            return False
    if kind == "completion":
        return _text_or_token_ids(get("prompt"))
    messages = get("messages")
    if type(messages) is not list or not messages:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        role = message.get("role")
        if type(role) is not str or not role:
            return False
        content = message.get("content")
        if content is None or type(content) is str:
            continue
        if type(content) is not list:
            return False
        for part in content:
            if type(part) is not dict or type(part.get("type")) is not str:
                return False
    return _optional_int(get("max_completion_tokens"), 1, None)


def _optional_int(value: Any, low: int, high: int | None) -> bool:
    return value is None or (
        type(value) is int and value >= low and (high is None or value <= high)
    )


def _optional_bool(value: Any) -> bool:
    return value is None or type(value) is bool


def _optional_number(value: Any, high: int) -> bool:
    return value is None or ((type(value) is float or type(value) is int) and 0 <= value <= high)


def _text_or_token_ids(value: Any) -> bool:
    """What `_text_or_tokens` accepts, in its three shapes of arrays."""
    if type(value) is str:
        return True
    if type(value) is not list or not value:
        return False
    first = type(value[0])
    if first is str or first is int:
        return all(type(item) is first for item in value)
    return first is list and all(
        type(item) is list and all(type(i) is int for i in item) for item in value
    )


_BOUNDS: Final = BodyBounds()

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
