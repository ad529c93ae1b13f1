"""Proof that e2e/cluster is a real control plane: what the operator relies on works here.

Structural schemas, CEL rules, printer columns and the status subresource (the EdgeConfig CRD),
Deployments that get ReplicaSets and Running Pods and roll out on a template change (the rolls the
operator triggers), and helm install/uninstall (how users install the product).
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    # Only for annotations: e2e/ is not a package, and conftest.py is pytest's to import.
    from e2e.conftest import KubeCluster

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parent / "testdata" / "smoke-chart"
KWOK_NODE = "kwok-node-0"
POD_NETWORK = ipaddress.ip_network("10.244.0.0/16")
CEL_MESSAGE = "replicas must not exceed maxReplicas"
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}


def widget_crd(group: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {
                            "name": "Owner",
                            "type": "string",
                            "jsonPath": ".spec.owner",
                            "priority": 1,
                        },
                        {
                            "name": "Ceiling",
                            "type": "integer",
                            "jsonPath": ".spec.maxReplicas",
                            "priority": 1,
                        },
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["replicas", "maxReplicas"],
                                    "properties": {
                                        "replicas": {"type": "integer", "minimum": 0},
                                        "maxReplicas": {"type": "integer"},
                                        "owner": {"type": "string"},
                                    },
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.replicas <= self.maxReplicas",
                                            "message": CEL_MESSAGE,
                                        }
                                    ],
                                },
                                "status": {
                                    "type": "object",
                                    "properties": {"phase": {"type": "string"}},
                                },
                            },
                        }
                    },
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def widgets(kube_cluster: KubeCluster) -> Iterator[str]:
    """A Widget CRD with a unique group (CRDs are cluster-wide); yields `widgets.<group>`."""
    group = f"e2e-{secrets.token_hex(3)}.iop-edge.test"
    crd = widget_crd(group)
    name = crd["metadata"]["name"]
    kube_cluster.apply(crd)
    try:
        kube_cluster.wait_condition(f"crd/{name}", "Established")
        yield name
    finally:
        kube_cluster.kubectl("delete", "crd", name, "--ignore-not-found", "--wait=false")


def widget(group_resource: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    group = group_resource.split(".", 1)[1]
    return {
        "apiVersion": f"{group}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": spec,
    }


def header(table: str) -> list[str]:
    return table.splitlines()[0].split()


def test_crd_printer_columns_follow_priority(
    kube_cluster: KubeCluster, widgets: str, namespace: str
) -> None:
    spec = {"replicas": 1, "maxReplicas": 3, "owner": "alice"}
    kube_cluster.apply(widget(widgets, "first", spec), "-n", namespace)

    plain = kube_cluster.kubectl("get", widgets, "-n", namespace).stdout
    wide = kube_cluster.kubectl("get", widgets, "-n", namespace, "-o", "wide").stdout

    assert header(plain) == ["NAME", "REPLICAS", "PHASE"]
    assert header(wide) == ["NAME", "REPLICAS", "PHASE", "OWNER", "CEILING"]
    assert wide.splitlines()[1].split()[-2:] == ["alice", "3"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param({"replicas": 5, "maxReplicas": 3}, CEL_MESSAGE, id="cel-rule"),
        pytest.param(
            {"replicas": -1, "maxReplicas": 3},
            "should be greater than or equal to 0",
            id="openapi-minimum",
        ),
        pytest.param({"replicas": 1}, "spec.maxReplicas: Required value", id="required-field"),
        pytest.param(
            {"replicas": "two", "maxReplicas": 3},
            'spec.replicas: Invalid value: "string"',
            id="structural-type",
        ),
    ],
)
def test_invalid_widgets_are_rejected_by_the_api_server(
    kube_cluster: KubeCluster, widgets: str, namespace: str, spec: dict[str, Any], message: str
) -> None:
    result = kube_cluster.kubectl(
        "create", "-n", namespace, "-f", "-",
        stdin=json.dumps(widget(widgets, "bad", spec)), check=False,
    )  # fmt: skip

    assert result.returncode != 0
    assert message in result.stderr
    missing = kube_cluster.kubectl("get", widgets, "bad", "-n", namespace, check=False)
    assert "NotFound" in missing.stderr


def test_status_is_written_only_through_the_status_subresource(
    kube_cluster: KubeCluster, widgets: str, namespace: str
) -> None:
    kube_cluster.apply(widget(widgets, "w", {"replicas": 1, "maxReplicas": 3}), "-n", namespace)

    kube_cluster.kubectl(
        "patch", widgets, "w", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"phase": "Ready"}}),
    )  # fmt: skip
    kube_cluster.kubectl(
        "patch", widgets, "w", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"replicas": 2}, "status": {"phase": "Hijacked"}}),
    )  # fmt: skip

    obj = kube_cluster.get(widgets, "w", "-n", namespace)
    assert obj["spec"]["replicas"] == 2
    assert obj["status"] == {"phase": "Ready"}
    table = kube_cluster.kubectl("get", widgets, "w", "-n", namespace).stdout
    assert table.splitlines()[1].split()[:3] == ["w", "2", "Ready"]


def deployment(name: str, replicas: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                # kwok's Node (tainted: only pods that ask go there) runs no containers: the
                # image is never pulled.
                "spec": {
                    "nodeSelector": {"type": "kwok"},
                    "tolerations": [KWOK_TOLERATION],
                    "containers": [{"name": "app", "image": "example.invalid/app:1"}],
                },
            },
        },
    }


def revision(replica_set: dict[str, Any]) -> int:
    return int(replica_set["metadata"]["annotations"]["deployment.kubernetes.io/revision"])


def replica_sets(kube_cluster: KubeCluster, namespace: str, app: str) -> list[dict[str, Any]]:
    """The Deployment's ReplicaSets, oldest revision first."""
    listed = kube_cluster.get("rs", "-n", namespace, "-l", f"app={app}")
    return sorted(listed["items"], key=revision)


def live_pods(kube_cluster: KubeCluster, namespace: str, app: str) -> list[dict[str, Any]]:
    pods = kube_cluster.get("pods", "-n", namespace, "-l", f"app={app}")["items"]
    return [pod for pod in pods if "deletionTimestamp" not in pod["metadata"]]


def test_deployment_rolls_out_on_the_kwok_node(kube_cluster: KubeCluster, namespace: str) -> None:
    kube_cluster.apply(deployment("web", replicas=2), "-n", namespace)
    kube_cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace, "--timeout=60s")

    (first,) = replica_sets(kube_cluster, namespace, "web")
    assert first["status"].get("readyReplicas") == 2
    pods = live_pods(kube_cluster, namespace, "web")
    assert len(pods) == 2
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"] == KWOK_NODE
        assert ipaddress.ip_address(pod["status"]["podIP"]) in POD_NETWORK

    # What the operator does to roll a workload: stamp the pod template.
    stamp = {"spec": {"template": {"metadata": {"annotations": {"iop-edge.test/rev": "2"}}}}}
    kube_cluster.kubectl(
        "patch", "deployment", "web", "-n", namespace, "--type=merge", "-p", json.dumps(stamp)
    )
    kube_cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace, "--timeout=60s")

    old, new = replica_sets(kube_cluster, namespace, "web")
    assert old["metadata"]["name"] == first["metadata"]["name"]
    assert old["spec"]["replicas"] == 0
    assert new["status"].get("readyReplicas") == 2
    assert new["spec"]["template"]["metadata"]["annotations"] == {"iop-edge.test/rev": "2"}
    new_hash = new["metadata"]["labels"]["pod-template-hash"]
    pods = live_pods(kube_cluster, namespace, "web")
    assert {pod["metadata"]["labels"]["pod-template-hash"] for pod in pods} == {new_hash}


def test_helm_installs_and_uninstalls_a_chart(kube_cluster: KubeCluster, namespace: str) -> None:
    kube_cluster.helm(
        "install", "smoke", str(CHART), "-n", namespace,
        "--set", "message=from-e2e", "--set", "replicas=2", "--wait", "--timeout=60s",
    )  # fmt: skip

    (release,) = json.loads(kube_cluster.helm("list", "-n", namespace, "-o", "json").stdout)
    assert (release["name"], release["status"], release["chart"]) == (
        "smoke",
        "deployed",
        "smoke-0.1.0",
    )
    config = kube_cluster.get("configmap", "smoke-config", "-n", namespace)
    assert config["data"] == {"message": "from-e2e"}
    web = kube_cluster.get("deployment", "smoke", "-n", namespace)
    assert web["status"].get("readyReplicas") == 2

    kube_cluster.helm("uninstall", "smoke", "-n", namespace, "--wait", "--timeout=60s")

    assert json.loads(kube_cluster.helm("list", "-n", namespace, "-o", "json").stdout) == []
    selector = "app.kubernetes.io/instance=smoke"
    gone = kube_cluster.kubectl(
        "get", "all,configmap", "-n", namespace, "-l", selector, "-o", "name"
    )
    assert gone.stdout.strip() == ""
