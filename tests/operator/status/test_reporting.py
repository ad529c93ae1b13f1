"""Status per the Kubernetes conventions and kstatus: seven conditions, transitions, bounded
lists, and the model that both writes the status and makes its CRD schema."""

from __future__ import annotations

from typing import Any

from iop.edgeconfig import Problem
from iop.operator.crds import status_schema
from iop.operator.status.model import Condition, EdgeConfigStatus
from iop.operator.status.reporting import (
    MAX_ITEMS,
    build_conditions,
    build_status,
    reconciling_status,
)
from iop.operator.values import Finding, NodeResult, PendingRestart, RolloutRecord

H = "a" * 64


def kinds(conditions: list[Condition]) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in conditions}


def dumped(conditions: list[Condition]) -> list[dict[str, Any]]:
    return [c.model_dump(by_alias=True) for c in conditions]


def by_type(conditions: list[Condition]) -> dict[str, Condition]:
    return {c.type: c for c in conditions}


def test_applied_means_ready() -> None:
    finding = Finding(3, desired_hash=H, applied_hash=H, applied=True)
    conditions = build_conditions(finding, [], "T1")
    assert kinds(conditions) == {
        "Ready": ("True", "Ready"),
        "Reconciling": ("False", "Reconciled"),
        "Stalled": ("False", "NotStalled"),
        "Valid": ("True", "Valid"),
        "Applied": ("True", "Applied"),
        "Progressing": ("False", "Idle"),
        "Degraded": ("False", "AsExpected"),
    }
    assert all(c.observed_generation == 3 and c.last_transition_time == "T1" for c in conditions)


def test_a_new_generation_is_marked_reconciling_before_anything_is_decided() -> None:
    ready = dumped(build_conditions(Finding(3, desired_hash=H, applied=True), [], "T1"))
    previous = {"observedGeneration": 3, "conditions": ready}

    status = reconciling_status(previous, 4, "T2")

    assert status.observed_generation == 4
    marked = by_type(status.conditions)
    assert (marked["Ready"].status, marked["Ready"].observed_generation) == ("Unknown", 4)
    assert (marked["Reconciling"].status, marked["Reconciling"].reason) == ("True", "NewGeneration")
    assert marked["Stalled"].status == "False"
    # The product's own conditions still describe generation 3 until the pass decides.
    assert (marked["Applied"].status, marked["Applied"].observed_generation) == ("True", 3)


def test_a_transition_time_moves_only_with_the_status() -> None:
    applied = dumped(build_conditions(Finding(1, desired_hash=H, applied=True), [], "T1"))
    again = dumped(build_conditions(Finding(2, desired_hash=H, applied=True), applied, "T2"))
    assert {c["lastTransitionTime"] for c in again} == {"T1"}
    failing = Finding(3, desired_hash=H, degraded=["replica a unreachable: refused"])
    failing.degraded_reason = "ReplicaUnreachable"
    later = by_type(build_conditions(failing, again, "T3"))
    assert later["Degraded"].last_transition_time == "T3"
    assert later["Valid"].last_transition_time == "T1"
    assert (later["Ready"].status, later["Ready"].reason) == ("False", "ReplicaUnreachable")
    assert later["Ready"].message == "replica a unreachable: refused"
    # A failure the operator retries is still reconciling (kstatus: InProgress), not stalled.
    assert (later["Reconciling"].status, later["Stalled"].status) == ("True", "False")


def test_an_invalid_spec_is_stalled_and_changes_nothing_else() -> None:
    applied = dumped(build_conditions(Finding(1, desired_hash=H, applied=True), [], "T1"))
    problems = [Problem("nodes[0].providers[0].capacity", "must be >= 1, got 0")]
    invalid = by_type(build_conditions(Finding(2, valid=False, problems=problems), applied, "T2"))
    assert (invalid["Valid"].status, invalid["Valid"].reason) == ("False", "InvalidSpec")
    assert "nodes[0].providers[0].capacity: must be >= 1, got 0" in invalid["Valid"].message
    assert (invalid["Stalled"].status, invalid["Stalled"].reason) == ("True", "InvalidSpec")
    assert invalid["Reconciling"].status == "False"
    assert invalid["Applied"].status == "True"
    assert invalid["Applied"].observed_generation == 1  # it still describes generation 1
    assert invalid["Ready"].status == "False"


def test_a_rollout_past_its_deadline_is_stalled() -> None:
    finding = Finding(
        2,
        desired_hash=H,
        degraded=["rollout of Deployment/demo-edge stalled: progress deadline exceeded"],
        degraded_reason="RolloutStalled",
        stalled=("ProgressDeadlineExceeded", "Deployment/demo-edge: progress deadline exceeded"),
    )
    conditions = by_type(build_conditions(finding, [], "T"))
    assert (conditions["Stalled"].status, conditions["Stalled"].reason) == (
        "True",
        "ProgressDeadlineExceeded",
    )
    assert conditions["Reconciling"].status == "False"
    assert conditions["Ready"].status == "False"


def test_ready_waits_for_the_nodes_to_be_back() -> None:
    finding = Finding(2, desired_hash=H, applied=True)
    finding.serving = ("WaitingForNodes", "waiting for node node-1 to connect")
    conditions = by_type(build_conditions(finding, [], "T"))
    assert (conditions["Ready"].status, conditions["Ready"].reason) == ("False", "WaitingForNodes")
    assert (conditions["Reconciling"].status, conditions["Reconciling"].reason) == (
        "True",
        "WaitingForNodes",
    )
    assert conditions["Applied"].status == "True"
    finding.serving = ("NodesMissing", "node node-1 did not connect within 60s")
    late = by_type(build_conditions(finding, [], "T"))
    assert (late["Ready"].status, late["Ready"].message) == (
        "True",
        "node node-1 did not connect within 60s",
    )


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
    assert conditions["Reconciling"] == ("True", "RollingOut")
    status = build_status(finding, {}, None, "T")
    assert status.pending_restart == "edge"


def test_lists_are_bounded_and_failures_shown_first() -> None:
    nodes = [NodeResult(f"n{i:04d}", "Acked") for i in range(500)]
    nodes.append(NodeResult("zz-bad", "Failed", "refused"))
    finding = Finding(1, desired_hash=H, applied=True, nodes=nodes, node_total=501)
    status = build_status(finding, {}, None, "T").document()
    assert len(status["nodes"]) == MAX_ITEMS  # type: ignore[arg-type]
    assert {"nodeId": "zz-bad", "state": "Failed", "reason": "refused"} in status["nodes"]  # type: ignore[operator]
    assert status["omittedNodes"] == 501 - MAX_ITEMS
    assert status["nodesAcked"] == "500/501"


def _schema_keys(schema: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for name, child in (schema.get("properties") or {}).items():
        keys.add(f"{prefix}{name}")
        keys |= _schema_keys(child, f"{prefix}{name}.")
        keys |= _schema_keys(child.get("items") or {}, f"{prefix}{name}[].")
    return keys


def _document_keys(document: Any, prefix: str = "") -> set[str]:
    keys = set()
    if isinstance(document, dict):
        for name, value in document.items():
            keys.add(f"{prefix}{name}")
            keys |= _document_keys(value, f"{prefix}{name}.")
    elif isinstance(document, list):
        for item in document:
            keys |= _document_keys(item, prefix[:-1] + "[].")
    return keys


def test_every_field_the_writer_sets_is_in_the_crd_schema() -> None:
    """The API server silently drops status fields its schema lacks: the writer's model is the
    schema's source, so a full status has no key outside it."""
    finding = Finding(
        4,
        desired_hash=H,
        applied_hash=H,
        applied=True,
        problems=[Problem("a", "b")],
        nodes=[NodeResult("n1", "Acked", draining_runs=2)],
        node_total=1,
        rollouts=[RolloutRecord("edge", "Deployment/x", H, "Complete", "done")],
        pending=[PendingRestart("node:n1", "rolling out")],
    )
    from iop.edgeconfig import ChangeReport
    from iop.operator.status.reporting import change_summary

    status = build_status(finding, {}, change_summary(ChangeReport(), 4, H, H), "T").document()
    missing = _document_keys(status) - _schema_keys(status_schema())
    assert missing == set()
    assert EdgeConfigStatus.model_validate(status).observed_generation == 4
