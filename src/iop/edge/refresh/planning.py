"""How a change goes on trial: which models it touches, and which of them take a canary (pure).

`plan` compares the stable revision's snapshot with the change's. A model is **touched** when
its dispatch view differs (candidates, their limits and served names, the policy, fallbacks,
timeouts, the generation policy; added or removed), or when a provider the stable revision sends
it to changed its adapter settings (URL, key variable, kind), moved or went. A touched model
takes a **canary** (a share of its requests, in steps) when, with `rollout.mode: canary`:

- it is in both configs and what serves it changed, not only how much: its providers, served
  names, policy, fallbacks, timeouts or generation policy (a change of capacity, priority or
  queues alone applies to all at once and is watched: it should not take a minute to apply);
- every provider the stable revision sends it to is still on its node with the same adapter
  settings. A Node process holds one adapter per provider, and a change of adapter settings
  is restart-required (the caller restarts the node, which comes back with the new ones), so
  the stable side could not find the provider it had: such a model goes all at once, and is
  watched.

The others of the touched models are served by the change at once and watched. docs/rollout.md,
"Which changes take a canary", has the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from iop.edgeconfig import EdgeConfig, ProviderPayload, ProviderSpec

from ..pool import PoolModel, PoolSnapshot


@dataclass(frozen=True, slots=True)
class Plan:
    #: The models whose dispatch view the change altered.
    touched: tuple[str, ...]
    #: Of those, the ones whose requests the canary shares (empty without `mode: canary`).
    shared: tuple[str, ...] = ()
    #: Why touched models that changed what serves them still apply to all at once.
    all_at_once: tuple[str, ...] = ()

    def describe(self, steps: list[int]) -> str:
        """The plan in one line, for the revision and the log."""
        parts: list[str] = []
        if self.shared:
            shares = " -> ".join(f"{step}%" for step in steps)
            parts.append(f"canary {shares} for {_names(self.shared)}")
        rest = [model for model in self.touched if model not in self.shared]
        if rest:
            parts.append(f"all at once, watched, for {_names(rest)}")
        parts.extend(self.all_at_once)
        return "; ".join(parts)


def plan(stable: PoolSnapshot, after: PoolSnapshot) -> Plan:
    """The trial of `after` against the stable revision's snapshot; see the module."""
    gone = _provider_changes(stable.config, after.config)

    def uses_changed(model: PoolModel | None) -> bool:
        return model is not None and any(c.provider.id in gone for c in model.candidates)

    names = set(stable.models) | set(after.models)
    touched = tuple(
        sorted(
            m
            for m in names
            if stable.models.get(m) != after.models.get(m) or uses_changed(stable.models.get(m))
        )
    )
    if after.config.rollout.mode != "canary" or not touched:
        return Plan(touched)
    shared: list[str] = []
    notes: list[str] = []
    for model_id in touched:
        before, now = stable.models.get(model_id), after.models.get(model_id)
        if before is None or now is None:
            continue
        uses = sorted(c.provider.id for c in before.candidates)
        why = [gone[provider_id] for provider_id in uses if provider_id in gone]
        if why:
            notes.append(f"{model_id} all at once: {why[0]}")
        elif _essence(before) != _essence(now):
            shared.append(model_id)
    return Plan(touched, tuple(shared), tuple(notes))


def _essence(model: PoolModel) -> tuple[Any, ...]:
    """What serves a model, without how much: a change of limits alone leaves it equal."""
    return (
        frozenset((c.provider.id, c.served_model) for c in model.candidates),
        model.generation,
        model.fallbacks,
        model.first_byte_timeout_s,
        model.dispatch,
    )


def _provider_changes(before: EdgeConfig, after: EdgeConfig) -> Mapping[str, str]:
    """The providers of `before` the stable side can no longer run on, id -> why: removed,
    moved to another node, or its adapter settings changed. Only nodes that changed are looked
    into."""
    after_nodes = {node.id: node for node in after.nodes}
    now: dict[str, tuple[str, ProviderSpec]] | None = None
    gone: dict[str, str] = {}
    for node in before.nodes:
        if after_nodes.get(node.id) == node:
            continue
        if now is None:
            now = {spec.id: (n.id, spec) for n in after.nodes for spec in n.providers}
        for spec in node.providers:
            found = now.get(spec.id)
            if found is None:
                gone[spec.id] = f"provider {spec.id} was removed"
            elif found[0] != node.id:
                gone[spec.id] = f"provider {spec.id} moved to node {found[0]}"
            elif _adapter(found[1]) != _adapter(spec):
                gone[spec.id] = (
                    f"provider {spec.id}'s adapter settings on node {node.id} changed (its node "
                    "restarts with them: one adapter per provider)"
                )
    return gone


def _adapter(spec: ProviderSpec) -> dict[str, Any]:
    return ProviderPayload.adapter_document(spec.adapter)


def _names(models: list[str] | tuple[str, ...]) -> str:
    shown = ", ".join(models[:8])
    return shown if len(models) <= 8 else f"{shown} and {len(models) - 8} more"
