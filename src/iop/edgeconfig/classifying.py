"""Classify every change between two configs as live or restart-required.

The rule for each field is the `x-iop-apply` marker on it in the model (`configs.py` and the
section modules beside it; the nearest marker up the path wins); a path without one is
restart-required for the Edge (fail safe). Lists of items with ids are compared by id, so
reordering is no change; an item added or removed takes the marker of its list: a node is an
Edge restart, a provider its node's restart, a model is live.
A node's restart is the Edge's when the node is placed on the Edge (`placement: edge`).
Lists of names are compared as sets, except those marked ordered (`models[].fallbacks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .configs import EdgeConfig
from .fields import LIVE, RESTART_NODE
from .modelspecs import ModelSpec
from .nodespecs import NodeSpec, ProviderSpec
from .payloads import NodePayload
from .reports import ChangeReport, RestartPath
from .trees import field_specs, item_key


@dataclass(frozen=True, slots=True)
class _Change:
    path: str
    apply: str | None
    node: str | None
    provider: str | None
    model: str | None


def classify(
    old: EdgeConfig,
    new: EdgeConfig,
    *,
    payloads: tuple[Mapping[str, NodePayload], Mapping[str, NodePayload]] | None = None,
) -> ChangeReport:
    """What changed from `old` to `new`, and how each change must be applied. `payloads`: each
    node's payload under `old` and under `new`, when the caller has them (else they are built)."""
    changes: list[_Change] = []
    _diff(old, new, None, "", _Where(), changes)

    live: set[str] = set()
    restart: set[RestartPath] = set()
    nodes: set[str] = set()
    providers: set[str] = set()
    models: set[str] = set()
    # A node placed on the Edge has no workload of its own: the Edge is its workload.
    on_edge = {node.id for node in (*old.nodes, *new.nodes) if node.on_edge}
    for change in changes:
        if change.apply == LIVE:
            live.add(change.path)
        else:
            node_id = change.node
            scope = (
                f"node:{node_id}"
                if change.apply == RESTART_NODE and node_id and node_id not in on_edge
                else "edge"
            )
            restart.add(RestartPath(change.path, scope))
        for bucket, key in (
            (nodes, change.node),
            (providers, change.provider),
            (models, change.model),
        ):
            if key is not None:
                bucket.add(key)
    # A node added or removed brings or takes all its providers with it.
    whole_items = {change.path for change in changes}
    for node in (*old.nodes, *new.nodes):
        if f"nodes[{node.id}]" in whole_items:
            providers.update(p.id for p in node.providers)

    return ChangeReport(
        changed_nodes=tuple(sorted(nodes)),
        changed_providers=tuple(sorted(providers)),
        changed_models=tuple(sorted(models)),
        live_paths=tuple(sorted(live)),
        restart_required_paths=tuple(sorted(restart, key=lambda p: (p.path, p.scope))),
        node_payload_changed=_payload_changes(old, new, nodes, payloads),
    )


def _payload_changes(
    old: EdgeConfig,
    new: EdgeConfig,
    changed: set[str],
    payloads: tuple[Mapping[str, NodePayload], Mapping[str, NodePayload]] | None,
) -> dict[str, bool]:
    """For each node of `new`: does it need a push? Only changed nodes are looked at closely."""
    before = {node.id: node for node in old.nodes}
    olds, news = payloads if payloads is not None else ({}, {})
    result: dict[str, bool] = {}
    for node in sorted(new.nodes, key=lambda n: n.id):
        previous = before.get(node.id)
        if node.id not in changed or previous is None:
            result[node.id] = node.id in changed
            continue
        was = olds.get(node.id) or NodePayload.of(previous)
        result[node.id] = was != (news.get(node.id) or NodePayload.of(node))
    return result


@dataclass(frozen=True, slots=True)
class _Where:
    node: str | None = None
    provider: str | None = None
    model: str | None = None

    def entering(self, item: BaseModel, key: str) -> _Where:
        if isinstance(item, NodeSpec):
            return _Where(node=key)
        if isinstance(item, ProviderSpec):
            return _Where(node=self.node, provider=key)
        if isinstance(item, ModelSpec):
            return _Where(model=key)
        return self


def _diff(
    old: Any, new: Any, apply: str | None, path: str, where: _Where, out: list[_Change]
) -> None:
    """Append a change for every differing leaf; `apply` is the nearest marker above.

    A list is compared item by item (an equal item skipped whole) rather than whole first, so
    a config of thousands of nodes is not compared again at every level on the way down."""
    if isinstance(old, BaseModel) and type(old) is type(new):
        for name, marker, ordered, _ in field_specs(type(old)):
            before, after = getattr(old, name), getattr(new, name)
            if type(before) is not list and before == after:  # (a list: item by item below)
                continue
            field_path = f"{path}.{name}" if path else name
            apply_here = marker if marker is not None else apply
            if not ordered:
                _diff(before, after, apply_here, field_path, where, out)
            elif before != after:
                out.append(_Change(field_path, apply_here, where.node, where.provider, where.model))
        return
    if _is_keyed_list(old) and _is_keyed_list(new):
        olds = {item_key(item): item for item in old}
        news = {item_key(item): item for item in new}
        for key in sorted(olds.keys() | news.keys(), key=str):
            before, after = olds.get(key), news.get(key)
            if before is not None and after is not None and before == after:
                continue
            item_path = f"{path}[{key}]"
            sample = before if before is not None else after
            assert sample is not None and key is not None
            inner = where.entering(sample, key)
            if before is None or after is None:
                out.append(_Change(item_path, apply, inner.node, inner.provider, inner.model))
            else:
                _diff(before, after, apply, item_path, inner, out)
        return
    if old == new:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys(), key=str):
            if old.get(key) != new.get(key):
                out.append(_Change(f"{path}.{key}", apply, where.node, where.provider, where.model))
        return
    if (
        isinstance(old, list)
        and isinstance(new, list)
        and sorted(map(repr, old)) == sorted(map(repr, new))
    ):
        return  # the same names in another order
    out.append(_Change(path, apply, where.node, where.provider, where.model))


def _is_keyed_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(item, BaseModel) and item_key(item) is not None for item in value
    )
