"""The reconcile's decisions: pure functions of what a pass observed and what its acts returned.

A pass (`reconciling.py`) observes, then asks `plan` what the change is and which restarts it
needs; it acts (writes the ConfigMap, stamps workloads, applies live on the replicas) and asks
`judge` what the results mean: whether to commit the change as applied, which restarts are done,
what the status says and when to look again. Nothing here calls the cluster, so every rule is
driven by unit tests without one (tests/operator/test_deciding.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from iop.edgeconfig import ChangeReport, EdgeConfig, classify

from . import conventions
from .documents import AppliedState, RestartRecord
from .values import (
    EdgeReplica,
    Event,
    Finding,
    NodeResult,
    PendingRestart,
    ReplicaOutcome,
    RolloutRecord,
    Workload,
    node_results,
)

#: After a config comes into effect (the first apply, a restart done), how long `Ready` waits for
#: the in-cluster Nodes to be connected to every Edge replica again: Ready means serving.
SERVING_WAIT_S: Final = 60.0

#: When the worker runs the next pass: `retry` with back-off (something failed), `motion` soon
#: (a rollout or a drain moves with no event to say so), `soon` (a restart or an apply is under
#: way), `nodes` with a growing delay (nodes not all current), `idle` at the resync.
NextPass = Literal["retry", "motion", "soon", "nodes", "idle"]


@dataclass(frozen=True, slots=True)
class Observation:
    """What a pass found before it acted."""

    namespace: str
    name: str
    generation: int
    desired: EdgeConfig
    desired_hash: str
    #: The record of what was last applied (None before the first apply).
    applied: AppliedState | None
    #: What the change is classified against: the record's config, else (before the first
    #: apply) what the Edge ConfigMap held, else nothing (each replica's own answer decides).
    base: EdgeConfig | None
    edges: tuple[Workload, ...] = ()
    nodes: Mapping[str, tuple[Workload, ...]] = field(default_factory=dict)
    replicas: tuple[EdgeReplica, ...] = ()

    @property
    def new_change(self) -> bool:
        """The desired config is not the one last committed."""
        return self.applied is None or self.applied.config_hash != self.desired_hash


@dataclass(frozen=True, slots=True)
class Plan:
    """What the change is, and every restart still to do or confirm (new ones included)."""

    change: ChangeReport | None
    restarts: tuple[RestartRecord, ...]

    def node_restarts(self) -> list[str]:
        """The `node:<id>` scopes whose workloads the operator restarts (told to the replicas,
        which hold those nodes on their running adapters until the new pods connect)."""
        return sorted({r.scope for r in self.restarts if r.scope.startswith("node:")})


def plan(observation: Observation) -> Plan:
    """The change against the base, and the restarts: the record's open ones, a scope the
    change names replacing an older record of it, and none for a scope no longer in the config."""
    restarts = list(observation.applied.restarts) if observation.applied is not None else []
    change = None
    if observation.new_change and observation.base is not None:
        change = classify(observation.base, observation.desired)
        restarts = list(_with_scopes(restarts, change.restart_scopes, observation.desired_hash))
    node_ids = {node.id for node in observation.desired.nodes}
    kept = [r for r in restarts if r.scope == "edge" or node_of(r.scope) in node_ids]
    return Plan(change, tuple(kept))


def with_restarts(current: Plan, scopes: Iterable[str], desired_hash: str) -> Plan:
    """`current` with restarts a replica named that the classification lacked (its config was
    not the record's, e.g. before the first apply)."""
    known = {r.scope for r in current.restarts}
    added = [RestartRecord(s, desired_hash) for s in sorted(set(scopes) - known)]
    return replace(current, restarts=(*current.restarts, *added)) if added else current


def stamps_due(observation: Observation, current: Plan) -> list[tuple[Workload, RestartRecord]]:
    """Each workload of each restart whose pod template does not carry the restart's config
    hash yet: stamping it rolls it (a stamped one is never rolled again for that hash). A return
    to the stable revision rolls nothing that still runs the stable revision's template."""
    stable = observation.applied.stable if observation.applied is not None else None
    due = []
    for record in current.restarts:
        for workload in workloads_of(observation, record.scope):
            if workload.stamp == record.config_hash:
                continue
            if (
                stable is not None
                and stable.config_hash == record.config_hash
                and workload.stamp == stable.stamps.get(workload.key, "")
            ):
                continue
            due.append((workload, record))
    return due


def live_targets(observation: Observation) -> tuple[list[EdgeReplica], list[EdgeReplica]]:
    """(current, ready): the replicas of the Edge workload's current pod template (pods of an
    older one are being rolled away and are not asked), and those of them that are ready."""
    stamps = {w.stamp for w in observation.edges}
    current = [
        r
        for r in observation.replicas
        if r.stamp is None or not observation.edges or r.stamp in stamps
    ]
    return current, [r for r in current if r.ready]


def settled_outcomes(
    current: Plan,
    outcomes: Sequence[ReplicaOutcome],
    replicas: Sequence[EdgeReplica],
    asked: Collection[EdgeReplica],
) -> list[ReplicaOutcome]:
    """The outcomes as the status shows them: a replica that refused for a restart the operator
    already waits for is AwaitingRestart, and each replica that was not asked is Replaced."""
    waiting_for = {r.scope for r in current.restarts}
    settled = [
        replace(o, state="AwaitingRestart")
        if o.state == "Failed" and o.restart_scopes and set(o.restart_scopes) <= waiting_for
        else o
        for o in outcomes
    ]
    settled += [
        ReplicaOutcome(r, "Replaced", "its pod template is being replaced")
        for r in replicas
        if r not in asked
    ]
    return settled


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a pass's results mean."""

    finding: Finding
    #: The record to save (a change committed, or its open restarts changed); None: keep it.
    record: AppliedState | None
    events: tuple[Event, ...]
    next: NextPass


def judge(
    observation: Observation,
    current: Plan,
    outcomes: Sequence[ReplicaOutcome],
    stamps: Mapping[str, str],
    *,
    effective_hash: str,
    in_effect_for: float | None,
    committed_at: float = 0.0,
    admin_unreachable_hint: str = "",
) -> Verdict:
    """Everything the pass's results decide.

    `stamps`: each workload's stamp after this pass's acts; `effective_hash`: the config last
    seen fully in effect; `in_effect_for`: seconds since the desired config was first seen in
    effect (None: it has not been yet); `committed_at`: the Unix time a commit is recorded with.
    """
    desired_hash = observation.desired_hash
    failed = [o for o in outcomes if o.state in ("Failed", "Unreachable")]
    edge_rolls = any(r.scope == "edge" and r.config_hash == desired_hash for r in current.restarts)
    open_restarts, rollouts, pending = _restarts_left(observation, current, outcomes)
    events: list[Event] = []
    record = None
    committed = not observation.new_change
    if observation.new_change and (not failed or edge_rolls):
        record = AppliedState(
            observation.desired,
            desired_hash,
            observation.generation,
            dict(stamps),
            tuple(open_restarts),
            committed_at,
            observation.applied.stable if observation.applied is not None else None,
        )
        committed = True
        events += _applied_events(observation, current, outcomes)
    elif committed and observation.applied is not None:
        if observation.applied.restarts != tuple(open_restarts) or dict(
            observation.applied.stamps
        ) != dict(stamps):
            record = replace(
                observation.applied, stamps=dict(stamps), restarts=tuple(open_restarts)
            )
    if committed:
        events += [
            Event("Normal", "RolledOut", f"restart {r.scope} done for config {r.config_hash[:12]}")
            for r in current.restarts
            if r not in open_restarts
        ]

    node_ids = {node.id for node in observation.desired.nodes}
    restarting = {node_of(r.scope) for r in open_restarts if r.scope != "edge"}
    nodes_seen = node_results(node_ids, outcomes, restarting)
    finding = Finding(
        observation.generation,
        desired_hash=desired_hash,
        node_total=len(node_ids),
        replicas=tuple(outcomes),
        nodes=tuple(nodes_seen),
        rollouts=tuple(rollouts),
        pending=tuple(_one_per_scope(pending)),
    )
    if admin_unreachable_hint and any(o.state == "Unreachable" for o in outcomes):
        finding.degraded.append(admin_unreachable_hint)
    _assess(finding, observation, committed, outcomes, open_restarts)
    if finding.applied and not finding.degraded and not finding.progressing:
        _wait_for_nodes(finding, observation, nodes_seen, in_effect_for)
    finding.applied_hash = desired_hash if finding.applied else effective_hash
    events += _report_events(finding, nodes_seen)
    return Verdict(finding, record, tuple(events), _next_pass(finding, observation, nodes_seen))


# -- the parts of the verdict ------------------------------------------------------------------


def _restarts_left(
    observation: Observation, current: Plan, outcomes: Sequence[ReplicaOutcome]
) -> tuple[list[RestartRecord], list[RolloutRecord], list[PendingRestart]]:
    """Which restarts are not done yet, the rollouts behind them, and why each waits.

    `edge` is done when its workloads rolled out and every ready replica runs the desired
    config; `node:<id>` when its workloads rolled out and the node runs the desired payload on
    every replica. A scope without a workload is done only when that holds too: someone
    restarted it by hand.
    """
    left: list[RestartRecord] = []
    rollouts: list[RolloutRecord] = []
    pending: list[PendingRestart] = []
    asked = [o for o in outcomes if o.state != "Replaced"]
    replicas_current = bool(asked) and all(
        o.state == "Applied" and o.config_hash == observation.desired_hash for o in asked
    )
    for record in current.restarts:
        workloads = workloads_of(observation, record.scope)
        if record.scope == "edge":
            selector, what = conventions.edge_selector(observation.name), "the Edge"
            arrived = replicas_current
        else:
            node_id = node_of(record.scope)
            selector = conventions.node_selector(observation.name, node_id)
            what = f"node {node_id}"
            views = [
                n
                for o in outcomes
                if o.status is not None
                for n in o.status.nodes
                if n.node_id == node_id
            ]
            arrived = bool(views) and all(n.current for n in views)
        rollouts += [
            RolloutRecord(record.scope, w.key, w.stamp, w.rollout.phase, w.rollout.message)
            for w in workloads
        ]
        rolled = all(w.rollout.phase == "Complete" for w in workloads)
        if rolled and arrived:
            continue
        left.append(record)
        if not workloads:
            reason = (
                f"no workload labelled {selector} in namespace {observation.namespace}: "
                f"restart {what} by hand"
            )
        elif not rolled:
            reason = "rolling out"
        else:
            reason = f"rolled out; waiting for {what} to run the new config"
        pending.append(PendingRestart(record.scope, reason))
    return left, rollouts, pending


def _assess(
    finding: Finding,
    observation: Observation,
    committed: bool,
    outcomes: Sequence[ReplicaOutcome],
    open_restarts: Sequence[RestartRecord],
) -> None:
    """Applied, Progressing, Degraded and Stalled from what the pass saw."""
    for outcome in outcomes:
        if outcome.state in ("Failed", "Unreachable"):
            finding.degraded.append(
                f"replica {outcome.replica.name} {outcome.state.lower()}: {outcome.reason}"
            )
            finding.degraded_reason = finding.degraded_reason or (
                "ReplicaUnreachable" if outcome.state == "Unreachable" else "ReplicaFailed"
            )
    rolled_back = [o for o in outcomes if o.rolled_back]
    if rolled_back:
        # The Edge judged this config by what it served and put its last good one back: the
        # operator cannot make this generation work; a changed spec starts a new rollout.
        finding.degraded_reason = "RolledBack"
        finding.stalled = (
            "RolledBack",
            "; ".join(f"replica {o.replica.name}: {o.reason}" for o in rolled_back)
            + "; apply a changed spec to start a new rollout (docs/rollout.md)",
        )
    stalled = [r for r in finding.rollouts if r.state == "Stalled"]
    for rollout in stalled:
        finding.degraded.append(f"rollout of {rollout.workload} stalled: {rollout.message}")
        finding.degraded_reason = finding.degraded_reason or "RolloutStalled"
    if stalled:
        finding.stalled = (
            "ProgressDeadlineExceeded",
            "; ".join(f"{r.workload}: {r.message}" for r in stalled),
        )
    finding.progressing = bool(open_restarts) and not stalled
    ready = [o for o in outcomes if o.state == "Applied"]
    asked = [o for o in outcomes if o.state != "Replaced"]
    if not committed:
        finding.waiting = ("ApplyFailed", "the change is not applied on every replica yet")
    elif open_restarts:
        scopes = ", ".join(r.scope for r in open_restarts)
        finding.waiting = ("RestartPending", f"waiting for the restart of {scopes}")
    elif not observation.replicas and not observation.edges:
        finding.waiting = (
            "NoEdgeWorkload",
            f"no Edge workload labelled {conventions.edge_selector(observation.name)} in "
            f"namespace {observation.namespace}",
        )
        finding.degraded.append(finding.waiting[1])
        finding.degraded_reason = finding.degraded_reason or "NoEdgeWorkload"
    elif not ready:
        finding.waiting = ("WaitingForReplicas", "no ready Edge replica yet")
    elif len(ready) < len(asked):
        finding.waiting = ("ApplyFailed", "not every ready replica runs the desired config")
    else:
        finding.applied = True


def _wait_for_nodes(
    finding: Finding,
    observation: Observation,
    nodes_seen: Sequence[NodeResult],
    in_effect_for: float | None,
) -> None:
    """Ready means serving: while the config is newly in effect (the first apply, a restart just
    done), wait for the Nodes that run in the cluster to be back on every replica, up to
    `SERVING_WAIT_S`; past it, say in the message who is still missing."""
    in_cluster = {
        node_id
        for node_id, workloads in observation.nodes.items()
        if any(w.replicas > 0 for w in workloads)
    }
    missing = sorted(
        n.node_id for n in nodes_seen if n.node_id in in_cluster and n.state != "Acked"
    )
    if not missing:
        return
    elapsed = in_effect_for or 0.0
    more = len(missing) - 10
    who = f"node{'s' if len(missing) != 1 else ''} {', '.join(missing[:10])}"
    who += f" and {more} more" if more > 0 else ""
    head = f"config {finding.desired_hash[:12]} is in effect"
    if elapsed < SERVING_WAIT_S:
        finding.serving = (
            "WaitingForNodes",
            f"{head}; waiting (at most {SERVING_WAIT_S:.0f}s) for {who} to connect to every "
            "Edge replica",
        )
    else:
        finding.serving = (
            "NodesMissing",
            f"{head}; {who} did not connect to every Edge replica within {SERVING_WAIT_S:.0f}s",
        )


def _applied_events(
    observation: Observation, current: Plan, outcomes: Sequence[ReplicaOutcome]
) -> list[Event]:
    """AppliedLive, when a change is committed without a restart."""
    short = observation.desired_hash[:12]
    applied = sum(o.state == "Applied" for o in outcomes)
    replicas = f"{applied} replica{'s' if applied != 1 else ''}"
    if current.change is None:
        name = conventions.edge_configmap_name(observation.name)
        runs = "runs" if applied == 1 else "run"
        return [
            Event(
                "Normal",
                "AppliedLive",
                f"generation {observation.generation} (config {short}) is the first applied: "
                f"{name} written, {applied} ready replica{'s' if applied != 1 else ''} {runs} it",
            )
        ]
    if current.restarts:
        return []
    paths = len(current.change.live_paths)
    return [
        Event(
            "Normal",
            "AppliedLive",
            f"generation {observation.generation} (config {short}) applied live on {replicas}: "
            f"{paths} live path{'s' if paths != 1 else ''}",
        )
    ]


def _report_events(finding: Finding, nodes_seen: Sequence[NodeResult]) -> list[Event]:
    events: list[Event] = []
    if finding.degraded:
        events.append(Event("Warning", "Degraded", "; ".join(finding.degraded)))
    failed_nodes = [n for n in nodes_seen if n.state == "Failed"]
    if failed_nodes:
        shown = "; ".join(f"{n.node_id}: {n.reason}" for n in failed_nodes[:10])
        events.append(Event("Warning", "NodeFailed", shown))
    events += [
        Event("Warning", "RestartPending", f"{item.scope}: {item.reason}")
        for item in finding.pending
        if item.reason.startswith("no workload")
    ]
    if finding.serving and finding.serving[0] == "NodesMissing":
        events.append(Event("Warning", "NodesMissing", finding.serving[1]))
    if finding.ready:
        events.append(Event("Normal", "Ready", f"config {finding.desired_hash[:12]} is in effect"))
    return events


def _next_pass(
    finding: Finding, observation: Observation, nodes_seen: Sequence[NodeResult]
) -> NextPass:
    if finding.degraded:
        return "retry"
    workloads = [*observation.edges, *(w for items in observation.nodes.values() for w in items)]
    rolling = any(w.rollout.phase == "Progressing" for w in workloads)
    if rolling or any(node.draining_runs for node in nodes_seen):
        # A rollout, ours or anyone's (`kubectl rollout restart`), or a drain: the nodes'
        # progress (a superseded process finishing its runs) changes with no event to say so.
        return "motion"
    if finding.serving and finding.serving[0] == "WaitingForNodes":
        return "motion"
    if finding.progressing or not finding.applied:
        return "soon"
    if any(node.state != "Acked" for node in nodes_seen):
        return "nodes"
    return "idle"


def _one_per_scope(pending: Sequence[PendingRestart]) -> list[PendingRestart]:
    """One entry per scope: a workload's rollout says more than "pending"."""
    seen: set[str] = set()
    unique = []
    for item in pending:
        if item.scope not in seen:
            seen.add(item.scope)
            unique.append(item)
    return unique


def _with_scopes(
    restarts: Sequence[RestartRecord], scopes: Iterable[str], desired_hash: str
) -> list[RestartRecord]:
    result = list(restarts)
    for scope in scopes:
        result = [r for r in result if r.scope != scope]
        result.append(RestartRecord(scope, desired_hash))
    return result


def workloads_of(observation: Observation, scope: str) -> tuple[Workload, ...]:
    """The workloads a restart scope rolls: the Edge's, or one node's."""
    if scope == "edge":
        return observation.edges
    return tuple(observation.nodes.get(node_of(scope), ()))


def node_of(scope: str) -> str:
    """The node id of a `node:<id>` scope."""
    return scope.removeprefix("node:")
