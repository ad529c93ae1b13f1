"""The operator's values: what one pass observes and decides about, with no I/O.

The replicas and what they answered (`EdgeReplica`, `ReplicaStatus`, `ApplyReport`,
`ReplicaOutcome`, `NodeResult`, `ReplicaRevisions`), the workloads and their rollouts
(`Workload`), and the Events a pass decides to post: the modules that talk to the Edge and to
Kubernetes build them, `deciding.py` and `revisions.py` read them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from iop.edgeconfig import Problem
from iop.verdicts import Figures

from . import conventions

# -- the Edge replicas, and what they answer ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class EdgeReplica:
    """One Edge replica as the operator talks to it."""

    #: The pod's name (or the URL, for a fixed replica): how status and events name it.
    name: str
    uid: str
    admin_url: str
    #: Ready by its readiness probe (fixed replicas always are).
    ready: bool
    #: The `iop.dev/config-hash` stamp of the pod template it was created from ("" for none);
    #: None for a replica outside any workload the operator rolls.
    stamp: str | None


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node as one replica sees it (`GET /status`)."""

    node_id: str
    connected: bool
    current: bool
    #: Runs its draining processes still finish (a SIGTERM drain, or an older process a newer
    #: one superseded in a rollout): what a node rollout's status shows counting down.
    draining_runs: int = 0
    #: The node process that serves it (a new one after a restart); "" from an older Edge.
    instance_id: str = ""
    #: Its providers that are healthy, and those that are not with why (reason: detail).
    healthy: frozenset[str] = frozenset()
    unhealthy: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class CandidateView:
    """The change a replica is judging (`GET /status`, `revisions.candidate`)."""

    revision: int
    config_hash: str
    #: canary (a share of the touched models' requests) or watch (all of them); None: an Edge
    #: that does not say.
    mode: str | None = None
    #: The share of the touched models' requests on the candidate, during a canary.
    share_percent: int | None = None


@dataclass(frozen=True, slots=True)
class Served:
    """What a replica's process served since it started (`GET /status`, `served`): every model
    and revision together, in counts that subtract (what an Edge restart's gate compares)."""

    #: When the process started counting (Unix seconds).
    since: float
    figures: Figures


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """What one replica runs, and which of its nodes run that config's payload."""

    config_hash: str
    #: The replica's counter of the configs it has run (the Edge's snapshot generation: 1 at
    #: start, one more per apply that changed something); not a Kubernetes generation.
    snapshot: int
    nodes: tuple[NodeState, ...]
    #: The change it is judging, if any.
    candidate: CandidateView | None = None
    #: What its process served so far; None from an Edge that does not say.
    served: Served | None = None


@dataclass(frozen=True, slots=True)
class EdgeRevision:
    """One revision of a replica's own log (`GET /revisions`), as the operator reads it."""

    number: int
    config_hash: str
    #: The Edge's word: started, watching, promoted, unjudged, kept, rolled_back, superseded.
    outcome: str
    reason: str = ""
    #: The check that ended its watch (errors, first_token_p95, bake, traffic), or "".
    check: str = ""
    #: The judgement's figures, candidate against baseline, for people ("" without one).
    figures: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaRevisions:
    """A replica's revision log: its stable revision, its candidate, its revisions (newest
    first)."""

    replica: EdgeReplica
    stable: int | None
    candidate: int | None
    revisions: tuple[EdgeRevision, ...]

    def get(self, number: int | None) -> EdgeRevision | None:
        return next((r for r in self.revisions if r.number == number), None)

    def newest_of(self, config_hash: str) -> EdgeRevision | None:
        """Its newest revision of `config_hash`, if it keeps one."""
        return next((r for r in self.revisions if r.config_hash == config_hash), None)

    @property
    def running_hash(self) -> str:
        """The config it serves: the candidate's while it judges one, else the stable one's."""
        held = self.get(self.candidate) or self.get(self.stable)
        return held.config_hash if held is not None else ""


@dataclass(frozen=True, slots=True)
class NodePushResult:
    """One node's push in an apply: acked, failed, not_connected or held (for its restart)."""

    node_id: str
    status: str
    reason: str


@dataclass(frozen=True, slots=True)
class ApplyReport:
    """The part of a replica's refresh report the operator acts on."""

    config_hash: str
    generation: int
    changed: bool
    pushes: tuple[NodePushResult, ...]
    #: The replica's own time for the apply, node acks included.
    duration_ms: float
    message: str


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
    #: It refused the apply because it rolled this config back (docs/rollout.md).
    rolled_back: bool = False
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


# -- the workloads and their rollouts -----------------------------------------------------------

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


# -- what one pass found ------------------------------------------------------------------------


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
    #: (reason, message) when nothing will change without someone acting.
    stalled: tuple[str, str] | None = None
    #: (reason, message) while the config is in effect but in-cluster Nodes are not back yet
    #: (WaitingForNodes), or when they did not come back in time (NodesMissing).
    serving: tuple[str, str] | None = None
    replicas: Sequence[ReplicaOutcome] = ()
    nodes: Sequence[NodeResult] = ()
    node_total: int = 0
    rollouts: Sequence[RolloutRecord] = ()
    pending: Sequence[PendingRestart] = ()

    @property
    def ready(self) -> bool:
        return (
            self.valid
            and self.applied
            and not self.degraded
            and not self.progressing
            and not (self.serving and self.serving[0] == "WaitingForNodes")
        )


# -- Events -------------------------------------------------------------------------------------

#: An Event's type, as Kubernetes spells it.
EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class Event:
    """An Event a pass decided to post (once per distinct reason and message)."""

    type: EventType
    reason: str
    message: str
