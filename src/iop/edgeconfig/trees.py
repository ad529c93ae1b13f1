"""A config as a plain tree keyed by ids, the common ground of hashing and classification.

Lists of things that have an id (nodes, providers, models, principal tokens; a limit's key is
its selector, `principal|token_ref|model`) become mappings
`{"[id]": item}`, and lists of names (served_models) become sorted lists, so that reordering
them is no change: two configs that mean the same have the same tree and the same hash. A list
whose order means something (`models[].fallbacks`, marked ordered in `modelspecs.py`) keeps it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from functools import cache
from typing import Any, Literal, NamedTuple, get_origin

import orjson
from pydantic import BaseModel

from .fields import APPLY_KEY, is_ordered

#: The field that identifies an item of a list, tried in order.
ID_FIELDS = ("id", "token_ref")


def item_key(item: BaseModel) -> str | None:
    """The id a list item is keyed by in paths (`nodes[node-1]`), or None if it has none."""
    for name in _key_names(type(item)):
        value = getattr(item, name)
        if isinstance(value, str):
            return value
    return None


@cache
def _key_names(cls: type[BaseModel]) -> tuple[str, ...]:
    """The attributes of `cls` that may key its items, in the order tried: `list_key` (an item
    keyed by several fields, openai.limits[]), then `ID_FIELDS`. Looked up once per class: an
    attribute a model lacks costs an exception each time it is asked for."""
    names = ["list_key"] if hasattr(cls, "list_key") else []
    return (*names, *(name for name in ID_FIELDS if name in cls.model_fields))


_LEAVES = frozenset({str, int, float, bool})


def to_tree(value: Any, *, defaults: bool = True) -> Any:
    """The canonical plain form of a config value (snake_case keys). `defaults=False` leaves
    out every field at its default (a discriminator such as an adapter's `type` stays)."""
    if value is None or type(value) in _LEAVES:  # most of a tree: no type tests further down
        return value
    if isinstance(value, BaseModel):
        tree = {}
        for name, _, ordered, default in field_specs(type(value)):
            item = getattr(value, name)
            if not defaults and default is not _NO_DEFAULT and bool(item == default):
                continue
            if ordered:
                tree[name] = [to_tree(v, defaults=defaults) for v in item]
            elif item is None or type(item) in _LEAVES:  # (most fields: no call for them)
                tree[name] = item
            else:
                tree[name] = to_tree(item, defaults=defaults)
        return tree
    if isinstance(value, list | tuple):
        # Each item's key looked up once (a config's hash keys every node and provider).
        keys = [item_key(v) if isinstance(v, BaseModel) else None for v in value]
        if value and None not in keys:
            return {
                f"[{key}]": to_tree(v, defaults=defaults)
                for key, v in zip(keys, value, strict=True)
            }
        return sorted((to_tree(v, defaults=defaults) for v in value), key=repr)
    if isinstance(value, Mapping):
        return {str(k): to_tree(v, defaults=defaults) for k, v in value.items()}
    return value


_NO_DEFAULT = object()


class FieldSpec(NamedTuple):
    """What the tree and the classification read of a model's field, once per class."""

    name: str
    #: Its apply marker (`configs.APPLY_KEY`); None: its parent's.
    apply: str | None
    #: A list whose order means something (see `configs.is_ordered`).
    ordered: bool
    #: Its default (`_NO_DEFAULT`: a required field, or a discriminator, which a tree keeps
    #: whatever its value).
    default: Any


@cache
def field_specs(cls: type[BaseModel]) -> tuple[FieldSpec, ...]:
    """Each field of `cls`, made once per class: a large config's hash asked pydantic for tens
    of thousands of defaults, each a look at its factory's signature, and its classification
    for as many markers."""
    fields = []
    for name, field in cls.model_fields.items():
        if field.is_required() or get_origin(field.annotation) is Literal:
            default = _NO_DEFAULT
        else:
            default = field.get_default(call_default_factory=True)
        extra = field.json_schema_extra
        marker = extra.get(APPLY_KEY) if isinstance(extra, dict) else None
        apply = marker if isinstance(marker, str) else None
        fields.append(FieldSpec(name, apply, is_ordered(field), default))
    return tuple(fields)


def config_hash(value: BaseModel) -> str:
    """SHA-256 of the canonical tree without the fields at their defaults: equal for configs
    that differ only in list order, and the same in a release that adds a field with a default
    (an operator and an Edge of two releases, mid-rollout, agree on the hash of a config that
    does not use the new field)."""
    data = orjson.dumps(to_tree(value, defaults=False), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(data).hexdigest()
