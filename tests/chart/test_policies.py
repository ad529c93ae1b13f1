"""The chart's NetworkPolicies cover the pods they must, with the ports those pods declare.

The local cluster (e2e/cluster) runs no CNI that enforces NetworkPolicy, so no test here or in
e2e sees a connection refused by one: these tests check the rendered policies instead. Each
policy's podSelector must select exactly the pods of its component (compared with the rendered
Deployments' pod template labels), every port it opens must be a named port those pods'
containers declare (a number or a misspelt name would open nothing, or the wrong thing), and the
ports left out are the ones only the kubelet probes (its probes come from the pod's own node,
which the CNIs admit whatever the policy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

from tests.chart.conftest import REPO

if TYPE_CHECKING:
    from tests.chart.conftest import ChartTools

RUN_VALUES = REPO / "configs" / "helm-values.yaml"  # `make run`: three Nodes, the fake upstream

#: The resource-name prefix of the default values (release `iop`).
DEFAULTS = "iop-iop-edge"


def by_kind(documents: Sequence[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "the chart's selectors are matchLabels only"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_labels(deployment: Mapping[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def declared_ports(deployment: Mapping[str, Any]) -> set[str]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return {p["name"] for c in containers for p in c.get("ports", [])}


def covered(documents: Sequence[dict[str, Any]]) -> dict[str, set[str]]:
    """Policy name -> the Deployments whose pods it selects."""
    deployments = by_kind(documents, "Deployment")
    return {
        name: {
            d
            for d, body in deployments.items()
            if selects(policy["spec"]["podSelector"], pod_labels(body))
        }
        for name, policy in by_kind(documents, "NetworkPolicy").items()
    }


def opened(policy: Mapping[str, Any]) -> dict[str, Any]:
    """Port name -> its peers (None: any source) over the policy's ingress rules."""
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ports: dict[str, Any] = {}
    for rule in policy["spec"].get("ingress") or []:
        for port in rule["ports"]:
            assert isinstance(port["port"], str), f"{port}: a named port, never a number"
            assert port["protocol"] == "TCP"
            ports[port["port"]] = rule.get("from")
    return ports


def render(chart_tools: ChartTools, values: str) -> list[dict[str, Any]]:
    if values == "defaults":
        return chart_tools.documents()
    return chart_tools.documents("--values", str(RUN_VALUES))


VALUES = [pytest.param("defaults", id="defaults"), pytest.param("make-run", id="several-nodes")]


@pytest.mark.parametrize("values", VALUES)
def test_each_policy_selects_exactly_its_components_pods(
    chart_tools: ChartTools, values: str
) -> None:
    documents = render(chart_tools, values)
    deployments = set(by_kind(documents, "Deployment"))
    prefix = DEFAULTS if values == "defaults" else "iop"
    nodes = {d for d in deployments if d.startswith(f"{prefix}-node-")}
    assert len(nodes) == (1 if values == "defaults" else 3)
    assert covered(documents) == {
        f"{prefix}-edge": {f"{prefix}-edge"},
        f"{prefix}-operator": {f"{prefix}-operator"},
        f"{prefix}-node": nodes,
    }
    # Every workload of the product has its policy; the fake upstream is a demo's stand-in.
    assert deployments - {f"{prefix}-fake-upstream"} == {
        d for ds in covered(documents).values() for d in ds
    }


@pytest.mark.parametrize("values", VALUES)
def test_each_policy_opens_only_named_ports_its_pods_declare(
    chart_tools: ChartTools, values: str
) -> None:
    documents = render(chart_tools, values)
    deployments = by_kind(documents, "Deployment")
    policies = by_kind(documents, "NetworkPolicy")
    for name, selected in covered(documents).items():
        for deployment in selected:
            assert set(opened(policies[name])) <= declared_ports(deployments[deployment]), (
                f"{name} opens a port {deployment} does not declare"
            )
    prefix = DEFAULTS if values == "defaults" else "iop"
    everyone: list[dict[str, Any]] = [{"namespaceSelector": {}}]
    # The Edge: the metrics (they name every principal and token ref) from metricsFrom only,
    # the admin API from the operator's pods only.
    edge = opened(policies[f"{prefix}-edge"])
    assert edge["metrics"] == everyone
    (admin,) = edge["admin"]
    assert selects(admin["podSelector"], pod_labels(deployments[f"{prefix}-operator"]))
    assert not selects(admin["podSelector"], pod_labels(deployments[f"{prefix}-edge"]))
    assert (edge["http"], edge["hub"]) == (None, None)
    # The operator: the webhook (from any source: its callers' address is the platform's), the
    # metrics from metricsFrom; its liveness port is the kubelet's alone.
    operator = opened(policies[f"{prefix}-operator"])
    assert operator == {"webhook": None, "metrics": everyone}
    assert "health" in declared_ports(deployments[f"{prefix}-operator"])
    # A Node takes no connection at all: it dials the Edge; the kubelet probes its health port.
    node = policies[f"{prefix}-node"]
    assert node["spec"]["ingress"] == []
    assert opened(node) == {}


def test_the_peers_the_values_give_are_the_policies(chart_tools: ChartTools) -> None:
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}]
    control_plane = [{"ipBlock": {"cidr": "172.18.0.0/16"}}]
    documents = chart_tools.documents(
        values={
            "operator": {
                "networkPolicy": {"webhookFrom": control_plane, "metricsFrom": prometheus}
            },
            "edge": {"networkPolicy": {"metricsFrom": []}},
            "nodeDefaults": {"networkPolicy": {"healthFrom": prometheus}},
        }
    )
    policies = by_kind(documents, "NetworkPolicy")
    assert opened(policies["iop-iop-edge-operator"]) == {
        "webhook": control_plane,
        "metrics": prometheus,
    }
    assert "metrics" not in opened(policies["iop-iop-edge-edge"])  # empty: nobody
    assert opened(policies["iop-iop-edge-node"]) == {"health": prometheus}


@pytest.mark.parametrize(
    ("values", "gone"),
    [
        pytest.param({"edge": {"networkPolicy": {"enabled": False}}}, "edge", id="edge"),
        pytest.param(
            {"operator": {"networkPolicy": {"enabled": False}}}, "operator", id="operator"
        ),
        pytest.param({"nodeDefaults": {"networkPolicy": {"enabled": False}}}, "node", id="nodes"),
        pytest.param(
            {"operator": {"enabled": False}, "tls": {"enabled": False}},
            "operator",
            id="no-operator",
        ),
        pytest.param({"nodes": []}, "node", id="no-nodes"),
    ],
)
def test_each_policy_can_be_left_out(
    chart_tools: ChartTools, values: dict[str, Any], gone: str
) -> None:
    every = {"iop-iop-edge-edge", "iop-iop-edge-operator", "iop-iop-edge-node"}
    policies = set(by_kind(chart_tools.documents(values=values), "NetworkPolicy"))
    assert policies == every - {f"iop-iop-edge-{gone}"}


def test_an_operator_with_nothing_to_admit_admits_nothing(chart_tools: ChartTools) -> None:
    values = {"operator": {"webhook": {"enabled": False}, "networkPolicy": {"metricsFrom": []}}}
    policies = by_kind(chart_tools.documents(values=values), "NetworkPolicy")
    assert policies["iop-iop-edge-operator"]["spec"]["ingress"] == []
