"""Each node's result across every replica."""

from __future__ import annotations

from iop.operator.adminapi import _node_state
from iop.operator.status.reporting import _node
from iop.operator.values import (
    ApplyReport,
    EdgeReplica,
    NodePushResult,
    NodeState,
    ReplicaOutcome,
    ReplicaStatus,
    node_results,
)


def outcome(name: str, nodes: dict[str, tuple[bool, bool]], pushes=()) -> ReplicaOutcome:
    replica = EdgeReplica(name, name, f"http://{name}:9090", True, "")
    status = ReplicaStatus(
        "h", 2, tuple(NodeState(n, connected, current) for n, (connected, current) in nodes.items())
    )
    report = ApplyReport("h", 2, True, tuple(pushes), 1.0, "")
    return ReplicaOutcome(replica, "Applied", status=status, report=report)


def test_acked_only_when_current_on_every_replica() -> None:
    outcomes = [
        outcome("a", {"n1": (True, True), "n2": (True, True), "n3": (False, False)}),
        outcome("b", {"n1": (True, True), "n2": (True, False), "n3": (False, False)}),
    ]
    results = {r.node_id: (r.state, r.reason) for r in node_results(["n1", "n2", "n3"], outcomes)}
    assert results == {
        "n1": ("Acked", ""),
        "n2": ("Failed", "not running the current payload on b"),
        "n3": ("NotConnected", "connected to no Edge replica"),
    }


def test_a_failed_push_names_the_replica_and_the_reason() -> None:
    pushes = [NodePushResult("n1", "failed", "no acknowledgement within 10s")]
    outcomes = [outcome("a", {"n1": (True, False)}, pushes)]
    (result,) = node_results(["n1"], outcomes)
    assert (result.state, result.reason) == ("Failed", "a: no acknowledgement within 10s")


def test_a_node_being_restarted_is_restarting_not_failed() -> None:
    outcomes = [outcome("a", {"n1": (True, False)})]
    (result,) = node_results(["n1"], outcomes, restarting=["n1"])
    assert result.state == "Restarting"


def test_partly_connected() -> None:
    outcomes = [outcome("a", {"n1": (True, True)}), outcome("b", {"n1": (False, False)})]
    (result,) = node_results(["n1"], outcomes)
    assert (result.state, result.reason) == ("NotConnected", "not connected to b")


def test_a_draining_node_shows_the_runs_it_has_left() -> None:
    draining = NodeState("n1", True, True, draining_runs=3)
    replica = EdgeReplica("a", "a", "http://a:9090", True, "")
    report = ApplyReport("h", 2, True, (), 1.0, "")
    outcomes = [
        ReplicaOutcome(
            replica, "Applied", status=ReplicaStatus("h", 2, (draining,)), report=report
        ),
        outcome("b", {"n1": (True, True)}),
    ]
    (result,) = node_results(["n1"], outcomes)
    assert (result.state, result.draining_runs) == ("Acked", 3)
    shown = _node(result).model_dump(by_alias=True, exclude_none=True)
    assert shown == {"nodeId": "n1", "state": "Acked", "reason": "", "drainingRuns": 3}
    (idle,) = node_results(["n1"], [outcome("b", {"n1": (True, True)})])
    assert "drainingRuns" not in _node(idle).model_dump(by_alias=True, exclude_none=True)


def test_the_status_parser_sums_every_process_drain() -> None:
    node = {
        "node_id": "n1",
        "connected": True,
        "current": True,
        "draining": True,
        "draining_runs": {"pa": 2, "pb": 1},
    }
    assert _node_state(node).draining_runs == 3
    older_edge = {"node_id": "n1", "connected": True, "current": False}
    assert _node_state(older_edge) == NodeState("n1", True, False, 0)
