"""The OpenAI request bodies the Edge checks: the pydantic models (chat, completions,
embeddings, the Responses API) and the same rules by hand.

The models say what is checked: the fields the Edge reads or that a client most often gets
wrong, with strict types; every other field passes through untouched. A body is first checked by
hand against the same rules (`conforms`: no objects built); only one that fails goes through the
models (`MODELS`), so every refusal names its field in their words (`bad_request`). A Responses
`input` is checked by hand either way (`input_problem`), naming the item and the part.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import ErrorDetails

from iop.wire import RunKind

from .bodybounds import param_path
from .errors import BadRequest


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
    (`input_problem`), so a refusal names the item and the part: `input[2].content[0]`."""

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


def input_problem(value: Any) -> tuple[str, str] | None:
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


MODELS: Final[
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


def conforms(kind: RunKind, document: dict[str, Any]) -> bool:
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
            and input_problem(get("input")) is None
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


#: Fields whose problems are named first: what the request is about before how it samples.
_FIRST_FIELDS: Final = ("model", "messages", "prompt", "input")


def bad_request(errors: list[ErrorDetails]) -> BadRequest:
    """The refusal of a body the models did not accept: its first problem named (what the
    request is about first), and up to three others."""
    errors = sorted(
        errors,
        key=lambda e: (
            _FIRST_FIELDS.index(e["loc"][0])
            if e["loc"] and e["loc"][0] in _FIRST_FIELDS
            else len(_FIRST_FIELDS)
        ),
    )
    first = errors[0]
    param = param_path(first["loc"])
    if first["type"] == "missing":
        message = f"Missing required parameter: '{param}'."
    else:
        reason = first["msg"].removeprefix("Value error, ")
        message = f"Invalid value for '{param}': {reason}."
    if len(errors) > 1:
        others = ", ".join(f"'{param_path(e['loc'])}'" for e in errors[1:4])
        message += f" Also invalid: {others}{' and more' if len(errors) > 4 else ''}."
    return BadRequest(message, param)
