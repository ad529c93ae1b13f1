"""The reference table of every config field, rendered from the model itself.

`docs/config.md` embeds this table between markers and a test keeps it current, so the docs,
the JSON schema, `kubectl explain` and the change classifier all read the same descriptions.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .configs import EdgeConfig
from .fields import _SUFFIX, APPLY_KEY

_APPLY_WORDS = {"live": "live", "restart:edge": "restart (Edge)", "restart:node": "restart (node)"}


def field_table() -> str:
    """A Markdown table: path, type, default, how a change applies, description."""
    rows = ["| path | type | default | change | description |", "|---|---|---|---|---|"]
    for path, field, apply in _walk(EdgeConfig, "", None):
        description = (field.description or "").replace(_SUFFIX.get(apply or "", "@"), "").strip()
        rows.append(
            f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} "
            f"| {_APPLY_WORDS.get(apply or '', 'restart (Edge)')} | {description} |"
        )
    return "\n".join(rows) + "\n"


def _walk(
    model: type[BaseModel], prefix: str, inherited: str | None
) -> list[tuple[str, Any, str | None]]:
    found: list[tuple[str, Any, str | None]] = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        marker = extra.get(APPLY_KEY) if isinstance(extra, dict) else None
        apply = marker if isinstance(marker, str) else inherited
        path = f"{prefix}{name}"
        literal = typing.get_origin(field.annotation) is typing.Literal
        if literal and len(typing.get_args(field.annotation)) == 1:
            continue  # a discriminator: shown in the path as (type=...)
        found.append((path, field, apply))
        for inner, suffix in _nested_models(field.annotation):
            label = f"{path}{suffix}."
            if len(_nested_models(field.annotation)) > 1:
                label = f"{path}.(type={inner.model_fields['type'].default})."
            found += _walk(inner, label, apply)
    return found


def _nested_models(annotation: Any) -> list[tuple[type[BaseModel], str]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    origin = typing.get_origin(annotation)
    result: list[tuple[type[BaseModel], str]] = []
    for arg in typing.get_args(annotation):
        for model, suffix in _nested_models(arg):
            result.append((model, "[]" + suffix if origin is list else suffix))
    return result


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return "mapping" if issubclass(annotation, BaseModel) else annotation.__name__
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " or ".join(f"`{value}`" for value in typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if origin is typing.Annotated:
        return _type_name(args[0])
    nullable = len(args) < len(typing.get_args(annotation))
    names = " or ".join(sorted({_type_name(a) for a in args}))
    return f"{names} or null" if nullable else names


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return "`{}`" if field.default_factory is dict else "`[]`"
    value = field.default
    if value is PydanticUndefined or isinstance(value, BaseModel):
        return ""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`" if value != "" else '`""`'
