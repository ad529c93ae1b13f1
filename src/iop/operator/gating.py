"""The restart gates and the stable revision: pure functions of what a pass observed.

A restart-required change rolls its workloads one surge pod first; the gate fails when the
first new pod is not available by the Deployment's progress deadline (`failed_restarts`); for
a node, when its new process serves worse than the old one did (`worse_restarts`, against the
`NodeBaseline` noted when the node was stamped); for the Edge, when its new pods' requests fare
worse than the old pods' in the same stretch, by the rules of `rollout` (`worse_edge`, against
the `EdgeBaseline` noted when the Edge was stamped; the Deployment's `minReadySeconds` keeps the
old pods serving beside the first new one while it is judged). A failed gate puts every
workload back on the stable revision's stamp (`stamps_back`). The stable revision is the newest
config that came through (`came_through`); the Edge ConfigMap holds it while a newer config is
on trial or was rolled back (`pods_config`). The reconcile pass acts on these
(`reconciling.py`; a failed gate: `restoring.py`); docs/operator.md, "Revisions", has the rules;
tests/operator/test_deciding.py and tests/operator/test_restart_baselines.py drive them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from iop.edgeconfig import EdgeConfig
from iop.verdicts import Figures, judge
from iop.wire import ADAPTER_ERROR, PROBE_FAILED, REQUEST_FAILURES, UNSPECIFIED

from .deciding import Observation, Plan, node_of, workloads_of
from .documents import AppliedState, EdgeBaseline, NodeBaseline, StableRevision
from .status import GOOD_OUTCOMES
from .values import ReplicaOutcome, Workload

#: Why a provider is unhealthy that is a verdict on the process serving it. Not the others:
#: not probed yet, not reported yet, its node connected but not ready yet (the Edge says
#: `node_disconnected` until the new process has taken its config), draining (being stopped).
_WORSE_REASONS = frozenset({PROBE_FAILED, REQUEST_FAILURES, ADAPTER_ERROR, UNSPECIFIED})


@dataclass(frozen=True, slots=True)
class FailedRestart:
    """A workload whose restart for the desired config did not come through its gate."""

    scope: str
    workload: str
    message: str

    def __str__(self) -> str:
        return f"{self.workload} ({self.scope}): {self.message}"


def failed_restarts(observation: Observation, current: Plan) -> list[FailedRestart]:
    """The desired config's restarts whose rollout stalled: the first new pod (the surge; no old
    pod goes before it is ready) did not become available within the workload's progress
    deadline. Each is the gate's verdict on the change: it goes back to the stable revision."""
    failed = []
    for record in current.restarts:
        if record.config_hash != observation.desired_hash:
            continue
        for workload in workloads_of(observation, record.scope):
            if workload.stamp == record.config_hash and workload.rollout.phase == "Stalled":
                failed.append(FailedRestart(record.scope, workload.key, workload.rollout.message))
    return failed


def node_baseline(
    outcomes: Sequence[ReplicaOutcome], node_id: str, config_hash: str
) -> NodeBaseline | None:
    """`node_id` as the replicas last saw it connected, before its restart for `config_hash`;
    None when none did."""
    views = [
        n
        for o in outcomes
        if o.status is not None
        for n in o.status.nodes
        if n.node_id == node_id and n.connected and n.instance_id
    ]
    if not views:
        return None
    return NodeBaseline(
        config_hash,
        frozenset(v.instance_id for v in views),
        frozenset.intersection(*(v.healthy for v in views)),
    )


def worse_restarts(
    observation: Observation,
    current: Plan,
    outcomes: Sequence[ReplicaOutcome],
    baselines: Mapping[str, NodeBaseline],
) -> list[FailedRestart]:
    """The desired config's node restarts whose new process serves worse than the old one did:
    a provider healthy before the restart is unhealthy on the new process (its adapter cannot
    run there, or its probes or requests failed; not merely "not known yet": `_WORSE_REASONS`).
    The other half of a restart's gate, beside its readiness: compared with the old pod's
    figures, so a provider whose server was already down blames nothing on the change."""
    failed = []
    for record in current.restarts:
        baseline = baselines.get(record.scope)
        if (
            record.config_hash != observation.desired_hash
            or baseline is None
            or baseline.config_hash != record.config_hash
        ):
            continue
        node_id = node_of(record.scope)
        worse: dict[str, str] = {}
        for outcome in outcomes:
            for view in outcome.status.nodes if outcome.status is not None else ():
                if (
                    view.node_id != node_id
                    or not view.connected
                    or not view.instance_id  # an Edge that does not say which process
                    or view.instance_id in baseline.instances
                ):
                    continue
                for provider, reason, detail in view.unhealthy:
                    if provider in baseline.healthy and reason in _WORSE_REASONS:
                        worse.setdefault(provider, f"{reason}: {detail}" if detail else reason)
        if worse:
            said = "; ".join(f"provider {p} {why}" for p, why in sorted(worse.items()))
            where = ", ".join(w.key for w in workloads_of(observation, record.scope)) or node_id
            failed.append(
                FailedRestart(
                    record.scope,
                    where,
                    f"its new process serves worse than the old one: {said} (healthy before)",
                )
            )
    return failed


def edge_baseline(outcomes: Sequence[ReplicaOutcome], config_hash: str) -> EdgeBaseline | None:
    """The Edge's pods as the replicas last said, before its restart for `config_hash`: what
    each had served; None when none says (an Edge that does not count)."""
    replicas = {
        o.replica.name: o.status.served.figures
        for o in outcomes
        if o.status is not None and o.status.served is not None
    }
    return EdgeBaseline(config_hash, replicas) if replicas else None


def worse_edge(
    observation: Observation,
    current: Plan,
    outcomes: Sequence[ReplicaOutcome],
    baseline: EdgeBaseline | None,
    now: float,
) -> list[FailedRestart]:
    """The desired config's Edge restart, when its new pods (created from the stamped template)
    fare worse than the old pods since the stamp: their requests failed or needed a retry more
    often, or their first token or duration p95 is slower, beyond what `rollout` allows (the
    checks of a watched live change, `iop.verdicts.judge`, with the new pods as the candidate).
    Judged while old pods serve beside new ones; `rollout.mode: off` turns it off with the
    rest. `now`: Unix seconds."""
    rules = observation.desired.rollout
    digest = observation.desired_hash
    if (
        baseline is None
        or rules.mode == "off"
        or baseline.config_hash != digest
        or not any(r.scope == "edge" and r.config_hash == digest for r in current.restarts)
    ):
        return []
    new, old = Figures(), Figures()
    started: list[float] = []
    for outcome in outcomes:
        served = outcome.status.served if outcome.status is not None else None
        if served is None:
            continue
        name = outcome.replica.name
        before = baseline.replicas.get(name)
        if outcome.replica.stamp == digest and before is None:
            new, started = new + served.figures, [*started, served.since]
        elif before is not None and served.figures.requests >= before.requests:
            old = old + (served.figures - before)  # (a process that restarted counts anew)
    if not started:
        return []
    judgement = judge(rules, old, new, max(0.0, now - min(started)))
    if judgement.verdict != "roll_back":
        return []
    where = ", ".join(w.key for w in observation.edges) or "the Edge"
    return [
        FailedRestart(
            "edge",
            where,
            f"its new pods serve worse than the old ones since the restart "
            f"({judgement.check}): {judgement.message}",
        )
    ]


def stamps_back(observation: Observation, stable: StableRevision) -> list[tuple[Workload, str]]:
    """Each workload stamped with the desired config, and the stamp of its last good template
    (the stable revision's; "" for a template that carried none)."""
    workloads = [*observation.edges, *(w for items in observation.nodes.values() for w in items)]
    return [
        (w, stable.stamps.get(w.key, ""))
        for w in workloads
        if w.stamp == observation.desired_hash and w.stamp != stable.stamps.get(w.key, "")
    ]


def pods_config(observation: Observation, current: Plan, held: bool) -> tuple[EdgeConfig, str]:
    """(the config, its hash) the Edge ConfigMap holds: what an Edge pod that starts runs.

    The desired config while nothing came through before it, and when the Edge rolls to take
    it (its new pods must); else the stable revision while the desired one is on trial or was
    rolled back: a pod that starts mid-canary starts on the stable config and is given the
    candidate live, judged again, and one that starts after a rollback runs the stable config.
    """
    applied = observation.applied
    stable = applied.stable if applied is not None else None
    desired = (observation.desired, observation.desired_hash)
    if stable is None or stable.config_hash == observation.desired_hash:
        return desired
    if not held and any(
        r.scope == "edge" and r.config_hash == observation.desired_hash for r in current.restarts
    ):
        return desired
    return stable.config, stable.config_hash


def came_through(record: AppliedState | None, outcome: str | None) -> AppliedState | None:
    """The record with its config as the stable revision, once that config came through (its
    revision's outcome good, no restart of it open); None while it has not, or already is."""
    if record is None or record.restarts or outcome not in GOOD_OUTCOMES:
        return None
    if record.stable is not None and record.stable.config_hash == record.config_hash:
        return None
    return record.with_stable()
