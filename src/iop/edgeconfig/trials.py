"""How a change goes on trial: which models it touches, and which of them take a canary (pure).

`plan_trial` compares the stable revision's config with the change's; the Edge runs the trial
(`iop.edge.refresh.rollouts`), the admission webhook warns of it. A model is **touched** when
what dispatch reads of it differs (its enabled providers, their served names and limits, the
policy, fallbacks, `first_byte_timeout_ms`, the generation policy; added or removed), or when a
provider the stable revision sends it to changed its adapter settings, moved to another node or
went. A touched model takes a **canary** (a share of its requests, in steps) when, with
`rollout.mode: canary`:

- it is in both configs and what serves it changed, not only how much: its providers, served
  names, policy, fallbacks, timeouts, generation policy or its providers' `engine_priority` (a
  change of capacity, priority or queues alone applies to all at once and is watched: it should
  not take a minute to apply);
- every provider the stable revision sends it to is still on its node with the same adapter
  settings. A Node process holds one adapter per provider, and a change of adapter settings is
  restart-required (the caller restarts the node, which comes back with the new ones), so the
  stable side could not find the provider it had: such a model goes all at once.

The others of the touched models are served by the change at once and watched. A model's LoRA
adapters (`models[].adapters`) are catalog keys like models, on their model's providers: touched
and shared with it. docs/rollout.md, "Which changes take a canary", has the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .configs import EdgeConfig
from .modelspecs import ModelSpec
from .nodespecs import ProviderSpec
from .payloads import ProviderPayload


@dataclass(frozen=True, slots=True)
class Trial:
    #: The models whose serving the change alters.
    touched: tuple[str, ...]
    #: Of those, the ones whose requests the canary shares (empty without `mode: canary`).
    shared: tuple[str, ...] = ()
    #: Why touched models that changed what serves them still apply to all at once.
    all_at_once: tuple[str, ...] = ()

    def describe(self, steps: list[int]) -> str:
        """The plan in one line, for the revision, the log and the webhook."""
        parts: list[str] = []
        if self.shared:
            shares = " -> ".join(f"{step}%" for step in steps)
            parts.append(f"canary {shares} for {_names(self.shared)}")
        rest = [model for model in self.touched if model not in self.shared]
        if rest:
            parts.append(f"all at once, watched, for {_names(rest)}")
        parts.extend(self.all_at_once)
        return "; ".join(parts)

    def duration_s(self, config: EdgeConfig) -> tuple[float, float]:
        """About how long the trial takes with enough traffic, and at most, in seconds."""
        rules = config.rollout
        usual = len(rules.steps) * rules.step_ms if self.shared else rules.bake_ms
        return usual / 1000, max(usual, rules.max_wait_ms) / 1000


def plan_trial(stable: EdgeConfig, after: EdgeConfig) -> Trial:
    """The trial of `after` against the stable revision's config; see the module."""
    gone = _provider_changes(stable, after)
    before_providers, after_providers = _providers(stable), _providers(after)
    before_models, after_models = _catalog(stable), _catalog(after)

    def view(model: ModelSpec | None, providers: Mapping[str, ProviderSpec]) -> Any:
        if model is None:
            return None
        return (_essence(model, providers), _limits(model, providers))

    touched = tuple(
        sorted(
            model_id
            for model_id in before_models.keys() | after_models.keys()
            if view(before_models.get(model_id), before_providers)
            != view(after_models.get(model_id), after_providers)
            or any(pid in gone for pid in _mapped(before_models.get(model_id), before_providers))
        )
    )
    if after.rollout.mode != "canary" or not touched:
        return Trial(touched)
    shared: list[str] = []
    notes: list[str] = []
    for model_id in touched:
        before, now = before_models.get(model_id), after_models.get(model_id)
        if before is None or now is None:
            continue
        why = [gone[pid] for pid in sorted(_mapped(before, before_providers)) if pid in gone]
        if why:
            notes.append(f"{model_id} all at once: {why[0]}")
        elif _essence(before, before_providers) != _essence(now, after_providers):
            shared.append(model_id)
    return Trial(touched, tuple(shared), tuple(notes))


def _catalog(config: EdgeConfig) -> dict[str, ModelSpec]:
    """Every catalog key and what serves it: a LoRA adapter as its model on the same providers
    (touched and shared with it), with no fallbacks of its own."""
    catalog: dict[str, ModelSpec] = {}
    for model in config.models:
        catalog[model.id] = model
        for adapter in model.adapters:
            catalog[adapter] = model.model_copy(
                update={"id": adapter, "adapters": [], "fallbacks": []}
            )
    return catalog


def _providers(config: EdgeConfig) -> dict[str, ProviderSpec]:
    return {spec.id: spec for node in config.nodes for spec in node.providers}


def _mapped(model: ModelSpec | None, providers: Mapping[str, ProviderSpec]) -> list[str]:
    """The enabled providers the model is dispatched to."""
    if model is None:
        return []
    return [pid for pid in model.providers if pid in providers and providers[pid].enabled]


def _essence(model: ModelSpec, providers: Mapping[str, ProviderSpec]) -> tuple[Any, ...]:
    """What serves a model, without how much: a change of limits alone leaves it equal."""
    return (
        frozenset(
            (pid, model.providers[pid], providers[pid].engine_priority)
            for pid in _mapped(model, providers)
        ),
        model.generation,
        tuple(model.fallbacks),
        model.first_byte_timeout_ms,
        model.dispatch,
    )


def _limits(model: ModelSpec, providers: Mapping[str, ProviderSpec]) -> tuple[Any, ...]:
    """How much its providers take: what a capacity or priority tweak changes."""
    return tuple(
        sorted(
            (
                pid,
                spec.capacity,
                spec.long_context_slots,
                spec.priority,
                spec.max_queue,
                spec.queue_timeout_ms,
            )
            for pid in _mapped(model, providers)
            for spec in (providers[pid],)
        )
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
