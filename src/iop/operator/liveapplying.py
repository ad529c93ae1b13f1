"""A live apply on every Edge replica at once, and what it means for each replica and each node.

Each replica is asked what it runs (`GET /status`); one that already runs the desired config is
left alone (a replica started after the ConfigMap was written is current from its first
moment), every other one gets `POST /refresh` apply and is asked again, so the node view is
what the replica holds *after* the apply. One replica's failure never stops another's apply:
the outcome names each replica, and each node across all of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .adminapi import ApplyReport, EdgeAdmin, NodeState, ReplicaStatus
from .discovering import EdgeReplica
from .errors import AdminApiError, AdminRefused, AdminUnreachable

#: Applied: runs the desired config; Failed, Unreachable: named in Degraded; Replaced: its pod
#: template is being rolled away (not asked); AwaitingRestart: it needs a restart the operator
#: already waits for (an Edge outside the cluster, restarted by hand).
ReplicaState = Literal["Applied", "Failed", "Unreachable", "Replaced", "AwaitingRestart"]
NodeResultState = Literal["Acked", "Failed", "NotConnected", "Restarting"]


@dataclass(frozen=True, slots=True)
class ReplicaOutcome:
    """One replica after an apply (or a look)."""

    replica: EdgeReplica
    state: ReplicaState
    reason: str = ""
    status: ReplicaStatus | None = None
    report: ApplyReport | None = None
    #: Restarts the replica said it needs (it refused the apply with 409).
    restart_scopes: tuple[str, ...] = ()
    #: Wall time of this replica's calls, in milliseconds.
    elapsed_ms: float = 0.0

    @property
    def config_hash(self) -> str:
        return self.status.config_hash if self.status is not None else ""


@dataclass(frozen=True, slots=True)
class NodeResult:
    node_id: str
    state: NodeResultState
    reason: str = ""
    #: Runs the node's draining processes still finish, the most any replica reports.
    draining_runs: int = 0


async def read_replicas(
    admin: EdgeAdmin, replicas: Sequence[EdgeReplica], token: str | None
) -> list[ReplicaOutcome]:
    """Every replica's status, without applying anything."""
    return list(await asyncio.gather(*(_look(admin, r, token) for r in replicas)))


async def apply_on_replicas(
    admin: EdgeAdmin,
    replicas: Sequence[EdgeReplica],
    body: bytes,
    desired_hash: str,
    token: str | None,
) -> list[ReplicaOutcome]:
    """Bring every replica to `desired_hash` live; one outcome per replica, in order."""
    return list(
        await asyncio.gather(*(_apply(admin, r, body, desired_hash, token) for r in replicas))
    )


async def _look(admin: EdgeAdmin, replica: EdgeReplica, token: str | None) -> ReplicaOutcome:
    clock = time.perf_counter()
    try:
        status = await admin.status(replica, token)
    except AdminApiError as error:
        return _failed(replica, error, clock)
    return ReplicaOutcome(replica, "Applied", status=status, elapsed_ms=_since(clock))


async def _apply(
    admin: EdgeAdmin, replica: EdgeReplica, body: bytes, desired_hash: str, token: str | None
) -> ReplicaOutcome:
    clock = time.perf_counter()
    before: ReplicaStatus | None = None
    try:
        before = await admin.status(replica, token)
        if before.config_hash == desired_hash:
            return ReplicaOutcome(replica, "Applied", status=before, elapsed_ms=_since(clock))
        report = await admin.apply(replica, body, token)
        after = await admin.status(replica, token)
    except AdminApiError as error:
        return replace(_failed(replica, error, clock), status=before)
    if after.config_hash != desired_hash:  # another writer raced us; the next pass sees it
        reason = f"runs config {after.config_hash[:12]} after the apply, not {desired_hash[:12]}"
        return ReplicaOutcome(
            replica, "Failed", reason, status=after, report=report, elapsed_ms=_since(clock)
        )
    return ReplicaOutcome(replica, "Applied", status=after, report=report, elapsed_ms=_since(clock))


def _failed(replica: EdgeReplica, error: AdminApiError, clock: float) -> ReplicaOutcome:
    if isinstance(error, AdminUnreachable):
        return ReplicaOutcome(replica, "Unreachable", error.reason, elapsed_ms=_since(clock))
    scopes = error.restart_scopes if isinstance(error, AdminRefused) else ()
    return ReplicaOutcome(
        replica, "Failed", error.reason, restart_scopes=scopes, elapsed_ms=_since(clock)
    )


def _since(clock: float) -> float:
    return round((time.perf_counter() - clock) * 1000, 3)


def node_results(
    node_ids: Collection[str],
    outcomes: Sequence[ReplicaOutcome],
    restarting: Collection[str] = (),
) -> list[NodeResult]:
    """Each node across every replica that answered: Acked when it runs the desired payload on
    all of them; Restarting while its workload rolls for a restart scope; Failed when a push
    failed or it lags on a replica it is connected to; NotConnected when connected to none."""
    # Only replicas that run the desired config say whether a node runs its payload.
    answered = [o for o in outcomes if o.status is not None and o.state == "Applied"]
    if not answered:
        reason = "no Edge replica runs the desired config yet"
        return [NodeResult(node_id, "NotConnected", reason) for node_id in sorted(node_ids)]
    failures: dict[str, str] = {}
    for outcome in answered:
        for push in outcome.report.pushes if outcome.report is not None else ():
            if push.status == "failed":
                failures.setdefault(push.node_id, f"{outcome.replica.name}: {push.reason}")
    results: list[NodeResult] = []
    for node_id in sorted(node_ids):
        views = [
            (outcome.replica.name, node)
            for outcome in answered
            if outcome.status is not None
            for node in outcome.status.nodes
            if node.node_id == node_id
        ]
        draining = max((node.draining_runs for _, node in views), default=0)
        results.append(
            replace(_node_result(node_id, views, restarting, failures), draining_runs=draining)
        )
    return results


def _node_result(
    node_id: str,
    views: Sequence[tuple[str, NodeState]],
    restarting: Collection[str],
    failures: Mapping[str, str],
) -> NodeResult:
    """One node's state from each answering replica's view of it."""
    lagging = [name for name, node in views if node.connected and not node.current]
    absent = [name for name, node in views if not node.connected]
    if views and all(node.current for _, node in views):
        return NodeResult(node_id, "Acked")
    if node_id in restarting:
        return NodeResult(node_id, "Restarting", "its workload restarts to take it")
    if node_id in failures:
        return NodeResult(node_id, "Failed", failures[node_id])
    if lagging:
        return NodeResult(
            node_id, "Failed", f"not running the current payload on {', '.join(lagging)}"
        )
    if len(absent) == len(views):
        return NodeResult(node_id, "NotConnected", "connected to no Edge replica")
    return NodeResult(node_id, "NotConnected", f"not connected to {', '.join(absent)}")
