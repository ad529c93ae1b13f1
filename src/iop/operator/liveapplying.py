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
from collections.abc import Sequence
from dataclasses import replace

from .adminapi import EdgeAdmin
from .errors import AdminApiError, AdminRefused, AdminUnreachable
from .values import EdgeReplica, ReplicaOutcome, ReplicaStatus


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
    refused = error if isinstance(error, AdminRefused) else None
    return ReplicaOutcome(
        replica,
        "Failed",
        error.reason,
        restart_scopes=refused.restart_scopes if refused is not None else (),
        rolled_back=refused is not None and refused.rolled_back,
        elapsed_ms=_since(clock),
    )


def _since(clock: float) -> float:
    return round((time.perf_counter() - clock) * 1000, 3)
