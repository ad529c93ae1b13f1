"""Rolling exactly the workloads a restart-required change names, and following the rollout.

A workload is rolled by stamping its pod template with the new config hash
(`iop.dev/config-hash`): the Deployment controller then replaces its pods the way it always does
(maxSurge/maxUnavailable, readiness, progress deadline). The stamp is the record: a workload
already stamped with a hash is never patched again for it, so an operator restart, a re-list or
a retried pass rolls nothing twice (the trap of tools that restart on every ConfigMap change).

Workloads are Deployments found by label (`conventions.edge_selector`, `node_selector`); how
far a rollout is follows `kubectl rollout status`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from . import conventions
from .kubeapi import KubeApi, resource_path

RolloutPhase = Literal["Progressing", "Complete", "Stalled"]


@dataclass(frozen=True, slots=True)
class RolloutState:
    phase: RolloutPhase
    message: str


@dataclass(frozen=True, slots=True)
class Workload:
    """A Deployment as the operator sees it."""

    name: str
    #: The config hash its pod template is stamped with ("" when never stamped).
    stamp: str
    rollout: RolloutState
    #: The node id label (Node workloads), else "".
    node_id: str = ""
    #: The pods it asks for (`spec.replicas`): a workload scaled to 0 runs nothing.
    replicas: int = 1

    @property
    def key(self) -> str:
        return f"Deployment/{self.name}"

    @classmethod
    def of(cls, deployment: Mapping[str, Any]) -> Workload:
        metadata = deployment["metadata"]
        template = deployment.get("spec", {}).get("template", {}).get("metadata") or {}
        return cls(
            name=metadata["name"],
            stamp=(template.get("annotations") or {}).get(conventions.CONFIG_HASH_ANNOTATION, ""),
            rollout=rollout_state(deployment),
            node_id=(metadata.get("labels") or {}).get(conventions.NODE_ID_LABEL, ""),
            replicas=int((deployment.get("spec") or {}).get("replicas", 1)),
        )


def rollout_state(deployment: Mapping[str, Any]) -> RolloutState:
    """How far the Deployment's rollout is, as `kubectl rollout status` judges it."""
    metadata = deployment["metadata"]
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    if int(status.get("observedGeneration") or 0) < int(metadata.get("generation") or 0):
        return RolloutState("Progressing", "waiting for the new pod template to be observed")
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Progressing" and condition.get("reason") == (
            "ProgressDeadlineExceeded"
        ):
            return RolloutState(
                "Stalled", f"progress deadline exceeded: {condition.get('message')}"
            )
    wanted = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    available = int(status.get("availableReplicas") or 0)
    if updated < wanted:
        return RolloutState("Progressing", f"{updated} of {wanted} new replicas updated")
    if total > updated:
        return RolloutState("Progressing", f"{total - updated} old replicas pending termination")
    if available < updated:
        return RolloutState("Progressing", f"{available} of {updated} new replicas available")
    return RolloutState("Complete", f"{updated} of {wanted} replicas updated and available")


async def edge_workloads(api: KubeApi, namespace: str, name: str) -> list[Workload]:
    """The Edge workload(s) of EdgeConfig `name`."""
    found = await api.items(
        resource_path("apps/v1", "deployments", namespace),
        selector=conventions.edge_selector(name),
        what=f"list the Edge workload of {name}",
    )
    return sorted((Workload.of(d) for d in found), key=lambda w: w.name)


async def node_workloads(api: KubeApi, namespace: str, name: str) -> dict[str, list[Workload]]:
    """The Node workloads of EdgeConfig `name`, by node id (one list call for all nodes)."""
    found = await api.items(
        resource_path("apps/v1", "deployments", namespace),
        selector=conventions.nodes_selector(name),
        what=f"list the Node workloads of {name}",
    )
    by_node: dict[str, list[Workload]] = {}
    for deployment in found:
        workload = Workload.of(deployment)
        if workload.node_id:
            by_node.setdefault(workload.node_id, []).append(workload)
    return {node: sorted(items, key=lambda w: w.name) for node, items in by_node.items()}


async def stamp(api: KubeApi, namespace: str, workload: Workload, config_hash: str) -> Workload:
    """Stamp the pod template with `config_hash` (which rolls it); a no-op when it already is."""
    if workload.stamp == config_hash:
        return workload
    patch = {
        "spec": {
            "template": {
                "metadata": {"annotations": {conventions.CONFIG_HASH_ANNOTATION: config_hash}}
            }
        }
    }
    patched = await api.merge_patch(
        resource_path("apps/v1", "deployments", namespace, workload.name),
        patch,
        what=f"stamp {workload.key} for a restart",
    )
    return Workload.of(patched)
