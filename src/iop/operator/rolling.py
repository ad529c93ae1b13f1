"""Rolling exactly the workloads a restart-required change names, and following the rollout.

A workload is rolled by stamping its pod template with the new config hash
(`iop.dev/config-hash`): the Deployment controller then replaces its pods the way it always does
(maxSurge/maxUnavailable, readiness, progress deadline). The stamp is the record: a workload
already stamped with a hash is never patched again for it, so an operator restart, a re-list or
a retried pass rolls nothing twice (the trap of tools that restart on every ConfigMap change).

Workloads are Deployments found by label (`conventions.edge_selector`, `node_selector`); how
far a rollout is follows `kubectl rollout status`. A restart that fails its gate (its first new
pod not available by the Deployment's progress deadline) puts the stable revision's stamp back,
like `kubectl rollout undo`: the old ReplicaSet's template again, scaled up by the controller.
"""

from __future__ import annotations

from . import conventions
from .kubeapi import KubeApi, resource_path
from .values import Workload


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
    """Stamp the pod template with `config_hash` (which rolls it; "" takes the stamp off, as on
    a template never stamped); a no-op when it already is."""
    if workload.stamp == config_hash:
        return workload
    patch = {
        "spec": {
            "template": {
                "metadata": {
                    "annotations": {conventions.CONFIG_HASH_ANNOTATION: config_hash or None}
                }
            }
        }
    }
    patched = await api.merge_patch(
        resource_path("apps/v1", "deployments", namespace, workload.name),
        patch,
        what=f"stamp {workload.key} for a restart" if config_hash else f"unstamp {workload.key}",
    )
    return Workload.of(patched)
