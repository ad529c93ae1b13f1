"""The CRD on the real API server: `kubectl explain` tells live or restart, the API server itself
refuses what the schema and the cheap CEL rules can see, and the printer columns are there."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.waiting import wait_for

pytestmark = pytest.mark.e2e


def explain(kube_cluster, field: str) -> str:
    """`kubectl explain` of `field`, its lines joined (kubectl wraps long descriptions). The API
    server publishes a new CRD's OpenAPI schema a moment after it serves the resource."""

    def explained() -> Any:
        result = kube_cluster.kubectl("explain", field, check=False)
        return result if result.returncode == 0 else None

    found = wait_for(explained, timeout=30, what=f"kubectl explain {field}")
    return " ".join(found.stdout.split())


def test_explain_says_what_a_field_does_and_how_a_change_applies(kube_cluster, edgeconfig_crd):
    capacity = explain(kube_cluster, "edgeconfig.spec.nodes.providers.capacity")
    assert "Most requests this provider runs at once, across all Edges." in capacity
    assert "Live: a change applies without a restart." in capacity
    adapter = explain(kube_cluster, "ec.spec.nodes.providers.adapter.baseUrl")
    assert "Restart-required: a change rolls this node's workload." in adapter
    listen = explain(kube_cluster, "ec.spec.openai.listen")
    assert "Restart-required: a change rolls the Edge." in listen


def create(kube_cluster, namespace: str, spec: dict[str, Any]):
    manifest = {"apiVersion": "iop.dev/v1alpha1", "kind": "EdgeConfig",
                "metadata": {"name": "bad"}, "spec": spec}  # fmt: skip
    return kube_cluster.kubectl(
        "create", "-n", namespace, "-f", "-", stdin=json.dumps(manifest), check=False
    )


def with_provider(spec: dict[str, Any], **changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec["nodes"][0]["providers"][0].update(changes)
    return spec


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        pytest.param(
            lambda s: with_provider(s, capacity=0),
            "should be greater than or equal to 1",
            id="bound",
        ),
        pytest.param(
            lambda s: with_provider(s, longContextSlots=9),
            "longContextSlots must be <= capacity",
            id="cel-long-slots",
        ),
        pytest.param(
            lambda s: with_provider(s, adapter={"type": "openai"}),
            "baseUrl is required when type is openai",
            id="cel-base-url",
        ),
        pytest.param(
            lambda s: with_provider(s, adapter={"type": "grpc"}),
            'Unsupported value: "grpc"',
            id="enum",
        ),
        pytest.param(
            lambda s: {**s, "nodes": [s["nodes"][0], s["nodes"][0]]},
            "spec.nodes[1]: Duplicate value:",
            id="duplicate-node-id",
        ),
    ],
)
def test_the_api_server_refuses_what_the_schema_can_see(
    kube_cluster, namespace, edgeconfig_crd, host_spec, edit, says
) -> None:
    result = create(kube_cluster, namespace, edit(host_spec()))
    assert result.returncode != 0
    assert says in result.stderr


def test_printer_columns(kube_cluster, namespace, edgeconfig_crd, host_spec) -> None:
    assert create(kube_cluster, namespace, host_spec()).returncode == 0
    plain = kube_cluster.kubectl("get", "ec", "-n", namespace).stdout.splitlines()[0].split()
    wide = kube_cluster.kubectl("get", "iop", "-n", namespace, "-o", "wide").stdout
    assert plain == ["NAME", "READY", "VALID", "APPLIED", "RESTART", "NODES", "AGE"]
    assert wide.splitlines()[0].split() == [
        "NAME", "READY", "VALID", "APPLIED", "RESTART", "NODES", "AGE",
        "GENERATION", "OBSERVED", "CONFIG", "REVISION", "ROLLOUT", "MESSAGE",
    ]  # fmt: skip


def test_a_new_edgeconfig_reads_as_not_yet_observed(
    kube_cluster, namespace, edgeconfig_crd, host_spec
) -> None:
    """No operator runs here: the status the CRD defaults says generation 1 is not observed, so
    kstatus (Flux, Helm 4's --wait) reads InProgress rather than Current for want of a status."""
    assert create(kube_cluster, namespace, host_spec()).returncode == 0
    found = kube_cluster.get("ec", "-n", namespace)["items"][0]
    assert found["metadata"]["generation"] == 1
    assert found["status"] == {"observedGeneration": 0}
