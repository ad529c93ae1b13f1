"""How a change goes on trial: which models it touches, and which of them take a canary (pure).

`plan` compares the stable revision's snapshot with the change's. A model is **touched** when
its dispatch view differs (candidates, their limits and served names, the policy, fallbacks,
timeouts, the generation policy; added or removed). A touched model takes a **canary** (a share
of its requests, in steps) when, with `rollout.mode: canary`:

- it is in both configs and what serves it changed, not only how much: its providers, served
  names, policy, fallbacks, timeouts or generation policy (a change of capacity, priority or
  queues alone applies to all at once and is watched: it should not take a minute to apply);
- every provider the stable revision sends it to is still on its node with the same adapter
  settings (the Nodes keep one registry per provider, so the stable side must still find the
  provider it had; a provider whose URL, key or kind changed is applied to all at once).

The others of the touched models are served by the change at once and watched. docs/rollout.md,
"Which changes take a canary", has the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from iop.edgeconfig import EdgeConfig, ProviderPayload

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
    names = set(stable.models) | set(after.models)
    touched = tuple(sorted(m for m in names if stable.models.get(m) != after.models.get(m)))
    if after.config.rollout.mode != "canary" or not touched:
        return Plan(touched)
    shared: list[str] = []
    notes: list[str] = []
    moved: Mapping[str, str] | None = None
    for model_id in touched:
        before, now = stable.models.get(model_id), after.models.get(model_id)
        if before is None or now is None or _essence(before) == _essence(now):
            continue
        gone = moved = moved if moved is not None else _moved_providers(stable.config, after.config)
        why = [gone[c.provider.id] for c in before.candidates if c.provider.id in gone]
        if why:
            notes.append(f"{model_id} all at once: {why[0]}")
        else:
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


def _moved_providers(before: EdgeConfig, after: EdgeConfig) -> Mapping[str, str]:
    """provider id -> why the stable side could no longer run on it: gone, moved to another
    node, or its adapter settings changed (what its Node's one registry holds)."""
    now = _adapters(after)
    moved: dict[str, str] = {}
    for provider_id, (node_id, adapter) in _adapters(before).items():
        found = now.get(provider_id)
        if found is None:
            moved[provider_id] = f"provider {provider_id} was removed"
        elif found[0] != node_id:
            moved[provider_id] = f"provider {provider_id} moved to node {found[0]}"
        elif found[1] != adapter:
            moved[provider_id] = (
                f"provider {provider_id}'s settings on node {node_id} changed "
                "(a Node holds one registry)"
            )
    return moved


def _adapters(config: EdgeConfig) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        spec.id: (node.id, ProviderPayload.adapter_document(spec.adapter))
        for node in config.nodes
        for spec in node.providers
    }


def _names(models: list[str] | tuple[str, ...]) -> str:
    shown = ", ".join(models[:8])
    return shown if len(models) <= 8 else f"{shown} and {len(models) - 8} more"
