"""Status per the Kubernetes conventions: five conditions, transitions, bounded lists."""

from __future__ import annotations

from iop.edgeconfig import Problem
from iop.operator.liveapplying import NodeResult
from iop.operator.reporting import (
    MAX_ITEMS,
    Finding,
    PendingRestart,
    RolloutRecord,
    build_conditions,
    build_status,
)

H = "a" * 64


def kinds(conditions) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conditions}


def test_applied_means_ready() -> None:
    finding = Finding(3, desired_hash=H, applied_hash=H, applied=True)
    conditions = build_conditions(finding, [], "T1")
    assert kinds(conditions) == {
        "Valid": ("True", "Valid"),
        "Applied": ("True", "Applied"),
        "Progressing": ("False", "Idle"),
        "Degraded": ("False", "AsExpected"),
        "Ready": ("True", "Ready"),
    }
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == "T1" for c in conditions)


def test_a_transition_time_moves_only_with_the_status() -> None:
    applied = build_conditions(Finding(1, desired_hash=H, applied=True), [], "T1")
    again = build_conditions(Finding(2, desired_hash=H, applied=True), applied, "T2")
    assert {c["lastTransitionTime"] for c in again} == {"T1"}
    failing = Finding(3, desired_hash=H, degraded=["replica a unreachable: refused"])
    failing.degraded_reason = "ReplicaUnreachable"
    later = {c["type"]: c for c in build_conditions(failing, again, "T3")}
    assert later["Degraded"]["lastTransitionTime"] == "T3"
    assert later["Valid"]["lastTransitionTime"] == "T1"
    assert (later["Ready"]["status"], later["Ready"]["reason"]) == ("False", "ReplicaUnreachable")
    assert later["Ready"]["message"] == "replica a unreachable: refused"


def test_an_invalid_spec_changes_only_valid_and_ready() -> None:
    applied = build_conditions(Finding(1, desired_hash=H, applied=True), [], "T1")
    problems = [Problem("nodes[0].providers[0].capacity", "must be >= 1, got 0")]
    invalid = {
        c["type"]: c
        for c in build_conditions(Finding(2, valid=False, problems=problems), applied, "T2")
    }
    assert (invalid["Valid"]["status"], invalid["Valid"]["reason"]) == ("False", "InvalidSpec")
    assert "nodes[0].providers[0].capacity: must be >= 1, got 0" in invalid["Valid"]["message"]
    assert invalid["Applied"]["status"] == "True"
    assert invalid["Applied"]["observedGeneration"] == 1  # it still describes generation 1
    assert invalid["Ready"]["status"] == "False"


def test_a_rollout_is_progressing() -> None:
    finding = Finding(
        2,
        desired_hash=H,
        progressing=True,
        waiting=("RestartPending", "waiting for the restart of edge"),
        rollouts=[
            RolloutRecord(
                "edge", "Deployment/demo-edge", H, "Progressing", "1 of 2 new replicas updated"
            )
        ],
        pending=[PendingRestart("edge", "rolling out")],
    )
    conditions = kinds(build_conditions(finding, [], "T"))
    assert conditions["Progressing"] == ("True", "RollingOut")
    assert conditions["Applied"] == ("False", "RestartPending")
    assert conditions["Ready"] == ("False", "RollingOut")
    status = build_status(finding, {}, None, "T")
    assert status["pendingRestart"] == "edge"


def test_lists_are_bounded_and_failures_shown_first() -> None:
    nodes = [NodeResult(f"n{i:04d}", "Acked") for i in range(500)]
    nodes.append(NodeResult("zz-bad", "Failed", "refused"))
    finding = Finding(1, desired_hash=H, applied=True, nodes=nodes, node_total=501)
    status = build_status(finding, {}, None, "T")
    assert len(status["nodes"]) == MAX_ITEMS
    assert {"nodeId": "zz-bad", "state": "Failed", "reason": "refused"} in status["nodes"]
    assert status["omittedNodes"] == 501 - MAX_ITEMS
    assert status["nodesAcked"] == "500/501"
