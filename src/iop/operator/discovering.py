"""Where the Edge replicas of an EdgeConfig are: the seam between the reconcile and the cluster.

In a cluster the replicas are the pods of the Edge workload (`conventions.edge_selector`), each
reached at its pod IP and the admin port of the config (`edge.admin.listen`). `FixedReplicas`
names admin URLs instead: for an Edge that runs outside the cluster (tests, benchmarks and
`iop operator run --edge-admin URL` on a workstation).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from . import conventions
from .kubeapi import KubeApi, resource_path
from .values import EdgeReplica


class ReplicaFinder(Protocol):
    """Lists the Edge replicas of one EdgeConfig."""

    async def replicas(self, namespace: str, name: str, admin_port: int) -> list[EdgeReplica]: ...


class PodReplicas:
    """The pods of the Edge workload, through the API (list pods; RBAC `list pods`)."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api

    async def replicas(self, namespace: str, name: str, admin_port: int) -> list[EdgeReplica]:
        pods = await self._api.items(
            resource_path("v1", "pods", namespace),
            selector=conventions.edge_selector(name),
            what=f"list the Edge pods of {name}",
        )
        found = [_replica(pod, admin_port) for pod in pods if _alive(pod)]
        return sorted(found, key=lambda replica: replica.name)


def _alive(pod: Mapping[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and pod.get("status", {}).get(
        "phase"
    ) not in ("Succeeded", "Failed")


def _replica(pod: Mapping[str, Any], admin_port: int) -> EdgeReplica:
    metadata = pod["metadata"]
    status = pod.get("status") or {}
    address = status.get("podIP") or ""
    ready = bool(address) and any(
        condition.get("type") == "Ready" and condition.get("status") == "True"
        for condition in status.get("conditions") or ()
    )
    host = f"[{address}]" if ":" in address else address
    return EdgeReplica(
        name=metadata["name"],
        uid=metadata.get("uid", ""),
        admin_url=f"http://{host}:{admin_port}" if address else "",
        ready=ready,
        stamp=(metadata.get("annotations") or {}).get(conventions.CONFIG_HASH_ANNOTATION, ""),
    )


class FixedReplicas:
    """Admin URLs given up front, always ready, never rolled (the Edge runs elsewhere)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = [url.rstrip("/") for url in urls]

    async def replicas(self, namespace: str, name: str, admin_port: int) -> list[EdgeReplica]:
        return [EdgeReplica(url, url, url, True, None) for url in self._urls]
