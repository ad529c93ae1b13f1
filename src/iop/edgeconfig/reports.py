"""What changed between two configs, and how each change must be applied."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RestartPath:
    """A changed path that cannot apply live, and the smallest restart that makes it true.

    `scope` is `edge` (roll the Edge) or `node:<id>` (roll only that node's workload).
    """

    path: str
    scope: str

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "scope": self.scope}


@dataclass(frozen=True, slots=True)
class ChangeReport:
    """The classification of `old -> new`. Every list is sorted and never None."""

    changed_nodes: tuple[str, ...] = ()
    changed_providers: tuple[str, ...] = ()
    changed_models: tuple[str, ...] = ()
    live_paths: tuple[str, ...] = ()
    restart_required_paths: tuple[RestartPath, ...] = ()
    #: For every node of the new config: did its node-specific payload change (push it)?
    node_payload_changed: dict[str, bool] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.live_paths or self.restart_required_paths)

    @property
    def restart_required(self) -> bool:
        return bool(self.restart_required_paths)

    @property
    def nodes_to_push(self) -> tuple[str, ...]:
        """Nodes whose payload changed: the ones a live apply sends a refresh to."""
        return tuple(node for node, changed in self.node_payload_changed.items() if changed)

    @property
    def restart_scopes(self) -> tuple[str, ...]:
        return tuple(sorted({p.scope for p in self.restart_required_paths}))

    def as_dict(self) -> dict[str, object]:
        return {
            "changed": self.changed,
            "restart_required": self.restart_required,
            "changed_nodes": list(self.changed_nodes),
            "changed_providers": list(self.changed_providers),
            "changed_models": list(self.changed_models),
            "live_paths": list(self.live_paths),
            "restart_required_paths": [p.as_dict() for p in self.restart_required_paths],
            "restart_scopes": list(self.restart_scopes),
            "node_payload_changed": dict(self.node_payload_changed),
            "nodes_to_push": list(self.nodes_to_push),
        }
