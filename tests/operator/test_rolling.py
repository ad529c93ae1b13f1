"""How far a rollout is, as `kubectl rollout status` judges it."""

from __future__ import annotations

from typing import Any

import pytest

from iop.operator.values import Workload, rollout_state


def deployment(
    *, generation: int = 2, observed: int = 2, wanted: int = 2, **status: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": "demo-edge", "generation": generation, "labels": {}},
        "spec": {
            "replicas": wanted,
            "template": {"metadata": {"annotations": {"iop.dev/config-hash": "abc"}}},
        },
        "status": {"observedGeneration": observed, **status},
    }


@pytest.mark.parametrize(
    ("body", "phase", "says"),
    [
        pytest.param(deployment(observed=1), "Progressing", "observed", id="not-observed"),
        pytest.param(
            deployment(updatedReplicas=1, replicas=2, availableReplicas=2),
            "Progressing",
            "1 of 2 new replicas updated",
            id="updating",
        ),
        pytest.param(
            deployment(updatedReplicas=2, replicas=3, availableReplicas=2),
            "Progressing",
            "1 old replicas pending termination",
            id="old-terminating",
        ),
        pytest.param(
            deployment(updatedReplicas=2, replicas=2, availableReplicas=1),
            "Progressing",
            "1 of 2 new replicas available",
            id="not-available",
        ),
        pytest.param(
            deployment(updatedReplicas=2, replicas=2, availableReplicas=2),
            "Complete",
            "2 of 2",
            id="complete",
        ),
        pytest.param(
            deployment(
                conditions=[
                    {"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "x"}
                ]
            ),
            "Stalled",
            "progress deadline exceeded",
            id="stalled",
        ),
    ],
)
def test_rollout_state(body: dict[str, Any], phase: str, says: str) -> None:
    state = rollout_state(body)
    assert state.phase == phase
    assert says in state.message


def test_a_workload_knows_its_stamp_and_node() -> None:
    body = deployment(updatedReplicas=2, replicas=2, availableReplicas=2)
    body["metadata"]["labels"] = {"iop.dev/node-id": "node-2"}
    workload = Workload.of(body)
    assert (workload.key, workload.stamp, workload.node_id) == (
        "Deployment/demo-edge",
        "abc",
        "node-2",
    )
