"""Turns YAML text, a file or a parsed document into an `EdgeConfig`, or a `ConfigError`.

This is the only way in: whatever the input, the caller gets a complete, valid, immutable config
or every problem with its path. Pydantic's errors are translated here, once, into sentences
that name the path, what is expected and what was found. Config text can come from outside (the
admin API's `config_yaml`), so parsing is bounded: the text by `MAX_CONFIG_BYTES`, YAML aliases
by `MAX_ALIAS_EXPANSION` nodes beyond the text's own ("billion laughs"), and nesting by
`MAX_DEPTH`, measured on the parser's (iterative) event stream before libyaml's composer, which
recurses in C, could overflow the stack (docs/reliability.md, "Summary").
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from .configs import EdgeConfig
from .errors import ConfigError, Problem, render_value
from .fields import PATTERN_MESSAGES
from .secrets import is_secret_field
from .validating import check_document, close_match_hint

#: Largest config text parsed: far above any real config (a CRD spec is capped near 1.5 MB).
MAX_CONFIG_BYTES: Final = 8 * 1024 * 1024
#: Nodes that YAML aliases may add to a document beyond those written out. Anchors that reuse
#: a provider's settings a thousand times stay far below; nested aliases that multiply a few
#: hundred bytes into billions of nodes are refused.
MAX_ALIAS_EXPANSION: Final = 100_000
#: Deepest nesting of mappings and sequences a config may have (a real one has about eight).
MAX_DEPTH: Final = 64

_SECTION_ORDER = {name: i for i, name in enumerate(EdgeConfig.model_fields)}


_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built with it


class _UniqueKeyLoader(_BaseLoader):  # type: ignore[misc]
    """A safe YAML loader that refuses duplicate keys instead of keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark
                ) from None
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f'duplicate key "{key}" (first on line {first + 1})',
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping
)


class _DuplicateKey(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        counts = Counter(key for key, _ in pairs)
        raise _DuplicateKey(next(key for key, count in counts.items() if count > 1))
    return mapping


def _too_deep() -> ConfigError:
    return ConfigError([Problem("", "the document is nested too deeply to be a config")])


_OPENS: Final = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSES: Final = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def _check_depth(text: str) -> None:
    """Refuse a document nested deeper than `MAX_DEPTH`, from the parser's events alone."""
    depth = 0
    for event in yaml.parse(text, Loader=_BaseLoader):
        if isinstance(event, _OPENS):
            depth += 1
            if depth > MAX_DEPTH:
                raise _too_deep()
        elif isinstance(event, _CLOSES):
            depth -= 1


def _check_aliases(root: yaml.Node) -> None:
    """Refuse a document whose aliases would expand it by more than `MAX_ALIAS_EXPANSION`
    nodes; counts each node once per reference, memoizing shared subtrees (so it costs a walk
    of the composed graph, not of the expansion)."""
    sizes: dict[int, int] = {}
    written: set[int] = set()

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        written.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                total += size(key) + size(value)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
        if total > MAX_ALIAS_EXPANSION * 2:
            raise _Expansion
        sizes[id(node)] = total
        return total

    try:
        expanded = size(root)
    except _Expansion:
        expanded = MAX_ALIAS_EXPANSION * 2 + 1
    if expanded - len(written) > MAX_ALIAS_EXPANSION:
        raise ConfigError(
            [
                Problem(
                    "",
                    "YAML aliases expand the document too far (more than "
                    f"{MAX_ALIAS_EXPANSION} nodes beyond those written)",
                )
            ]
        )


class _Expansion(Exception):
    pass


def parse_yaml(text: str) -> object:
    """Parse YAML text with duplicate keys refused; errors become a `ConfigError`.

    JSON is YAML too, and a JSON document (what the operator renders) takes the C-speed path of
    the standard library's parser; anything else goes through PyYAML's safe loader, composed
    first so that alias expansion is checked before any object is built.
    """
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError([Problem("", f"the config text is larger than {MAX_CONFIG_BYTES} bytes")])
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text, object_pairs_hook=_unique_pairs)
        except _DuplicateKey as exc:
            raise ConfigError([Problem("", f'invalid JSON: duplicate key "{exc}"')]) from exc
        except RecursionError:
            raise _too_deep() from None
        except ValueError:
            pass  # a YAML flow mapping such as {edge: {id: a}}
    try:
        _check_depth(text)
        loader = _UniqueKeyLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                return None
            _check_aliases(root)
            return loader.construct_document(root)
        finally:
            loader.dispose()
    except RecursionError:
        raise _too_deep() from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        raise ConfigError([Problem(where, f"invalid YAML: {exc.problem or exc}")]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([Problem("", f"invalid YAML: {exc}")]) from exc


def load_text(text: str) -> EdgeConfig:
    """Load a config from YAML (or JSON) text."""
    if not text.strip():
        raise ConfigError([Problem("", "the config is empty")])
    return load_data(parse_yaml(text))


def load_file(path: str | Path) -> EdgeConfig:
    """Load a config from a YAML file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([Problem("", f"cannot read {path}: {exc.strerror or exc}")]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem("", f"{path} is not UTF-8 text")]) from exc
    return load_text(text)


def load_data(data: object) -> EdgeConfig:
    """Validate a parsed document; every problem (schema and cross-reference) at once."""
    try:
        return _load_data(data)
    except RecursionError:
        raise _too_deep() from None


def _load_data(data: object) -> EdgeConfig:
    if data is None:
        raise ConfigError([Problem("", "the config is empty")])
    if not isinstance(data, Mapping):
        kind = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise ConfigError([Problem("", f"the config must be a mapping of sections, got {kind}")])
    problems = check_document(data)
    secret_paths = {p.path for p in problems}
    config: EdgeConfig | None = None
    try:
        config = EdgeConfig.model_validate(data, strict=True)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            problem = _translate(error)
            if problem.path not in secret_paths:
                problems.append(problem)
    if problems or config is None:
        raise ConfigError(sorted(_dedupe(problems), key=_document_order))
    return config


def _dedupe(problems: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))


def _document_order(problem: Problem) -> tuple[object, ...]:
    head = re.split(r"[.\[]", problem.path, maxsplit=1)[0]
    tokens = re.findall(r"[0-9]+|[^0-9\[\].]+", problem.path)
    rest = [int(t) if t.isascii() and t.isdecimal() else t for t in tokens]
    return (
        _SECTION_ORDER.get(head, len(_SECTION_ORDER)),
        *((0, t) if isinstance(t, int) else (1, t) for t in rest),
    )


# -- pydantic error translation ------------------------------------------------------------------


def _without_userinfo(value: object) -> object:
    """A URL's credentials (`scheme://user:password@host`) never reach a problem."""
    if isinstance(value, str) and "://" in value and "@" in value:
        scheme, rest = value.split("://", 1)
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    return value


def _translate(error: ErrorDetails) -> Problem:
    path, model = _render_loc(error["loc"])
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    leaf = str(error["loc"][-1]) if error["loc"] else ""
    got = "" if is_secret_field(leaf) else f", got {render_value(_without_userinfo(value))}"
    message: str
    if kind == "missing":
        # pydantic names a missing field by its alias; the file's spelling is snake_case
        # (a camelCase document gets the camel path from its own keys elsewhere).
        snake = _field_name(model, leaf)
        if snake and snake != leaf and not _document_is_camel(error):
            path = path[: len(path) - len(leaf)] + snake
        message = "is required"
    elif kind == "extra_forbidden":
        known = _field_names(model) if model else []
        message = f"unknown key{close_match_hint(leaf, known)}"
    elif kind in _BOUND_WORDS:
        bound = next(iter(ctx.values()))
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        message = f"must be {_BOUND_WORDS[kind]} {bound}{got}"
    elif kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", ""))
        message = PATTERN_MESSAGES.get(pattern, error["msg"])
        if "sha256" in leaf.lower() and isinstance(value, str):
            message = _hash_message(value)
        else:
            message += got
    elif kind == "literal_error" and ctx.get("expected"):
        message = f"must be {ctx['expected']}{got}"
    elif kind in _TYPE_WORDS:
        message = f"must be {_TYPE_WORDS[kind]}{got}"
    elif kind == "too_short":
        message = f"must have at least {ctx.get('min_length', 1)} item(s)"
    elif kind == "string_too_short":
        message = "must not be empty"
    elif kind in ("union_tag_invalid", "union_tag_not_found"):
        tags = ctx.get("expected_tags", "")
        found = ctx.get("tag")
        message = f"type must be one of {tags}" + (f", got {render_value(found)}" if found else "")
    elif kind == "value_error":
        message = str(error["msg"]).removeprefix("Value error, ") + got
    else:
        message = f"{error['msg'][0].lower()}{error['msg'][1:]}{got}"
    return Problem(path, message)


def _hash_message(value: str) -> str:
    if value.startswith("sk-") or not re.fullmatch(r"[0-9a-fA-F]*", value):
        return (
            "looks like a raw token, not a SHA-256: put the token's SHA-256 (64 lowercase hex, "
            'printf %s "$TOKEN" | sha256sum) here and keep the token itself out of the config'
        )
    return PATTERN_MESSAGES[r"^[0-9a-f]{64}$"] + f" (got {len(value)} characters)"


_BOUND_WORDS = {
    "greater_than_equal": ">=",
    "greater_than": ">",
    "less_than_equal": "<=",
    "less_than": "<",
}
_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "literal_error": "one of the listed values",
}


def _render_loc(loc: tuple[int | str, ...]) -> tuple[str, type[BaseModel] | None]:
    """Render a pydantic location as `nodes[2].providers[0].capacity`.

    Walks the model alongside, so that discriminated-union tags (which pydantic puts in the
    location) are dropped, and returns the model that owns the last key (for "did you mean").
    """
    parts: list[str] = []
    current: Any = EdgeConfig
    owner: type[BaseModel] | None = None
    for item in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            owner = current
            field = _find_field(current, str(item))
            parts.append(f".{item}" if parts else str(item))
            current = field.annotation if field else None
        elif typing.get_origin(current) is list and isinstance(item, int):
            parts.append(f"[{item}]")
            current = typing.get_args(current)[0]
        elif typing.get_origin(current) is dict:
            parts.append(f".{item}" if item != "[key]" else " (key)")
            current = typing.get_args(current)[1]
        elif _is_union(current):
            tagged = [m for m in typing.get_args(current) if _tag_of(m) == item]
            if tagged:
                current = tagged[0]  # a discriminator tag: not part of the user's path
            else:
                parts.append(f".{item}")
                current = None
        else:
            parts.append(f"[{item}]" if isinstance(item, int) else f".{item}")
            current = None
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        owner = current if loc and _find_field(owner, str(loc[-1])) is None else owner
    return "".join(parts), owner


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if _is_union(annotation):
        members = [m for m in typing.get_args(annotation) if m is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return annotation


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _tag_of(model: Any) -> object:
    if isinstance(model, type) and issubclass(model, BaseModel) and "type" in model.model_fields:
        return model.model_fields["type"].default
    return None


def _find_field(model: type[BaseModel] | None, key: str) -> Any:
    if model is None:
        return None
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field
    return None


def _field_name(model: type[BaseModel] | None, key: str) -> str | None:
    for name, field in (model.model_fields if model else {}).items():
        if key in (name, field.alias):
            return name
    return None


def _document_is_camel(error: ErrorDetails) -> bool:
    """Whether the mapping that lacks the field spells its keys in camelCase."""
    value = error.get("input")
    return isinstance(value, Mapping) and any(isinstance(k, str) and k != k.lower() for k in value)


def _field_names(model: type[BaseModel]) -> list[str]:
    names: list[str] = []
    for name, field in model.model_fields.items():
        names.append(name)
        if field.alias and field.alias != name:
            names.append(field.alias)
    return names
