"""What one reconcile pass found, as the EdgeConfig's status (`statuses.EdgeConfigStatus`).

Conditions, each with reason (CamelCase), message, observedGeneration and lastTransitionTime
(which moves only when the condition's status does): `Ready` (the summary, `Unknown` from the
moment a new generation is seen), `Reconciling` and `Stalled` (kstatus, abnormal-true), and the
product's own `Valid`, `Applied`, `Progressing`, `Degraded`. `status.observedGeneration` is
written first, so `kubectl wait --for=condition=Ready` never returns on an older generation's
Ready. Lists are bounded (`MAX_ITEMS`); counts say what was left out. docs/operator.md,
"Status", says when each condition is True and what kstatus and Argo CD make of it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Final

from iop.edgeconfig import ChangeReport, Problem, camel_path

from ..values import Finding, NodeResult, ReplicaOutcome, RolloutRecord
from .model import (
    Condition,
    ConditionStatus,
    ConditionType,
    EdgeConfigStatus,
    HistoryEntry,
    LastChange,
    NodeEntry,
    ProblemEntry,
    ReplicaEntry,
    RestartPathEntry,
    RevisionRollout,
    RolloutEntry,
)

#: The most entries any list in the status holds.
MAX_ITEMS: Final = 100
#: The longest condition message; the API server accepts 32 KiB, people read far less.
MAX_MESSAGE: Final = 2000

_Wanted = tuple[ConditionType, ConditionStatus, str, str]


def now() -> str:
    """The current time as Kubernetes writes it in conditions and Events (RFC 3339, UTC)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def change_summary(
    change: ChangeReport, generation: int, from_hash: str, to_hash: str
) -> LastChange:
    """The `lastChange` stanza: what the change touches, lists bounded."""
    live = [camel_path(path) for path in change.live_paths]
    restart = [
        RestartPathEntry(path=camel_path(p.path), scope=p.scope)
        for p in change.restart_required_paths
    ]
    omitted = max(0, len(live) - MAX_ITEMS) + max(0, len(restart) - MAX_ITEMS)
    return LastChange(
        generation=generation,
        from_config_hash=from_hash,
        to_config_hash=to_hash,
        live_paths=live[:MAX_ITEMS],
        restart_paths=restart[:MAX_ITEMS],
        restart_scopes=list(change.restart_scopes),
        changed_nodes=list(change.changed_nodes[:MAX_ITEMS]),
        changed_providers=list(change.changed_providers[:MAX_ITEMS]),
        changed_models=list(change.changed_models[:MAX_ITEMS]),
        omitted_paths=omitted,
    )


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def _problems_message(problems: Sequence[Problem]) -> str:
    count = len(problems)
    head = f"{count} problem{'s' if count != 1 else ''} in the spec: "
    return _clip(head + "; ".join(str(p) for p in problems))


def build_conditions(
    finding: Finding, previous: Sequence[Mapping[str, Any]], timestamp: str
) -> list[Condition]:
    """The seven conditions; lastTransitionTime moves only when a condition's status changes.

    An invalid spec changes only `Valid`, `Stalled`, `Reconciling` and `Ready`: `Applied`,
    `Progressing` and `Degraded` keep describing the config still in effect (nothing else
    changed), with the generation they were set for.
    """
    before = {c.get("type"): c for c in previous}
    if not finding.valid:
        message = _problems_message(finding.problems)
        wanted: list[_Wanted] = [
            ("Ready", "False", "InvalidSpec", "the spec is invalid; the running config is kept"),
            ("Reconciling", "False", "InvalidSpec", "the spec must be fixed first"),
            ("Stalled", "True", "InvalidSpec", message),
            ("Valid", "False", "InvalidSpec", message),
        ]
        kept: list[_Wanted] = []
        for kind in ("Applied", "Progressing", "Degraded"):
            old = before.get(kind)
            if old is not None:
                kept.append((kind, old["status"], old["reason"], old["message"]))
        return _stamped(wanted, before, finding.generation, timestamp) + _stamped(
            kept, before, finding.generation, timestamp, keep_generation=True
        )

    ready = _ready(finding)
    stalled = finding.stalled
    wanted = [
        ("Ready", *ready),
        (
            ("Reconciling", "False", "Stalled", "the operator cannot make progress on its own")
            if stalled
            else ("Reconciling", "False", "Reconciled", "the desired config is in effect")
            if ready[0] == "True"
            else ("Reconciling", "True", ready[1], ready[2])
        ),
        ("Stalled", "True", *stalled)
        if stalled
        else ("Stalled", "False", "NotStalled", "progressing normally"),
        ("Valid", "True", "Valid", "the spec passes every check"),
        (
            ("Applied", "True", "Applied", f"config {finding.desired_hash[:12]} is in effect")
            if finding.applied
            else (
                "Applied",
                "False",
                finding.waiting[0] or "Applying",
                finding.waiting[1] or "applying",
            )
        ),
        (
            ("Progressing", "True", "RollingOut", _rollout_message(finding))
            if finding.progressing
            else ("Progressing", "False", "Idle", "no rollout under way")
        ),
        (
            (
                "Degraded",
                "True",
                finding.degraded_reason or "ApplyFailed",
                _clip("; ".join(finding.degraded)),
            )
            if finding.degraded
            else ("Degraded", "False", "AsExpected", "nothing failed")
        ),
    ]
    return _stamped(wanted, before, finding.generation, timestamp)


def _ready(finding: Finding) -> tuple[ConditionStatus, str, str]:
    if finding.ready:
        if finding.serving is not None:  # in effect, but some in-cluster Nodes never came back
            return ("True", "Ready", _clip(finding.serving[1]))
        return ("True", "Ready", f"config {finding.desired_hash[:12]} is in effect")
    if finding.degraded:
        return ("False", finding.degraded_reason or "ApplyFailed", _clip(finding.degraded[0]))
    if finding.progressing:
        return ("False", "RollingOut", _rollout_message(finding))
    if finding.applied and finding.serving is not None:
        return ("False", finding.serving[0], _clip(finding.serving[1]))
    reason, message = finding.waiting
    return ("False", reason or "Applying", message or "applying")


def _rollout_message(finding: Finding) -> str:
    under_way = [r for r in finding.rollouts if r.state == "Progressing"]
    scopes = {r.scope for r in under_way}
    parts = [f"{r.scope}: {r.workload} {r.message}" for r in under_way]
    parts += [f"{p.scope}: {p.reason}" for p in finding.pending if p.scope not in scopes]
    return _clip("; ".join(parts) or "rolling out")


def reconciling_status(
    previous: Mapping[str, Any], generation: int, timestamp: str
) -> EdgeConfigStatus:
    """What a pass writes the moment it sees a new generation, before it decides anything:
    the generation observed, `Reconciling=True` and `Ready=Unknown` (kstatus: InProgress), the
    other conditions as they were."""
    message = f"generation {generation} seen: validating and applying it"
    wanted: list[_Wanted] = [
        ("Ready", "Unknown", "Reconciling", message),
        ("Reconciling", "True", "NewGeneration", message),
        ("Stalled", "False", "NotStalled", "progressing normally"),
    ]
    old = [
        c for c in previous.get("conditions") or () if c.get("type") not in {w[0] for w in wanted}
    ]
    before = {c.get("type"): c for c in previous.get("conditions") or ()}
    conditions = _stamped(wanted, before, generation, timestamp)
    conditions += [Condition.model_validate(c) for c in old if _known(c)]
    return EdgeConfigStatus(observed_generation=generation, conditions=conditions)


def _known(condition: Mapping[str, Any]) -> bool:
    try:
        Condition.model_validate(condition)
    except ValueError:
        return False
    return True


def _stamped(
    wanted: Sequence[_Wanted],
    before: Mapping[Any, Mapping[str, Any]],
    generation: int,
    timestamp: str,
    keep_generation: bool = False,
) -> list[Condition]:
    conditions = []
    for kind, status, reason, message in wanted:
        old = before.get(kind)
        moved = old is None or old.get("status") != status
        observed = generation
        if keep_generation and old is not None:
            observed = int(old.get("observedGeneration") or generation)
        conditions.append(
            Condition(
                type=kind,
                status=status,
                reason=reason,
                message=message,
                observed_generation=observed,
                last_transition_time=timestamp
                if moved or old is None
                else old.get("lastTransitionTime", timestamp),
            )
        )
    return conditions


def build_status(
    finding: Finding,
    previous: Mapping[str, Any],
    last_change: LastChange | None,
    timestamp: str,
    *,
    history: Sequence[HistoryEntry] | None = None,
    rollout: RevisionRollout | None = None,
) -> EdgeConfigStatus:
    """The whole `.status` (a merge patch replaces it field by field; an invalid spec leaves
    out everything but the generation, the conditions and the problems, which keeps the rest;
    so does a pass that brings no `history`: the cluster revisions stay as they were)."""
    conditions = build_conditions(finding, previous.get("conditions") or (), timestamp)
    problems = [ProblemEntry(path=p.path, message=p.message) for p in finding.problems[:MAX_ITEMS]]
    if not finding.valid:
        return EdgeConfigStatus(
            observed_generation=finding.generation, conditions=conditions, problems=problems
        )
    acked = sum(1 for node in finding.nodes if node.state == "Acked")
    shown_nodes = [n for n in finding.nodes if n.state != "Acked"][:MAX_ITEMS]
    room = MAX_ITEMS - len(shown_nodes)
    shown_nodes += [n for n in finding.nodes if n.state == "Acked"][: max(0, room)]
    shown_nodes.sort(key=lambda n: n.node_id)
    pending = [p.scope for p in finding.pending]
    return EdgeConfigStatus(
        observed_generation=finding.generation,
        conditions=conditions,
        problems=problems,
        desired_config_hash=finding.desired_hash,
        applied_config_hash=finding.applied_hash,
        config_short_hash=finding.applied_hash[:12],
        pending_restart=",".join(pending) if pending else "none",
        nodes_acked=f"{acked}/{finding.node_total}",
        last_change=last_change,
        replicas=[_replica(o) for o in finding.replicas[:MAX_ITEMS]],
        nodes=[_node(n) for n in shown_nodes],
        omitted_nodes=len(finding.nodes) - len(shown_nodes),
        rollouts=[_rollout(r) for r in finding.rollouts[:MAX_ITEMS]],
        revision=rollout.stable if rollout is not None else None,
        rollout=rollout,
        history=list(history) if history is not None else None,
    )


def read_history(status: Mapping[str, Any]) -> tuple[HistoryEntry, ...]:
    """The cluster revisions a status holds (newest first); an entry that does not read (a
    status written by another release) is left out."""
    entries = []
    for item in status.get("history") or ():
        try:
            entries.append(HistoryEntry.model_validate(item))
        except ValueError:
            continue
    return tuple(sorted(entries, key=lambda e: e.revision, reverse=True))


def same_status(status: Mapping[str, Any], other: Mapping[str, Any] | None) -> bool:
    """Equal but for the conditions' transition times (which only move with their status)."""
    if other is None:
        return False
    return _comparable(status) == _comparable(other)


def _comparable(status: Mapping[str, Any]) -> dict[str, Any]:
    result = {k: v for k, v in status.items() if k != "conditions"}
    if isinstance(result.get("rollout"), Mapping):  # its nulls are removals (`document`)
        result["rollout"] = {k: v for k, v in result["rollout"].items() if v is not None}
    result["conditions"] = sorted(
        (
            (
                c.get("type"),
                c.get("status"),
                c.get("reason"),
                c.get("message"),
                c.get("observedGeneration"),
            )
            for c in status.get("conditions") or ()
        ),
        key=str,
    )
    return result


def _replica(outcome: ReplicaOutcome) -> ReplicaEntry:
    return ReplicaEntry(
        pod=outcome.replica.name,
        address=outcome.replica.admin_url,
        state=outcome.state,
        config_hash=outcome.config_hash,
        snapshot=outcome.status.snapshot if outcome.status is not None else None,
        reason=outcome.reason,
    )


def _node(result: NodeResult) -> NodeEntry:
    return NodeEntry(
        node_id=result.node_id,
        state=result.state,
        reason=result.reason,
        draining_runs=result.draining_runs or None,
    )


def _rollout(record: RolloutRecord) -> RolloutEntry:
    return RolloutEntry(
        scope=record.scope,
        workload=record.workload,
        config_hash=record.config_hash,
        state=record.state,
        message=record.message,
    )
