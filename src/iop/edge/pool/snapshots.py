"""The pool snapshot: everything dispatch reads from the config, built once and never changed.

A refresh builds a new `PoolSnapshot` and the dispatcher swaps one reference to it, so the hot
path reads plain immutable data without locks, and every run keeps the snapshot it started on.
The counters that do change (slots in use, waiting requests) live in the dispatcher, keyed by
provider id, and outlive any one snapshot. The queueing rules derived here (a model's queue
bound and wait from its enabled providers, its fallbacks depth first, each model once) are
docs/edge.md's, "Dispatch" and "Retries and fallbacks".
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from iop.edgeconfig import (
    DispatchSettings,
    EdgeConfig,
    GenerationPolicy,
    RetrySection,
    config_hash,
    edge_share,
)

from .priorities import PriorityTable


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """One provider's dispatch settings."""

    id: str
    node_id: str
    enabled: bool
    capacity: int
    #: None: long requests need only a capacity slot; 0: the provider never takes one.
    long_context_slots: int | None
    priority: int
    max_queue: int
    queue_timeout_ms: int
    #: Its server schedules by the request's `priority` field: the Edge sends the class's.
    engine_priority: bool = False

    @property
    def takes_long(self) -> bool:
        return self.long_context_slots != 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A provider as one model's candidate: its limits and the model name it serves."""

    provider: ProviderLimits
    served_model: str


@dataclass(frozen=True, slots=True)
class PoolModel:
    """One model of the catalog and where it can run."""

    id: str
    generation: GenerationPolicy
    #: The enabled providers mapped by the model, in dispatch order: (priority, id).
    candidates: tuple[Candidate, ...]
    #: Most requests that may wait for this model at once.
    queue_bound: int
    #: Longest a request may wait for a free candidate, in seconds.
    queue_timeout_s: float
    #: True when some candidate can take a long-context request.
    takes_long: bool
    #: The models that answer instead when this one cannot, in the order they are tried.
    fallbacks: tuple[str, ...] = ()
    #: Longest a try may take to its first event, in seconds (None: no limit).
    first_byte_timeout_s: float | None = None
    #: How the model chooses among its best free candidates (`models[].dispatch`).
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    #: For a LoRA adapter (`models[].adapters`): the model it adapts, whose providers serve it
    #: under the adapter's name (the id). None for a model.
    base_model: str | None = None

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter's name when this entry is one (its requests prefer the servers that
        have it loaded: `choosing.py`), else None."""
        return self.id if self.base_model is not None else None

    def candidate(self, provider_id: str) -> Candidate | None:
        for candidate in self.candidates:
            if candidate.provider.id == provider_id:
                return candidate
        return None


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """The whole dispatch view of one config generation."""

    config: EdgeConfig
    config_hash: str
    #: Counts the snapshots this Edge has swapped in; 1 is the config it started with.
    generation: int
    #: Unix time the snapshot was built (the `created` of /v1/models entries).
    created: int
    long_context_threshold_tokens: int
    #: The catalog, in config order (a model's adapters right after it).
    models: Mapping[str, PoolModel]
    providers: Mapping[str, ProviderLimits]
    #: For each enabled provider, the models it is a candidate of (with its candidate entry).
    models_by_provider: Mapping[str, tuple[tuple[PoolModel, Candidate], ...]]
    #: principal_ref -> its fair-share weight in a model's queue (absent: 1).
    principal_weights: Mapping[str, int]
    #: Retries before the first byte and their budget (`openai.retries`).
    retries: RetrySection
    #: The priority classes (`openai.priority`).
    priorities: PriorityTable
    #: The Edge replicas sharing the capacity of the nodes placed on the Edge (1: alone).
    edge_replicas: int = 1

    @classmethod
    def build(cls, config: EdgeConfig, generation: int = 1, edge_replicas: int = 1) -> PoolSnapshot:
        """The snapshot of a validated config; a provider of a node placed on the Edge gets
        this replica's share of its capacity (`edge_share`) among `edge_replicas`."""
        providers = {
            spec.id: ProviderLimits(
                id=spec.id,
                node_id=node.id,
                enabled=spec.enabled,
                capacity=(
                    edge_share(spec.capacity, edge_replicas) if node.on_edge else spec.capacity
                ),
                long_context_slots=(
                    edge_share(spec.long_context_slots, edge_replicas)
                    if node.on_edge and spec.long_context_slots is not None
                    else spec.long_context_slots
                ),
                priority=spec.priority,
                max_queue=spec.max_queue,
                queue_timeout_ms=spec.queue_timeout_ms,
                engine_priority=spec.engine_priority,
            )
            for node in config.nodes
            for spec in node.providers
        }
        direct_fallbacks = {model.id: model.fallbacks for model in config.models}
        models: dict[str, PoolModel] = {}
        by_provider: dict[str, list[tuple[PoolModel, Candidate]]] = {}
        for model in config.models:
            candidates = sorted(
                (
                    Candidate(providers[provider_id], served)
                    for provider_id, served in model.providers.items()
                    if provider_id in providers and providers[provider_id].enabled
                ),
                key=lambda c: (c.provider.priority, c.provider.id),
            )
            pool_model = PoolModel(
                id=model.id,
                generation=model.generation,
                candidates=tuple(candidates),
                queue_bound=sum(c.provider.max_queue for c in candidates),
                queue_timeout_s=max((c.provider.queue_timeout_ms for c in candidates), default=0)
                / 1000,
                takes_long=any(c.provider.takes_long for c in candidates),
                fallbacks=_fallback_order(direct_fallbacks, model.id) if model.fallbacks else (),
                first_byte_timeout_s=(
                    None
                    if model.first_byte_timeout_ms is None
                    else model.first_byte_timeout_ms / 1000
                ),
                dispatch=model.dispatch,
            )
            entries = [pool_model]
            # An adapter is a catalog entry of its own (its queue, metrics and limits by its
            # name) on its base model's providers, which serve it under its name.
            entries += [
                replace(
                    pool_model,
                    id=adapter,
                    candidates=tuple(replace(c, served_model=adapter) for c in candidates),
                    fallbacks=(),
                    base_model=model.id,
                )
                for adapter in model.adapters
            ]
            for entry in entries:
                models[entry.id] = entry
                for candidate in entry.candidates:
                    by_provider.setdefault(candidate.provider.id, []).append((entry, candidate))
        return cls(
            config=config,
            config_hash=config_hash(config),
            generation=generation,
            created=int(time.time()),
            long_context_threshold_tokens=config.openai.long_context_threshold_tokens,
            models=MappingProxyType(models),
            providers=MappingProxyType(providers),
            models_by_provider=MappingProxyType(
                {key: tuple(value) for key, value in by_provider.items()}
            ),
            principal_weights=MappingProxyType(dict(config.openai.principal_weights)),
            retries=config.openai.retries,
            priorities=PriorityTable(config),
            edge_replicas=edge_replicas,
        )

    def with_edge_replicas(self, edge_replicas: int) -> PoolSnapshot:
        """The same config and generation with the capacity shared among `edge_replicas`."""
        return PoolSnapshot.build(self.config, self.generation, edge_replicas)


def _fallback_order(direct: Mapping[str, list[str]], model_id: str) -> tuple[str, ...]:
    """The fallbacks of `model_id`, depth first, each model once and never the model itself."""
    order: list[str] = []
    seen = {model_id}

    def visit(current: str) -> None:
        for fallback in direct.get(current, ()):
            if fallback not in seen:
                seen.add(fallback)
                order.append(fallback)
                visit(fallback)

    visit(model_id)
    return tuple(order)
