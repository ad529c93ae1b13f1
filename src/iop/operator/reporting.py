"""What one reconcile pass found, as the EdgeConfig's status and as Events.

Status follows the Kubernetes API conventions and kstatus: `conditions[]` with type, status,
reason (CamelCase), message, observedGeneration and lastTransitionTime, and a top-level
`observedGeneration`, so `kubectl wait --for=condition=Ready` and kstatus-based tools (Helm 4's
`--wait`, Flux, Argo CD) read it. Conditions:

- `Valid`: the spec loads with every check of `iop config check`; False lists every problem.
- `Applied`: the desired config is in effect: committed, every ready Edge replica runs it, and
  every restart it needed is done.
- `Progressing`: a rollout the operator started (or a restart it waits for) is under way.
- `Degraded`: something failed (a replica, a node, a rollout, a missing Secret), named; the
  operator retries with back-off.
- `Ready`: Valid, Applied, not Progressing and not Degraded.

Lists in the status are bounded (`MAX_ITEMS`), so a config with thousands of nodes keeps a
small status; the counts say what was left out.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from iop.edgeconfig import ChangeReport, Problem

from .liveapplying import NodeResult, ReplicaOutcome

__all__ = [
    "MAX_ITEMS",
    "Finding",
    "PendingRestart",
    "RolloutRecord",
    "build_conditions",
    "build_status",
    "change_summary",
    "now",
]

#: The most entries any list in the status holds.
MAX_ITEMS: Final = 100
#: The longest condition message; the API server accepts 32 KiB, people read far less.
MAX_MESSAGE: Final = 2000

ConditionStatus = Literal["True", "False", "Unknown"]


def now() -> str:
    """The current time as Kubernetes writes it in conditions and Events (RFC 3339, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    scope: str
    workload: str
    config_hash: str
    state: Literal["Progressing", "Complete", "Stalled", "Missing"]
    message: str


@dataclass(frozen=True, slots=True)
class PendingRestart:
    scope: str
    reason: str


@dataclass(slots=True)
class Finding:
    """Everything one pass learned, from which status and conditions are built."""

    generation: int
    valid: bool = True
    problems: Sequence[Problem] = ()
    desired_hash: str = ""
    applied_hash: str = ""
    #: The desired config is committed, in effect on every ready replica, restarts done.
    applied: bool = False
    #: Why it is not applied yet (CamelCase reason, sentence), when it is not.
    waiting: tuple[str, str] = ("", "")
    #: The rollouts and restarts still under way.
    progressing: bool = False
    #: Failures, each naming who and why.
    degraded: list[str] = field(default_factory=list)
    degraded_reason: str = ""
    replicas: Sequence[ReplicaOutcome] = ()
    nodes: Sequence[NodeResult] = ()
    node_total: int = 0
    rollouts: Sequence[RolloutRecord] = ()
    pending: Sequence[PendingRestart] = ()


def change_summary(
    change: ChangeReport, generation: int, from_hash: str, to_hash: str
) -> dict[str, Any]:
    """The `lastChange` stanza: what the change touches, lists bounded."""
    live = list(change.live_paths)
    restart = [p.as_dict() for p in change.restart_required_paths]
    omitted = max(0, len(live) - MAX_ITEMS) + max(0, len(restart) - MAX_ITEMS)
    return {
        "generation": generation,
        "fromConfigHash": from_hash,
        "toConfigHash": to_hash,
        "livePaths": live[:MAX_ITEMS],
        "restartPaths": restart[:MAX_ITEMS],
        "restartScopes": list(change.restart_scopes),
        "changedNodes": list(change.changed_nodes[:MAX_ITEMS]),
        "changedProviders": list(change.changed_providers[:MAX_ITEMS]),
        "changedModels": list(change.changed_models[:MAX_ITEMS]),
        "omittedPaths": omitted,
    }


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def _problems_message(problems: Sequence[Problem]) -> str:
    count = len(problems)
    head = f"{count} problem{'s' if count != 1 else ''} in the spec: "
    return _clip(head + "; ".join(str(p) for p in problems))


def build_conditions(
    finding: Finding, previous: Sequence[Mapping[str, Any]], timestamp: str
) -> list[dict[str, Any]]:
    """The five conditions; lastTransitionTime moves only when a condition's status changes.

    An invalid spec changes only `Valid` and `Ready`: `Applied`, `Progressing` and `Degraded`
    keep describing the config still in effect (nothing else changed).
    """
    before = {c.get("type"): c for c in previous}
    generation = finding.generation
    wanted: list[tuple[str, ConditionStatus, str, str]] = []
    if not finding.valid:
        wanted.append(("Valid", "False", "InvalidSpec", _problems_message(finding.problems)))
        for kind in ("Applied", "Progressing", "Degraded"):
            kept = before.get(kind)
            if kept is not None:
                wanted.append((kind, kept["status"], kept["reason"], kept["message"]))
        wanted.append(
            ("Ready", "False", "InvalidSpec", "the spec is invalid; the running config is kept")
        )
        return _stamped(
            wanted,
            before,
            generation,
            timestamp,
            keep_generation={"Applied", "Progressing", "Degraded"},
        )

    wanted.append(("Valid", "True", "Valid", "the spec passes every check"))
    if finding.applied:
        wanted.append(
            ("Applied", "True", "Applied", f"config {finding.desired_hash[:12]} is in effect")
        )
    else:
        reason, message = finding.waiting
        wanted.append(("Applied", "False", reason or "Applying", message or "applying"))
    if finding.progressing:
        under_way = [r for r in finding.rollouts if r.state == "Progressing"]
        pending = [p for p in finding.pending]
        parts = [f"{r.scope}: {r.workload} {r.message}" for r in under_way]
        parts += [
            f"{p.scope}: {p.reason}" for p in pending if p.scope not in {r.scope for r in under_way}
        ]
        wanted.append(
            ("Progressing", "True", "RollingOut", _clip("; ".join(parts) or "rolling out"))
        )
    else:
        wanted.append(("Progressing", "False", "Idle", "no rollout under way"))
    if finding.degraded:
        wanted.append(
            (
                "Degraded",
                "True",
                finding.degraded_reason or "ApplyFailed",
                _clip("; ".join(finding.degraded)),
            )
        )
    else:
        wanted.append(("Degraded", "False", "AsExpected", "nothing failed"))
    if finding.applied and not finding.degraded and not finding.progressing:
        wanted.append(
            ("Ready", "True", "Ready", f"config {finding.desired_hash[:12]} is in effect")
        )
    elif finding.degraded:
        wanted.append(
            ("Ready", "False", finding.degraded_reason or "ApplyFailed", _clip(finding.degraded[0]))
        )
    elif finding.progressing:
        wanted.append(("Ready", "False", "RollingOut", wanted[2][3]))
    else:
        reason, message = finding.waiting
        wanted.append(("Ready", "False", reason or "Applying", message or "applying"))
    return _stamped(wanted, before, generation, timestamp)


def _stamped(
    wanted: Sequence[tuple[str, ConditionStatus, str, str]],
    before: Mapping[Any, Mapping[str, Any]],
    generation: int,
    timestamp: str,
    keep_generation: frozenset[str] | set[str] = frozenset(),
) -> list[dict[str, Any]]:
    conditions = []
    for kind, status, reason, message in wanted:
        old = before.get(kind)
        moved = old is None or old.get("status") != status
        observed = generation
        if kind in keep_generation and old is not None:
            observed = int(old.get("observedGeneration") or generation)
        conditions.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": observed,
                "lastTransitionTime": timestamp
                if moved or old is None
                else old.get("lastTransitionTime", timestamp),
            }
        )
    return conditions


def build_status(
    finding: Finding,
    previous: Mapping[str, Any],
    last_change: Mapping[str, Any] | None,
    timestamp: str,
) -> dict[str, Any]:
    """The whole `.status` (a merge patch replaces it field by field)."""
    conditions = build_conditions(finding, previous.get("conditions") or (), timestamp)
    status: dict[str, Any] = {
        "observedGeneration": finding.generation,
        "conditions": conditions,
        "problems": [p.as_dict() for p in finding.problems[:MAX_ITEMS]],
    }
    if not finding.valid:  # nothing else changes
        return status
    acked = sum(1 for node in finding.nodes if node.state == "Acked")
    shown_nodes = [n for n in finding.nodes if n.state != "Acked"][:MAX_ITEMS]
    room = MAX_ITEMS - len(shown_nodes)
    shown_nodes += [n for n in finding.nodes if n.state == "Acked"][: max(0, room)]
    shown_nodes.sort(key=lambda n: n.node_id)
    pending = [p.scope for p in finding.pending]
    status.update(
        {
            "desiredConfigHash": finding.desired_hash,
            "appliedConfigHash": finding.applied_hash,
            "configShortHash": finding.applied_hash[:12],
            "pendingRestart": ",".join(pending) if pending else "none",
            "nodesAcked": f"{acked}/{finding.node_total}",
            "replicas": [_replica(o) for o in finding.replicas[:MAX_ITEMS]],
            "nodes": [_node(n) for n in shown_nodes],
            "omittedNodes": len(finding.nodes) - len(shown_nodes),
            "rollouts": [_rollout(r) for r in finding.rollouts[:MAX_ITEMS]],
        }
    )
    if last_change is not None:
        status["lastChange"] = dict(last_change)
    return status


def _replica(outcome: ReplicaOutcome) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "pod": outcome.replica.name,
        "address": outcome.replica.admin_url,
        "state": outcome.state,
        "configHash": outcome.config_hash,
        "reason": outcome.reason,
    }
    if outcome.status is not None:
        entry["generation"] = outcome.status.generation
    return entry


def _node(result: NodeResult) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "nodeId": result.node_id,
        "state": result.state,
        "reason": result.reason,
    }
    if result.draining_runs:
        entry["drainingRuns"] = result.draining_runs
    return entry


def _rollout(record: RolloutRecord) -> dict[str, Any]:
    return {
        "scope": record.scope,
        "workload": record.workload,
        "configHash": record.config_hash,
        "state": record.state,
        "message": record.message,
    }
