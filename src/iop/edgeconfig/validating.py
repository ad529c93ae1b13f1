"""Checks that relate config values to each other: unique ids, references, budgets, secrets.

They read the raw document (snake_case or camelCase keys) rather than the typed model, so they
still run when some section has a type error: one run of `iop config check` reports every
problem. Each check skips a value whose type is wrong; the schema reports that one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import orjson

from iop.aiokits import split_listener

from .edgesections import NodeLinkSection
from .errors import Problem, render_value
from .fields import camel_name, is_loopback_listener
from .limitsections import EVERY_PRINCIPAL
from .nodespecs import EDGE_PLACEMENT
from .openaisections import ANONYMOUS_PRINCIPAL
from .prioritysections import DEFAULT_PRIORITY_CLASS
from .secrets import RAW_SECRET_KEYS, RAW_SECRET_VALUE, normalized_key

# Keys ending like a secret's name, or values starting like one (a superset of the walk's rules).
_SUSPICIOUS = (b'token":', b'key":', b'password":', b'secret":', b'"sk-', b'"bearer')


def close_match_hint(word: str, choices: list[str]) -> str:
    """`; did you mean "x"?` when one of `choices` is close to `word`, else ""."""
    matches = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f'; did you mean "{matches[0]}"?' if matches else ""


def _get(mapping: Mapping[str, object], name: str) -> tuple[str, object]:
    """The key actually used for field `name` (snake or camel) and its value (None if absent)."""
    if name in mapping:
        return name, mapping[name]
    camel = camel_name(name)
    return camel, mapping.get(camel)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class _Provider:
    path: str
    served_models: list[str] | None
    long_context_slots: int | None
    limits_long: bool


@dataclass
class _Index:
    providers: dict[str, _Provider] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    def duplicate(self, seen: dict[str, str], key: str, path: str, what: str) -> None:
        if key in seen:
            self.problems.append(Problem(path, f'duplicate {what} "{key}" (first at {seen[key]})'))
        else:
            seen[key] = path


def _items(
    data: Mapping[str, object], name: str, prefix: str = ""
) -> Iterator[tuple[str, Mapping[str, object]]]:
    key, value = _get(data, name)
    if isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, Mapping):
                yield f"{prefix}{key}[{index}]", item


def check_document(data: Mapping[str, object]) -> list[Problem]:
    """Every cross-reference problem in a raw config document."""
    index = _Index()
    if _may_hold_secrets(data):
        _check_secrets(data, "", index.problems)
    _check_nodes(data, index)
    _check_models(data, index)
    _check_fallbacks(data, index)
    _check_principal_tokens(data, index)
    _check_limits(data, index)
    _check_priority(data, index)
    _check_admin(data, index)
    _check_node_link(data, index)
    return index.problems


def _may_hold_secrets(data: object) -> bool:
    """A C-speed look over the whole document; only a suspicious one is walked key by key."""
    try:
        blob = orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return True
    lowered = blob.lower()
    return any(marker in lowered for marker in _SUSPICIOUS)


def _check_secrets(value: object, path: str, problems: list[Problem]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            item_path = f"{path}.{key}" if path else str(key)
            normalized = normalized_key(str(key))
            if normalized in RAW_SECRET_KEYS:
                problems.append(Problem(item_path, _secret_advice(normalized)))
            else:
                _check_secrets(item, item_path, problems)
    elif isinstance(value, list):
        for position, item in enumerate(value):
            _check_secrets(item, f"{path}[{position}]", problems)
    elif isinstance(value, str) and RAW_SECRET_VALUE.match(value):
        leaf = path.rsplit(".", 1)[-1]
        if "sha256" not in leaf.lower():  # the schema explains bad hashes itself
            problems.append(
                Problem(path, "looks like a raw API key or token; " + _secret_advice("token"))
            )


def _secret_advice(key: str) -> str:
    if key == "apikey":
        return (
            "raw API keys never go in the config: name the environment variable that holds "
            "the key in adapter.api_key_env"
        )
    return (
        "raw tokens never go in the config: put the token's SHA-256 (64 lowercase hex, "
        'printf %s "$TOKEN" | sha256sum) in token_hash_sha256 instead'
    )


def _check_nodes(data: Mapping[str, object], index: _Index) -> None:
    node_ids: dict[str, str] = {}
    provider_ids: dict[str, str] = {}
    for node_path, node in _items(data, "nodes"):
        id_key, node_id = _get(node, "id")
        if isinstance(node_id, str):
            index.duplicate(node_ids, node_id, f"{node_path}.{id_key}", "node id")
        for provider_path, provider in _items(node, "providers", f"{node_path}."):
            id_key, provider_id = _get(provider, "id")
            if not isinstance(provider_id, str):
                continue
            index.duplicate(provider_ids, provider_id, f"{provider_path}.{id_key}", "provider id")
            _, served = _get(provider, "served_models")
            served_list = (
                [s for s in served if isinstance(s, str)] if isinstance(served, list) else None
            )
            _, capacity = _get(provider, "capacity")
            slots_key, slots_value = _get(provider, "long_context_slots")
            slots = _int(slots_value)
            cap = _int(capacity) if capacity is not None else 1
            if slots is not None and cap is not None and slots > cap:
                index.problems.append(
                    Problem(
                        f"{provider_path}.{slots_key}",
                        f"must be <= capacity ({cap}), got {slots}",
                    )
                )
            index.providers.setdefault(
                provider_id,
                _Provider(provider_path, served_list, slots, slots_value is not None),
            )


def _check_models(data: Mapping[str, object], index: _Index) -> None:
    model_ids: dict[str, str] = {}
    known = sorted(index.providers)
    for model_path, model in _items(data, "models"):
        id_key, model_id = _get(model, "id")
        if isinstance(model_id, str):
            index.duplicate(model_ids, model_id, f"{model_path}.{id_key}", "model id")
    _check_adapters(data, index, model_ids)
    for model_path, model in _items(data, "models"):
        providers_key, mapping = _get(model, "providers")
        if not isinstance(mapping, Mapping):
            continue
        mapped: list[_Provider] = []
        for provider_id, served_name in mapping.items():
            path = f"{model_path}.{providers_key}.{provider_id}"
            provider = index.providers.get(str(provider_id))
            if provider is None:
                hint = close_match_hint(str(provider_id), known)
                index.problems.append(Problem(path, f'unknown provider "{provider_id}"{hint}'))
                continue
            mapped.append(provider)
            served = provider.served_models
            if isinstance(served_name, str) and served is not None and served_name not in served:
                hint = close_match_hint(served_name, served)
                index.problems.append(
                    Problem(
                        path,
                        f'"{served_name}" is not served by provider "{provider_id}" '
                        f"({provider.path}.served_models: {render_value(served)}){hint}",
                    )
                )
        if (
            mapped
            and len(mapped) == len(mapping)
            and all(p.limits_long and p.long_context_slots == 0 for p in mapped)
        ):
            names = ", ".join(str(k) for k in mapping)
            index.problems.append(
                Problem(
                    f"{model_path}.{providers_key}",
                    "no provider of this model can take a long-context request "
                    f"(long_context_slots is 0 on {names}); give one of them long slots",
                )
            )


def _adapters(model: Mapping[str, object]) -> tuple[str, list[str]]:
    """The key of `models[].adapters` and the names it lists (those that are strings)."""
    key, adapters = _get(model, "adapters")
    names = (
        [name for name in adapters if isinstance(name, str)] if isinstance(adapters, list) else []
    )
    return key, names


def _check_adapters(
    data: Mapping[str, object], index: _Index, model_ids: Mapping[str, str]
) -> None:
    """`models[].adapters`: each name a catalog key of its own (no model id, no other adapter),
    on a model that has providers to run it."""
    seen: dict[str, str] = {}
    for model_path, model in _items(data, "models"):
        key, adapters = _get(model, "adapters")
        if not isinstance(adapters, list):
            continue
        _, mapping = _get(model, "providers")
        if adapters and (not isinstance(mapping, Mapping) or not mapping):
            index.problems.append(
                Problem(
                    f"{model_path}.{key}",
                    "a LoRA adapter runs on its model's providers, and this model has none: "
                    "map the providers that serve its base model",
                )
            )
        for position, name in enumerate(adapters):
            if not isinstance(name, str):
                continue  # the schema reports it
            path = f"{model_path}.{key}[{position}]"
            if name in model_ids:
                index.problems.append(
                    Problem(
                        path,
                        f'adapter "{name}" has the name of a model ({model_ids[name]}): a '
                        "request's model must name one or the other",
                    )
                )
            else:
                index.duplicate(seen, name, path, "adapter")


def _check_fallbacks(data: Mapping[str, object], index: _Index) -> None:
    """`models[].fallbacks`: known ids, none twice in one list, no model falling back to itself,
    directly or through others (each cycle reported once, where it closes)."""
    model_ids: list[str] = []
    edges: dict[str, list[tuple[str, str]]] = {}  # model id -> (fallback id, its path)
    for _, model in _items(data, "models"):
        _, model_id = _get(model, "id")
        if isinstance(model_id, str) and model_id not in edges:
            model_ids.append(model_id)
            edges[model_id] = []
    adapters = {name for _, model in _items(data, "models") for name in _adapters(model)[1]}
    for model_path, model in _items(data, "models"):
        _, model_id = _get(model, "id")
        key, fallbacks = _get(model, "fallbacks")
        if not isinstance(model_id, str) or not isinstance(fallbacks, list):
            continue
        seen: dict[str, str] = {}
        for position, fallback in enumerate(fallbacks):
            path = f"{model_path}.{key}[{position}]"
            if not isinstance(fallback, str):
                continue  # the schema reports it
            if fallback == model_id:
                index.problems.append(Problem(path, "a model cannot fall back to itself"))
            elif fallback not in edges and fallback in adapters:
                index.problems.append(
                    Problem(path, f'"{fallback}" is a LoRA adapter: a fallback is a model')
                )
            elif fallback not in edges:
                hint = close_match_hint(fallback, model_ids)
                index.problems.append(Problem(path, f'unknown model "{fallback}"{hint}'))
            elif fallback in seen:
                index.duplicate(seen, fallback, path, "fallback")
            else:
                seen[fallback] = path
                edges[model_id].append((fallback, path))
    index.problems += _fallback_cycles(model_ids, edges)


def _fallback_cycles(
    model_ids: list[str], edges: Mapping[str, list[tuple[str, str]]]
) -> list[Problem]:
    """A problem for each cycle of fallbacks, at the fallback that closes it (depth first, in
    document order)."""
    problems: list[Problem] = []
    done: set[str] = set()
    for start in model_ids:
        if start in done:
            continue
        trail: list[str] = [start]  # the models on the current path, in order
        on_trail = {start}
        pending = [iter(edges[start])]
        while pending:
            step = next(pending[-1], None)
            if step is None:
                pending.pop()
                finished = trail.pop()
                on_trail.discard(finished)
                done.add(finished)
                continue
            target, path = step
            if target in on_trail:
                loop = [*trail[trail.index(target) :], target]
                problems.append(
                    Problem(path, "fallbacks must not form a cycle: " + " -> ".join(loop))
                )
            elif target not in done:
                trail.append(target)
                on_trail.add(target)
                pending.append(iter(edges[target]))
    return problems


def _check_principal_tokens(data: Mapping[str, object], index: _Index) -> None:
    _, openai = _get(data, "openai")
    if not isinstance(openai, Mapping):
        return
    refs: dict[str, str] = {}
    hashes: dict[str, str] = {}
    principals = {ANONYMOUS_PRINCIPAL}
    for token_path, token in _items(openai, "principal_tokens", "openai."):
        ref_key, ref = _get(token, "token_ref")
        if isinstance(ref, str):
            index.duplicate(refs, ref, f"{token_path}.{ref_key}", "token_ref")
        hash_key, digest = _get(token, "token_hash_sha256")
        if isinstance(digest, str):
            index.duplicate(hashes, digest, f"{token_path}.{hash_key}", "token_hash_sha256")
        _, principal = _get(token, "principal_ref")
        if isinstance(principal, str):
            principals.add(principal)
    weights_key, weights = _get(openai, "principal_weights")
    if isinstance(weights, Mapping):
        for principal in weights:
            if principal not in principals:
                known = sorted(principals)
                index.problems.append(
                    Problem(
                        f"openai.{weights_key}.{principal}",
                        f"no principal_tokens entry bills to principal {render_value(principal)}"
                        f"{close_match_hint(str(principal), known)}",
                    )
                )


def _check_limits(data: Mapping[str, object], index: _Index) -> None:
    """`openai.limits[]`: each entry names a known principal, a token of that principal and a
    model of the catalog; no two entries select the same requests."""
    _, openai = _get(data, "openai")
    if not isinstance(openai, Mapping):
        return
    principal_of: dict[str, str] = {}  # token_ref -> principal_ref
    principals = {ANONYMOUS_PRINCIPAL}
    for _, entry in _items(openai, "principal_tokens"):
        _, ref = _get(entry, "token_ref")
        _, principal = _get(entry, "principal_ref")
        if isinstance(principal, str):
            principals.add(principal)
            if isinstance(ref, str):
                principal_of.setdefault(ref, principal)
    model_ids = []
    for _, model_entry in _items(data, "models"):
        _, model_id = _get(model_entry, "id")
        if isinstance(model_id, str):
            model_ids.append(model_id)
        model_ids += _adapters(model_entry)[1]  # an adapter is a catalog key too
    seen: dict[str, str] = {}
    for limit_path, limit in _items(openai, "limits", "openai."):
        principal_key, principal = _get(limit, "principal_ref")
        token_key, token = _get(limit, "token_ref")
        model_key, model = _get(limit, "model")
        if not isinstance(principal, str):
            continue  # the schema reports it
        if principal != EVERY_PRINCIPAL and principal not in principals:
            known = sorted(principals)
            index.problems.append(
                Problem(
                    f"{limit_path}.{principal_key}",
                    f"no principal_tokens entry bills to principal {render_value(principal)}"
                    f"{close_match_hint(principal, known)} (or '*' for every principal)",
                )
            )
        if isinstance(token, str):
            owner = principal_of.get(token)
            if owner is None:
                hint = close_match_hint(token, sorted(principal_of))
                index.problems.append(
                    Problem(f"{limit_path}.{token_key}", f'unknown token_ref "{token}"{hint}')
                )
            elif principal == EVERY_PRINCIPAL:
                index.problems.append(
                    Problem(
                        f"{limit_path}.{principal_key}",
                        f'a token belongs to one principal: name "{owner}", the principal of '
                        f"token_ref \"{token}\", instead of '*'",
                    )
                )
            elif owner != principal:
                index.problems.append(
                    Problem(
                        f"{limit_path}.{token_key}",
                        f'token_ref "{token}" bills to principal "{owner}", not "{principal}"',
                    )
                )
        if isinstance(model, str) and model not in model_ids:
            hint = close_match_hint(model, model_ids)
            index.problems.append(
                Problem(f"{limit_path}.{model_key}", f'unknown model "{model}"{hint}')
            )
        selector = (
            f"principal_ref={principal}, token_ref={token if isinstance(token, str) else '*'}, "
            f"model={model if isinstance(model, str) else '*'}"
        )
        if selector in seen:
            index.problems.append(
                Problem(
                    limit_path,
                    f"selects the same requests as {seen[selector]} ({selector}): "
                    "put every limit of one selection in one entry",
                )
            )
        else:
            seen[selector] = limit_path


def _principals(openai: Mapping[str, object]) -> set[str]:
    """The principal_refs `openai.principal_tokens` bills to, and 'anonymous'."""
    principals = {ANONYMOUS_PRINCIPAL}
    for _, token in _items(openai, "principal_tokens"):
        _, principal = _get(token, "principal_ref")
        if isinstance(principal, str):
            principals.add(principal)
    return principals


def _check_priority(data: Mapping[str, object], index: _Index) -> None:
    """`openai.priority`: unique class names, and every class named by the default, a principal
    or a model defined; each principal once, and known."""
    _, openai = _get(data, "openai")
    _, priority = _get(openai, "priority") if isinstance(openai, Mapping) else ("", None)
    section = priority if isinstance(priority, Mapping) else {}
    seen: dict[str, str] = {}
    for class_path, entry in _items(section, "classes", "openai.priority."):
        name_key, name = _get(entry, "name")
        if isinstance(name, str):
            index.duplicate(seen, name, f"{class_path}.{name_key}", "priority class")
    classes = sorted(seen)

    def check_class(path: str, name: object) -> None:
        if isinstance(name, str) and name not in seen and name != DEFAULT_PRIORITY_CLASS:
            hint = close_match_hint(name, classes)
            defined = ", ".join(sorted({*classes, DEFAULT_PRIORITY_CLASS}))
            index.problems.append(
                Problem(
                    path,
                    f"unknown priority class {render_value(name)}{hint} (known: {defined})",
                )
            )

    default_key, default = _get(section, "default_class")
    check_class(f"openai.priority.{default_key}", default)
    principals = _principals(openai) if isinstance(openai, Mapping) else {ANONYMOUS_PRINCIPAL}
    named: dict[str, str] = {}
    for entry_path, entry in _items(section, "principals", "openai.priority."):
        ref_key, ref = _get(entry, "principal_ref")
        if isinstance(ref, str):
            index.duplicate(named, ref, f"{entry_path}.{ref_key}", "principal_ref")
            if ref not in principals:
                index.problems.append(
                    Problem(
                        f"{entry_path}.{ref_key}",
                        f"no principal_tokens entry bills to principal {render_value(ref)}"
                        f"{close_match_hint(ref, sorted(principals))}",
                    )
                )
        class_key, name = _get(entry, "priority_class")
        check_class(f"{entry_path}.{class_key}", name)
    for model_path, model in _items(data, "models"):
        class_key, name = _get(model, "priority_class")
        check_class(f"{model_path}.{class_key}", name)


def _check_admin(data: Mapping[str, object], index: _Index) -> None:
    _, edge = _get(data, "edge")
    if not isinstance(edge, Mapping):
        return
    admin_key, admin = _get(edge, "admin")
    if not isinstance(admin, Mapping):
        return
    listen_key, listen = _get(admin, "listen")
    if not isinstance(listen, str):
        return
    try:
        split_listener(listen)
    except ValueError:
        return  # the schema reports it
    _, digest = _get(admin, "token_hash_sha256")
    _, token_file = _get(admin, "token_file")
    if not is_loopback_listener(listen) and not digest and not token_file:
        index.problems.append(
            Problem(
                f"edge.{admin_key}.{listen_key}",
                f'"{listen}" is off loopback, so the admin API needs auth: set '
                "edge.admin.token_hash_sha256 or edge.admin.token_file",
            )
        )


def _check_node_link(data: Mapping[str, object], index: _Index) -> None:
    """Every node that dials in keeps one connection to each Edge replica: the hub must admit
    them all, or the ones past `edge.node_link.max_connections` are refused for as long as the
    config holds. Nothing legitimate needs fewer, so it is a refusal, not a warning.
    `max_unauthenticated_connections` is not held against the nodes: a reconnect storm past
    it is admitted in turns (each refused Node retries), not turned away."""
    dialing = 0
    for _, node in _items(data, "nodes"):
        _, placement = _get(node, "placement")
        if placement != EDGE_PLACEMENT:
            dialing += 1
    path: list[str] = []
    section: object = data
    for name in ("edge", "node_link", "max_connections"):
        mapping = section if isinstance(section, Mapping) else {}
        key, section = _get(mapping, name)
        path.append(key if key in mapping else name)  # an absent key is named in snake_case
    default = NodeLinkSection.model_fields["max_connections"].default
    cap = default if section is None else _int(section)
    if cap is not None and dialing > cap:
        index.problems.append(
            Problem(
                ".".join(path),
                f"must be >= the {dialing} nodes that dial in (each keeps one connection per "
                f"Edge replica; nodes with placement edge do not count), got {cap}",
            )
        )
