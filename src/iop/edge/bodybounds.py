"""A request body's bulk, bounded before and as it is parsed (`openai.max_body_*`,
`max_messages`, `max_content_parts`, `max_inputs`).

`check_structure` counts a raw body's objects, arrays and items by its brackets and commas
before any parser sees it (a parser's cost is per value); `check_fields` bounds the fields that
hold a parsed body's bulk (messages, content parts, inputs) and its depth, each refusal naming
its field (`param_path`). docs/reliability.md, "Bodies and budgets that could be gamed".
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from iop.edgeconfig import OpenAISection
from iop.wire import RunKind

from .errors import BadRequest


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


def check_fields(
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
        param = param_path(tuple(reversed(path)))
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


def param_path(loc: tuple[int | str, ...]) -> str:
    """A field's path as a refusal names it: `messages[2].content`."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text
