"""The node-specific part of a config: what the Edge sends one Node on welcome and on refresh.

A Node needs its own providers and adapters, the limits it enforces itself (capacity and long
slots, across every Edge it serves) and how it judges their health (probes, failing requests).
Dispatch-only settings (priority, queueing) stay on the Edge, so changing them pushes nothing.

Defaults do not travel: a provider's health policy goes only when it differs from the defaults,
and an adapter's settings go as its type and what differs from theirs. So a Node and an Edge of
different releases (mid-rollout) agree on the digest of a payload that uses the defaults (the
Edge does not see that Node as running a stale config), and an older Node takes the payload of a
newer Edge whose added adapter settings are not used (it refuses settings it does not know).
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from pydantic import BaseModel, field_validator

from .configs import EdgeConfig
from .fields import fields_equal
from .nodespecs import AdapterSettings, HealthPolicy, NodeSpec, ProviderSpec
from .trees import to_tree

_DEFAULT_HEALTH = HealthPolicy()


class _Payload(BaseModel, frozen=True):
    """Compared as `Spec`s are (`fields.fields_equal`): an apply that changes every node of
    thousands compares each node's new payload with its last one twice (the hub's snapshot and
    the classification), and pydantic's own comparison cost most of that."""

    def __eq__(self, other: object) -> bool:
        same = fields_equal(self, other)
        return super().__eq__(other) if same is None else same

    __hash__ = BaseModel.__hash__


class ProviderPayload(_Payload, frozen=True):
    """One provider as its Node sees it."""

    id: str
    adapter: dict[str, Any]
    served_models: tuple[str, ...]
    enabled: bool
    capacity: int
    long_context_slots: int | None
    #: None means the defaults (`HealthPolicy()`); see the module docstring for why.
    health: HealthPolicy | None = None

    @field_validator("health")
    @classmethod
    def _defaults_are_none(cls, value: HealthPolicy | None) -> HealthPolicy | None:
        return None if value == _DEFAULT_HEALTH else value

    @classmethod
    def of(cls, provider: ProviderSpec) -> ProviderPayload:
        return cls(
            id=provider.id,
            adapter=cls.adapter_document(provider.adapter),
            served_models=tuple(sorted(provider.served_models)),
            enabled=provider.enabled,
            capacity=provider.capacity,
            long_context_slots=provider.long_context_slots,
            health=provider.health,
        )

    @staticmethod
    def adapter_document(adapter: AdapterSettings) -> dict[str, Any]:
        """An adapter's settings as they travel: its type and what differs from the defaults.

        A Node refuses adapter settings it does not know, so a Node of an older release takes
        the payload of a newer Edge as long as the settings that release added keep their
        defaults (and both compute the same digest); a setting it cannot honour is refused.
        """
        document = adapter.model_dump(mode="json", exclude_defaults=True)
        document["type"] = adapter.type
        return document

    @property
    def health_policy(self) -> HealthPolicy:
        """The policy in force: the payload's, or the defaults."""
        return _DEFAULT_HEALTH if self.health is None else self.health


class NodePayload(_Payload, frozen=True):
    """Everything one Node needs from the config; equal payloads mean nothing to push."""

    node_id: str
    alias: str | None
    providers: tuple[ProviderPayload, ...]

    @classmethod
    def of(cls, node: NodeSpec) -> NodePayload:
        providers = sorted(node.providers, key=lambda p: p.id)
        return cls(
            node_id=node.id,
            alias=node.alias,
            providers=tuple(ProviderPayload.of(p) for p in providers),
        )

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical tree (`trees.to_tree`), a provider's default health policy
        left out. The tree is written out here field by field: the generic walk cost the Edge
        and every Node a look at each field's spec, per payload, on every push."""
        if not self.providers:  # (the generic tree of no providers is a list, not a mapping)
            return _generic_digest(self)
        tree = {
            "node_id": self.node_id,
            "alias": self.alias,
            "providers": {f"[{p.id}]": _provider_tree(p) for p in self.providers},
        }
        return hashlib.sha256(orjson.dumps(tree, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _provider_tree(provider: ProviderPayload) -> dict[str, Any]:
    """`to_tree(provider)`, its health left out when it is the defaults (None)."""
    tree = {
        "id": provider.id,
        "adapter": to_tree(provider.adapter),
        "served_models": sorted(provider.served_models, key=repr),
        "enabled": provider.enabled,
        "capacity": provider.capacity,
        "long_context_slots": provider.long_context_slots,
    }
    if provider.health is not None:
        tree["health"] = to_tree(provider.health)
    return tree


def _generic_digest(payload: NodePayload) -> str:
    """The digest from the generic tree: what `NodePayload.digest` computes faster."""
    tree = to_tree(payload)
    providers = tree["providers"]
    for provider in providers.values() if isinstance(providers, dict) else ():
        if provider["health"] is None:
            del provider["health"]
    return hashlib.sha256(orjson.dumps(tree, option=orjson.OPT_SORT_KEYS)).hexdigest()


def node_payload(config: EdgeConfig, node_id: str) -> NodePayload | None:
    """The payload of `node_id`, or None when the config has no such node."""
    for node in config.nodes:
        if node.id == node_id:
            return NodePayload.of(node)
    return None


def node_payloads(config: EdgeConfig) -> dict[str, NodePayload]:
    """node id -> what that Node receives, for every node of `config`."""
    return {node.id: NodePayload.of(node) for node in config.nodes}


def edge_share(value: int, replicas: int) -> int:
    """A provider's `capacity` (or `long_context_slots`) for one of `replicas` Edges sharing a
    node placed on the Edge: the floor of the equal share, at least 1 (0 stays 0), so together
    they never pass `value` unless there are more replicas than `value`."""
    if value <= 0:
        return 0
    return max(1, value // max(1, replicas))
