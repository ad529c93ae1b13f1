"""The node-specific part of a config: what the Edge sends one Node on welcome and on refresh.

A Node needs its own providers and adapters and the limits it enforces itself (capacity and
long slots, across every Edge it serves). Dispatch-only settings (priority, queueing) stay on the
Edge, so changing them pushes nothing.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .configs import EdgeConfig, NodeSpec, ProviderSpec
from .trees import config_hash

__all__ = ["NodePayload", "ProviderPayload", "node_payload", "node_payloads"]


class ProviderPayload(BaseModel, frozen=True):
    """One provider as its Node sees it."""

    id: str
    adapter: dict[str, Any]
    served_models: tuple[str, ...]
    enabled: bool
    capacity: int
    long_context_slots: int | None

    @classmethod
    def of(cls, provider: ProviderSpec) -> ProviderPayload:
        return cls(
            id=provider.id,
            adapter=provider.adapter.model_dump(mode="json"),
            served_models=tuple(sorted(provider.served_models)),
            enabled=provider.enabled,
            capacity=provider.capacity,
            long_context_slots=provider.long_context_slots,
        )


class NodePayload(BaseModel, frozen=True):
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
        return config_hash(self)


def node_payload(config: EdgeConfig, node_id: str) -> NodePayload | None:
    """The payload of `node_id`, or None when the config has no such node."""
    for node in config.nodes:
        if node.id == node_id:
            return NodePayload.of(node)
    return None


def node_payloads(config: EdgeConfig) -> dict[str, NodePayload]:
    """node id -> what that Node receives, for every node of `config`."""
    return {node.id: NodePayload.of(node) for node in config.nodes}
