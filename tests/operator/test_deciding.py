"""The reconcile's decisions, driven without a cluster: what a change is, what rolls, when a
change is committed, what the status says and when the next pass comes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from iop.edgeconfig import EdgeConfig, config_hash, load_data
from iop.operator.deciding import (
    SERVING_WAIT_S,
    Observation,
    judge,
    live_targets,
    plan,
    settled_outcomes,
    stamps_due,
    with_restarts,
)
from iop.operator.documents import AppliedState, RestartRecord
from iop.operator.gating import (
    came_through,
    edge_baseline,
    failed_restarts,
    node_baseline,
    pods_config,
    stamps_back,
    worse_edge,
    worse_restarts,
)
from iop.operator.values import (
    ApplyReport,
    EdgeReplica,
    NodeState,
    ReplicaOutcome,
    ReplicaStatus,
    RolloutState,
    Served,
    Workload,
)
from iop.verdicts import Figures

from .conftest import operator_document

COMPLETE = RolloutState("Complete", "1 of 1 replicas updated and available")
ROLLING = RolloutState("Progressing", "0 of 1 new replicas updated")


def config(edit: Any = None) -> EdgeConfig:
    document = operator_document()
    if edit is not None:
        edit(document)
    return load_data(document)


def capacity(value: int) -> Any:
    return lambda d: d["nodes"][0]["providers"][0].update(capacity=value)


def listen(value: str) -> Any:
    return lambda d: d.setdefault("openai", {}).update(listen=value)


def replica(name: str, stamp: str | None = "", ready: bool = True) -> EdgeReplica:
    return EdgeReplica(name, name, f"http://{name}:9090", ready, stamp)


def applied(
    replica_: EdgeReplica, digest: str, nodes: dict[str, bool] | None = None, *, apply: bool = True
) -> ReplicaOutcome:
    """A replica that runs `digest`, with each node connected and current as `nodes` says."""
    views = tuple(NodeState(n, True, current) for n, current in (nodes or {}).items())
    report = ApplyReport(digest, 2, True, (), 3.0, "") if apply else None
    return ReplicaOutcome(
        replica_, "Applied", status=ReplicaStatus(digest, 2, views), report=report
    )


def edge(stamp: str, rollout: RolloutState = COMPLETE) -> Workload:
    return Workload("demo-edge", stamp, rollout)


def node_workload(node_id: str, stamp: str = "", rollout: RolloutState = COMPLETE) -> Workload:
    return Workload(f"demo-{node_id}", stamp, rollout, node_id=node_id)


def observe(
    desired: EdgeConfig,
    record: AppliedState | None,
    *,
    base: EdgeConfig | None = None,
    edges: tuple[Workload, ...] = (),
    nodes: Mapping[str, tuple[Workload, ...]] | None = None,
    replicas: tuple[EdgeReplica, ...] = (replica("edge-0"),),
) -> Observation:
    return Observation(
        namespace="ns",
        name="demo",
        generation=2,
        desired=desired,
        desired_hash=config_hash(desired),
        applied=record,
        base=record.config if record is not None else base,
        edges=edges,
        nodes=nodes or {},
        replicas=replicas,
    )


def record_of(old: EdgeConfig, *restarts: RestartRecord) -> AppliedState:
    return AppliedState(old, config_hash(old), 1, {}, tuple(restarts), applied_at=100.0)


def test_a_first_apply_is_committed_and_said_once() -> None:
    desired = config()
    observation = observe(desired, None)
    current = plan(observation)
    outcomes = [applied(replica("edge-0"), observation.desired_hash)]

    verdict = judge(observation, current, outcomes, {}, effective_hash="", in_effect_for=None)

    assert current.change is None and current.restarts == ()
    assert verdict.record is not None and verdict.record.config_hash == observation.desired_hash
    assert verdict.finding.ready
    assert [e.reason for e in verdict.events] == ["AppliedLive", "Ready"]
    assert "is the first applied" in verdict.events[0].message
    assert verdict.next == "nodes"  # no node has reported yet: look again soon, then less often


def test_a_live_change_applies_without_a_roll() -> None:
    old, desired = config(), config(capacity(9))
    observation = observe(desired, record_of(old), edges=(edge(config_hash(old)),))
    current = plan(observation)

    assert current.change is not None and current.change.live_paths
    assert current.restarts == () and stamps_due(observation, current) == []
    outcomes = [applied(replica("edge-0", config_hash(old)), observation.desired_hash)]
    verdict = judge(observation, current, outcomes, {}, effective_hash="", in_effect_for=None)

    assert verdict.finding.applied and verdict.record is not None
    assert verdict.events[0].message.endswith("applied live on 1 replica: 1 live path")


def test_a_restart_stamps_only_its_scope_and_is_progressing_until_rolled_out() -> None:
    old, desired = config(), config(listen("0.0.0.0:8081"))
    digest = config_hash(desired)
    nodes = {"node-1": (node_workload("node-1", "x"),)}
    observation = observe(desired, record_of(old), edges=(edge(""),), nodes=nodes)
    current = plan(observation)

    assert current.restarts == (RestartRecord("edge", digest),)
    assert [(w.name, r.scope) for w, r in stamps_due(observation, current)] == [
        ("demo-edge", "edge")
    ]

    rolling = observe(desired, record_of(old), edges=(edge(digest, ROLLING),), nodes=nodes)
    verdict = judge(
        rolling,
        current,
        [],
        {"Deployment/demo-edge": digest},
        effective_hash="e",
        in_effect_for=None,
    )
    finding = verdict.finding
    assert finding.progressing and not finding.applied
    assert finding.applied_hash == "e"  # the config still in effect
    # Committed at once (the Edge rolls to it), with the restart still open.
    assert verdict.record is not None and verdict.record.restarts == current.restarts
    assert verdict.record.stamps == {"Deployment/demo-edge": digest}
    assert verdict.next == "motion"


def test_a_restart_is_done_when_rolled_out_and_every_replica_runs_the_config() -> None:
    desired = config(listen("0.0.0.0:8081"))
    digest = config_hash(desired)
    record = AppliedState(desired, digest, 2, {}, (RestartRecord("edge", digest),))
    observation = observe(
        desired, record, edges=(edge(digest),), replicas=(replica("edge-1", digest),)
    )
    current = plan(observation)
    outcomes = [applied(replica("edge-1", digest), digest, apply=False)]

    verdict = judge(observation, current, outcomes, {}, effective_hash="", in_effect_for=None)

    assert verdict.record is not None and verdict.record.restarts == ()
    assert "RolledOut" in [e.reason for e in verdict.events]
    assert verdict.finding.ready


def test_a_node_without_a_workload_is_restarted_by_hand() -> None:
    old = config()
    desired = config(lambda d: d["nodes"][1]["providers"][0]["adapter"].update(latency_ms=5))
    observation = observe(desired, record_of(old))
    current = plan(observation)
    outcomes = [applied(replica("edge-0"), observation.desired_hash, {"node-2": False})]

    verdict = judge(observation, current, outcomes, {}, effective_hash="", in_effect_for=None)

    assert [r.scope for r in current.restarts] == ["node:node-2"]
    assert current.node_restarts() == ["node:node-2"]
    (pending,) = verdict.finding.pending
    assert pending.reason.startswith("no workload labelled iop.dev/edgeconfig=demo")
    assert pending.reason.endswith("restart node node-2 by hand")
    assert "RestartPending" in [e.reason for e in verdict.events]
    assert not verdict.finding.applied


def test_a_failed_replica_holds_the_change_back_and_retries() -> None:
    old, desired = config(), config(capacity(9))
    observation = observe(desired, record_of(old), replicas=(replica("a"), replica("b")))
    current = plan(observation)
    outcomes = [
        applied(replica("a"), observation.desired_hash),
        ReplicaOutcome(replica("b"), "Unreachable", "admin API at http://b:9090 unreachable"),
    ]

    verdict = judge(observation, current, outcomes, {}, effective_hash="old", in_effect_for=None)

    assert verdict.record is None  # not committed: the next diff is still against `old`
    assert verdict.finding.waiting[0] == "ApplyFailed"
    assert verdict.finding.degraded_reason == "ReplicaUnreachable"
    assert verdict.next == "retry"


def test_a_restart_a_replica_names_is_added_and_awaited() -> None:
    desired = config()
    observation = observe(desired, None, replicas=(replica("a"),))
    current = plan(observation)
    refused = ReplicaOutcome(replica("a"), "Failed", "it needs a restart", restart_scopes=("edge",))

    widened = with_restarts(current, ["edge"], observation.desired_hash)
    settled = settled_outcomes(widened, [refused], observation.replicas, [replica("a")])

    assert [r.scope for r in widened.restarts] == ["edge"]
    assert with_restarts(widened, ["edge"], observation.desired_hash) is widened
    assert settled[0].state == "AwaitingRestart"


def test_replicas_of_an_older_pod_template_are_not_asked() -> None:
    observation = observe(
        config(),
        None,
        edges=(edge("new"),),
        replicas=(replica("old", "old"), replica("new-0", "new"), replica("new-1", "new", False)),
    )
    current, ready = live_targets(observation)
    assert [r.name for r in current] == ["new-0", "new-1"]
    assert [r.name for r in ready] == ["new-0"]
    settled = settled_outcomes(plan(observation), [], observation.replicas, current)
    assert [(o.replica.name, o.state) for o in settled] == [("old", "Replaced")]


def test_a_stalled_rollout_is_stalled() -> None:
    old, desired = config(), config(listen("0.0.0.0:8081"))
    digest = config_hash(desired)
    stuck = RolloutState("Stalled", "progress deadline exceeded: ReplicaSet has timed out")
    observation = observe(
        desired, record_of(old, RestartRecord("edge", digest)), edges=(edge(digest, stuck),)
    )
    verdict = judge(observation, plan(observation), [], {}, effective_hash="", in_effect_for=None)
    assert verdict.finding.stalled is not None
    assert verdict.finding.stalled[0] == "ProgressDeadlineExceeded"
    assert verdict.next == "retry"


@pytest.mark.parametrize(
    ("elapsed", "reason", "ready", "next_pass"),
    [
        pytest.param(None, "WaitingForNodes", False, "motion", id="just-in-effect"),
        pytest.param(SERVING_WAIT_S - 1, "WaitingForNodes", False, "motion", id="still-waiting"),
        pytest.param(SERVING_WAIT_S + 1, "NodesMissing", True, "nodes", id="past-the-bound"),
    ],
)
def test_ready_waits_for_the_in_cluster_nodes(
    elapsed: float | None, reason: str, ready: bool, next_pass: str
) -> None:
    desired = config()
    digest = config_hash(desired)
    record = AppliedState(desired, digest, 2, {})
    nodes = {"node-1": (node_workload("node-1"),)}  # node-2 runs elsewhere: not waited for
    observation = observe(desired, record, nodes=nodes)
    outcomes = [applied(replica("edge-0"), digest, {"node-1": False}, apply=False)]

    verdict = judge(
        observation, plan(observation), outcomes, {}, effective_hash="", in_effect_for=elapsed
    )

    assert verdict.finding.applied
    assert verdict.finding.serving is not None and verdict.finding.serving[0] == reason
    assert "node node-1" in verdict.finding.serving[1]
    assert verdict.finding.ready is ready
    assert verdict.next == next_pass


def test_nodes_back_means_ready() -> None:
    desired = config()
    digest = config_hash(desired)
    observation = observe(
        desired, AppliedState(desired, digest, 2, {}), nodes={"node-1": (node_workload("node-1"),)}
    )
    outcomes = [applied(replica("edge-0"), digest, {"node-1": True, "node-2": True}, apply=False)]
    verdict = judge(
        observation, plan(observation), outcomes, {}, effective_hash="", in_effect_for=0.5
    )
    assert verdict.finding.serving is None and verdict.finding.ready


def test_a_replica_that_rolled_the_config_back_stalls_the_edgeconfig() -> None:
    """docs/rollout.md: the Edge judged the change by what it served and put its last good config
    back; it refuses the config again, and the EdgeConfig says why, Stalled, until a new spec."""
    old, desired = config(), config(capacity(9))
    observation = observe(desired, record_of(old), replicas=(replica("a"), replica("b")))
    reason = (
        "it rolled this config back and keeps its last good one: refused: this config was rolled "
        "back as revision 2 (40.0% of requests failed or needed a retry)"
    )
    outcomes = [
        applied(replica("a"), observation.desired_hash),
        ReplicaOutcome(replica("b"), "Failed", reason, rolled_back=True),
    ]

    verdict = judge(
        observation, plan(observation), outcomes, {}, effective_hash="old", in_effect_for=None
    )

    assert verdict.finding.stalled is not None
    assert verdict.finding.stalled[0] == "RolledBack"
    assert "replica b: it rolled this config back" in verdict.finding.stalled[1]
    assert verdict.finding.degraded_reason == "RolledBack"
    assert not verdict.finding.ready
    # The RolledBack Event comes from the revision's transition (revisions.py), once.
    assert "Degraded" in [e.reason for e in verdict.events]


def test_the_configmap_holds_the_stable_revision_unless_the_edge_rolls_to_the_new_one() -> None:
    old, desired = config(), config(capacity(9))
    record = record_of(old).with_stable()
    observation = observe(desired, record)
    assert pods_config(observation, plan(observation), held=False)[1] == config_hash(old)
    assert pods_config(observation, plan(observation), held=True)[1] == config_hash(old)
    # Nothing came through yet (the first config): the desired one.
    fresh = observe(desired, record_of(old))
    assert pods_config(fresh, plan(fresh), held=False)[1] == config_hash(desired)
    # The Edge rolls to take it: its new pods must start on it, unless it was rolled back.
    moved = config(listen("0.0.0.0:8181"))
    rolling = observe(moved, record, edges=(edge(""),))
    assert pods_config(rolling, plan(rolling), held=False)[1] == config_hash(moved)
    assert pods_config(rolling, plan(rolling), held=True)[1] == config_hash(old)


def test_a_stalled_restart_fails_its_gate_and_goes_back_to_the_stable_stamps() -> None:
    old, moved = config(), config(listen("0.0.0.0:8181"))
    digest = config_hash(moved)
    stable_stamp = "ab" * 32
    record = AppliedState(old, config_hash(old), 1, {"Deployment/demo-edge": stable_stamp})
    record = record.with_stable()
    stalled = RolloutState("Stalled", "progress deadline exceeded: timed out progressing")
    committed = AppliedState(
        moved, digest, 2, {"Deployment/demo-edge": digest}, (RestartRecord("edge", digest),)
    )
    committed = replace(committed, stable=record.stable)

    rolling = observe(moved, committed, edges=(edge(digest, ROLLING),))
    assert failed_restarts(rolling, plan(rolling)) == []
    observation = observe(moved, committed, edges=(edge(digest, stalled),))
    failed = failed_restarts(observation, plan(observation))
    assert [str(f) for f in failed] == [
        "Deployment/demo-edge (edge): progress deadline exceeded: timed out progressing"
    ]
    assert record.stable is not None
    assert [(w.name, s) for w, s in stamps_back(observation, record.stable)] == [
        ("demo-edge", stable_stamp)
    ]
    # A node never stamped before goes back to no stamp at all.
    nodes = {"node-1": (node_workload("node-1", digest, stalled),)}
    with_node = observe(moved, committed, nodes=nodes)
    assert [(w.name, s) for w, s in stamps_back(with_node, record.stable)] == [("demo-node-1", "")]


def test_a_return_to_the_stable_revision_rolls_no_workload_still_on_its_template() -> None:
    old, moved = config(), config(listen("0.0.0.0:8181"))
    stable_stamp = "ab" * 32
    stable = AppliedState(old, config_hash(old), 1, {"Deployment/demo-edge": stable_stamp})
    # The moved config was rolled back: its record holds it, the workload the stable stamp.
    record = AppliedState(moved, config_hash(moved), 2, {"Deployment/demo-edge": stable_stamp})
    record = replace(record, stable=stable.with_stable().stable)
    observation = observe(old, record, edges=(edge(stable_stamp),))
    current = plan(observation)
    assert [r.scope for r in current.restarts] == ["edge"]
    assert stamps_due(observation, current) == []
    elsewhere = observe(old, record, edges=(edge("cd" * 32),))
    assert len(stamps_due(elsewhere, plan(elsewhere))) == 1


def test_a_config_is_stable_once_its_revision_is_good_and_its_restarts_are_done() -> None:
    old = config()
    record = record_of(old)
    through = came_through(record, "Promoted")
    assert through is not None and through.stable is not None
    assert through.stable.config_hash == config_hash(old)
    assert came_through(through, "Promoted") is None  # already
    assert came_through(record, "Canary") is None
    assert came_through(record, "RolledBack") is None
    assert came_through(record, None) is None
    assert came_through(record_of(old, RestartRecord("edge", config_hash(old))), "Applied") is None


def seen(instance: str, healthy: set[str], unhealthy: dict[str, str]) -> ReplicaOutcome:
    """A replica that sees node-1 served by process `instance`, its providers so."""
    view = NodeState(
        "node-1",
        True,
        True,
        instance_id=instance,
        healthy=frozenset(healthy),
        unhealthy=tuple((p, reason, "") for p, reason in unhealthy.items()),
    )
    return ReplicaOutcome(replica("edge-0"), "Applied", status=ReplicaStatus("h", 2, (view,)))


def test_a_node_restart_fails_its_gate_when_the_new_process_serves_worse_than_the_old() -> None:
    old, desired = (
        config(),
        config(lambda d: d["nodes"][0]["providers"][0]["adapter"].update(completion_tokens=3)),
    )
    digest = config_hash(desired)
    record = AppliedState(desired, digest, 2, {}, (RestartRecord("node:node-1", digest),))
    nodes = {"node-1": (node_workload("node-1", digest, ROLLING),)}
    observation = observe(desired, replace(record, stable=record_of(old).with_stable().stable))
    observation = replace(observation, nodes=nodes)
    current = plan(observation)
    # Before the restart: pa healthy, pb's server already down.
    baseline = node_baseline([seen("old", {"pa"}, {"pb": "probe_failed"})], "node-1", digest)
    assert baseline is not None
    assert baseline.instances == {"old"} and baseline.healthy == {"pa"}
    gate = {"node:node-1": baseline}

    # The old process still serves, or the new one has not probed yet (or connected and not
    # ready yet: the Edge says node_disconnected until it has taken its config; or said nothing
    # of pa yet; or it is being stopped), or only pb is down: pass.
    for outcome in (
        seen("old", set(), {"pa": "probe_failed"}),  # (the old process: not the change's doing)
        seen("new", set(), {"pa": "not_probed", "pb": "not_probed"}),
        seen("new", set(), {"pa": "node_disconnected", "pb": "node_disconnected"}),
        seen("new", set(), {"pa": "not_reported"}),
        seen("new", set(), {"pa": "draining"}),
        seen("new", {"pa"}, {"pb": "probe_failed"}),
    ):
        assert worse_restarts(observation, current, [outcome], gate) == []
    # The new process's pa fails where the old one's passed: the gate fails.
    (failed,) = worse_restarts(
        observation, current, [seen("new", set(), {"pa": "probe_failed", "pb": "x"})], gate
    )
    assert str(failed) == (
        "Deployment/demo-node-1 (node:node-1): its new process serves worse than the old one: "
        "provider pa probe_failed (healthy before)"
    )
    # Its adapter cannot run there, or its requests failed: the gate fails too.
    for reason in ("adapter_error", "request_failures", "unspecified"):
        (failed,) = worse_restarts(observation, current, [seen("new", set(), {"pa": reason})], gate)
        assert f"provider pa {reason} (healthy before)" in failed.message
    # A baseline of another config, or none: nothing to compare.
    worse = [seen("new", set(), {"pa": "probe_failed"})]
    assert worse_restarts(observation, current, worse, {}) == []
    other = {"node:node-1": replace(baseline, config_hash=config_hash(old))}
    assert worse_restarts(observation, current, worse, other) == []


def serving(name: str, stamp: str, requests: int, failed: int = 0, since: float = 0.0) -> Any:
    """A replica of the Edge workload (created from the template stamped `stamp`) that has
    served `requests` so far, `failed` of them failed, since `since` (Unix seconds)."""
    status = ReplicaStatus(stamp, 2, (), served=Served(since, Figures(requests, failed)))
    return ReplicaOutcome(replica(name, stamp), "Applied", status=status)


def test_an_edge_restart_fails_its_gate_when_its_new_pod_serves_worse_than_the_old_ones() -> None:
    old, desired = config(), config(listen("0.0.0.0:8181"))
    digest, before = config_hash(desired), config_hash(old)
    record = AppliedState(desired, digest, 2, {}, (RestartRecord("edge", digest),))
    observation = observe(desired, record, edges=(edge(digest, ROLLING),))
    current = plan(observation)
    # Stamped when the two old pods had served 100 and 300 requests, 1 failed.
    baseline = edge_baseline(
        [serving("old-0", before, 100), serving("old-1", before, 300, 1)], digest
    )
    assert baseline is not None and set(baseline.replicas) == {"old-0", "old-1"}

    def verdict(new: Any, *, gate: Any = baseline, now: float = 30.0) -> list[str]:
        outcomes = [serving("old-0", before, 150), serving("old-1", before, 350, 2), new]
        return [str(f) for f in worse_edge(observation, current, outcomes, gate, now)]

    # The old pods: 100 requests since, 1 failed. The new pod: 40 with 10 failed: rolled back.
    (failed,) = verdict(serving("new-0", digest, 40, 10, since=10.0))
    assert failed.startswith(
        "Deployment/demo-edge (edge): its new pods serve worse than the old ones since the "
        "restart (errors): 25.0% of requests failed or needed a retry (10 failed, 0 retried of "
        "40); the last good revision had 1.0%"
    )
    # As well as the old ones, or too few requests yet to say: the restart goes on.
    assert verdict(serving("new-0", digest, 40, 2, since=10.0)) == []
    assert verdict(serving("new-0", digest, 19, 19, since=10.0)) == []
    # No baseline (an Edge that does not count), one of another config, or `rollout.mode: off`.
    assert verdict(serving("new-0", digest, 40, 10), gate=None) == []
    assert (
        verdict(serving("new-0", digest, 40, 10), gate=replace(baseline, config_hash=before)) == []
    )
    off = config(lambda d: (listen("0.0.0.0:8181")(d), d.update(rollout={"mode": "off"})))
    off_hash = config_hash(off)
    off_record = AppliedState(off, off_hash, 2, {}, (RestartRecord("edge", off_hash),))
    quiet = observe(off, off_record, edges=(edge(off_hash, ROLLING),))
    outcomes = [serving("old-0", before, 150), serving("new-0", off_hash, 40, 10)]
    off_gate = replace(baseline, config_hash=off_hash)
    assert worse_edge(quiet, plan(quiet), outcomes, off_gate, 30.0) == []
    watched = replace(quiet, desired=config(listen("0.0.0.0:8181")))
    assert len(worse_edge(watched, plan(quiet), outcomes, off_gate, 30.0)) == 1  # (the same, on)
    # A pod of the old template that started after the stamp is neither side.
    assert verdict(serving("old-2", before, 40, 40)) == []
