"""The chart keeps the operator's contract (docs/operator.md, "The contract with the Helm chart").

The names come from `iop.operator.conventions` and the RBAC rules from the table in
docs/operator.md, so the chart, the operator and its documentation cannot drift apart unseen.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from iop.operator import conventions
from tests.chart.conftest import RenderFailed

if TYPE_CHECKING:
    from tests.chart.conftest import ChartTools

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "iop-edge"
RUN_VALUES = REPO / "configs" / "helm-values.yaml"
NAME = "edge"  # edgeConfig.name in configs/helm-values.yaml


def by_kind(documents: Sequence[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def test_the_chart_ships_the_generated_crd_unchanged() -> None:
    chart_crd = (CHART / "crds" / "edgeconfigs.iop.dev.yaml").read_bytes()
    assert chart_crd == (REPO / "deploy" / "crds" / "edgeconfigs.iop.dev.yaml").read_bytes(), (
        "copy deploy/crds/edgeconfigs.iop.dev.yaml into deploy/helm/iop-edge/crds/"
    )
    assert list((CHART / "crds").iterdir()) == [CHART / "crds" / "edgeconfigs.iop.dev.yaml"]


def rbac_table() -> set[tuple[str, str, tuple[str, ...], bool]]:
    """(apiGroup, resource, verbs, by name) rows of docs/operator.md's RBAC table."""
    text = (REPO / "docs" / "operator.md").read_text()
    section = text[text.index("**RBAC.**") :]
    rows: set[tuple[str, str, tuple[str, ...], bool]] = set()
    for line in section.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        group = cells[0].strip("`").strip('"')
        resource = re.match(r"`([^`]+)`", cells[1])
        assert resource is not None, line
        verbs = tuple(sorted(verb.strip() for verb in cells[2].split(",")))
        rows.add((group, resource.group(1), verbs, not cells[3].startswith("no")))
    return rows


def test_rbac_is_exactly_the_operators_table(chart_tools: ChartTools) -> None:
    documents = chart_tools.documents()
    granted: set[tuple[str, str, tuple[str, ...], bool]] = set()
    (role,) = by_kind(documents, "Role").values()
    (cluster_role,) = by_kind(documents, "ClusterRole").values()
    for rule in [*role["rules"], *cluster_role["rules"]]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                verbs = tuple(sorted(rule["verbs"]))
                granted.add((group, resource, verbs, "resourceNames" in rule))
    assert granted == rbac_table()
    # Nothing but create (which RBAC cannot limit by name) and what has no name in advance
    # (pods, Events, Deployments found by label) is granted without names.
    unnamed = {
        (resource, verb)
        for rule in role["rules"]
        if "resourceNames" not in rule
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert {verb for resource, verb in unnamed if resource in ("secrets", "configmaps")} == {
        "create"
    }
    named = {r["resources"][0]: r["resourceNames"] for r in role["rules"] if "resourceNames" in r}
    assert named["secrets"] == [
        "iop-iop-edge-edge-admin",
        "iop-iop-edge-operator-webhook-tls",
        "iop-iop-edge-hub-tls",
        "iop-iop-edge-api-keys",
        "iop-iop-edge-node-node-1",
    ]
    assert named["deployments"] == ["iop-iop-edge-edge", "iop-iop-edge-node-node-1"]
    assert named["configmaps"] == [
        "iop-iop-edge-edge",
        "iop-iop-edge-edge-applied",
        "iop-iop-edge-edge-revisions",
    ]
    assert named["edgeconfigs"] == named["edgeconfigs/status"] == ["iop-iop-edge"]
    assert named["leases"] == ["iop-iop-edge-operator"]
    assert named["services"] == ["iop-iop-edge-operator-webhook", "iop-iop-edge-hub"]
    # The cluster-scoped rule names this release's webhook configuration, and nothing else.
    (webhook,) = by_kind(documents, "ValidatingWebhookConfiguration")
    assert cluster_role["rules"] == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingwebhookconfigurations"],
            "resourceNames": [webhook],
            "verbs": ["get", "list", "watch", "patch"],
        }
    ]
    # Only the operator's ServiceAccount is bound; the Edge and Nodes get no API token at all.
    deployments = by_kind(documents, "Deployment")
    operator = deployments["iop-iop-edge-operator"]["spec"]["template"]["spec"]
    for binding_kind in ("RoleBinding", "ClusterRoleBinding"):
        for binding in by_kind(documents, binding_kind).values():
            assert binding["subjects"] == [
                {
                    "kind": "ServiceAccount",
                    "name": operator["serviceAccountName"],
                    "namespace": "iop-system",
                }
            ]
    for name, deployment in deployments.items():
        if name != "iop-iop-edge-operator":
            assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_workloads_carry_the_labels_and_mounts_the_operator_looks_for(
    chart_tools: ChartTools,
) -> None:
    documents = chart_tools.documents("--values", str(RUN_VALUES))
    deployments = by_kind(documents, "Deployment")
    (edgeconfig,) = by_kind(documents, "EdgeConfig")
    assert edgeconfig == NAME

    edge = deployments["iop-edge"]
    edge_labels = dict(pair.split("=") for pair in conventions.edge_selector(NAME).split(","))
    for labels in (edge["metadata"]["labels"], edge["spec"]["template"]["metadata"]["labels"]):
        assert edge_labels.items() <= labels.items()
    assert edge_labels.items() <= edge["spec"]["selector"]["matchLabels"].items()
    pod = edge["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].startswith("ghcr.io/iop-edge/iop-edge:")
    assert container["args"][:3] == ["edge", "run", "--config=/etc/iop/edge.yaml"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/iop")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    sources = volume["projected"]["sources"]
    assert sources[0]["configMap"]["name"] == conventions.edge_configmap_name(NAME)
    assert sources[0]["configMap"]["items"] == [
        {"key": conventions.CONFIG_KEY, "path": "edge.yaml"}
    ]
    assert "optional" not in sources[0]["configMap"]  # pods wait for the operator's first pass
    assert sources[1]["secret"]["name"] == conventions.admin_secret_name(NAME)
    assert sources[1]["secret"]["items"] == [
        {"key": conventions.ADMIN_TOKEN_KEY, "path": "admin/token"}
    ]
    assert "optional" not in sources[1]["secret"]  # the operator creates it on its first pass
    # The stamp is the operator's: the chart never writes it, so helm upgrade keeps it.
    annotations = edge["spec"]["template"]["metadata"].get("annotations", {})
    assert conventions.CONFIG_HASH_ANNOTATION not in annotations

    for node_id in ("node-1", "node-2", "node-3"):
        node = deployments[f"iop-node-{node_id}"]
        selector = dict(
            pair.split("=") for pair in conventions.node_selector(NAME, node_id).split(",")
        )
        assert selector.items() <= node["spec"]["template"]["metadata"]["labels"].items()
        assert selector.items() <= node["metadata"]["labels"].items()
        assert node["spec"]["replicas"] == 1
        # Surge, so a node's rollout loses no request (the newest instance of a node id wins).
        assert node["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
        assert node["spec"]["minReadySeconds"] == 5
        (agent,) = node["spec"]["template"]["spec"]["containers"]
        assert agent["args"][:5] == [
            "node",
            "run",
            "--edge-service=iop-hub:7443",
            f"--node-id={node_id}",
            "--token-file=/etc/iop/node/token",
        ]
    policy, key = deployments["iop-node-node-1"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert key == {
        "name": "VLLM_A_KEY",
        "valueFrom": {"secretKeyRef": {"name": "iop-provider-keys", "key": "vllm-a"}},
    }
    # The upstream policy (docs/operator.md, "Who may do what"): each workload gets its own keys'
    # bindings, the operator all of them; the fake upstream is allowed while it runs.
    bound = [{"env": "VLLM_A_KEY", "hosts": ["iop-fake-upstream:8000"], "providers": ["vllm-a"]}]
    policies = {
        name: next(
            json.loads(entry["value"])
            for entry in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            if entry["name"] == "IOP_UPSTREAM_POLICY"
        )
        for name, deployment in deployments.items()
        if name in ("iop-node-node-1", "iop-node-node-2", "iop-edge", "iop-operator")
    }
    assert policy["name"] == "IOP_UPSTREAM_POLICY"
    assert {name: p["keys"] for name, p in policies.items()} == {
        "iop-node-node-1": bound,
        "iop-node-node-2": [],
        "iop-edge": [],
        "iop-operator": bound,
    }
    for found in policies.values():
        assert "iop-fake-upstream:8000" in found["allow"]
        assert "iop-fake-upstream.iop-system.svc.cluster.local:8000" in found["allow"]
        assert found["deny"] == []
    hub = by_kind(documents, "Service")["iop-hub"]
    assert hub["spec"]["clusterIP"] == "None"


def test_the_operator_and_its_webhook_are_wired_as_the_contract_says(
    chart_tools: ChartTools,
) -> None:
    documents = chart_tools.documents()
    operator = by_kind(documents, "Deployment")["iop-iop-edge-operator"]
    assert operator["spec"]["replicas"] == 2
    assert operator["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    (container,) = operator["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert {
        "--edgeconfig=iop-iop-edge",
        "--leader-election=iop-iop-edge-operator",
        "--webhook-secret=iop-iop-edge-operator-webhook-tls",
        "--metrics-listen=0.0.0.0:8081",
    } <= set(args)
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    metrics = by_kind(documents, "Service")["iop-iop-edge-operator-metrics"]
    assert metrics["spec"]["ports"][0]["port"] == 8081
    (webhook_name,) = by_kind(documents, "ValidatingWebhookConfiguration")
    service_name = next(a.split("=", 1)[1] for a in args if a.startswith("--webhook-service="))
    assert f"--webhook-configuration={webhook_name}" in args
    service = by_kind(documents, "Service")[service_name]
    assert service["spec"]["ports"] == [
        {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in container["ports"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {e["name"] for e in container["env"]} == {
        "IOP_UPSTREAM_POLICY",
        "POD_IP",
        "POD_NAMESPACE",
        "POD_NAME",
    }

    # The webhook as docs/operator.md gives it, field by field.
    text = (REPO / "docs" / "operator.md").read_text()
    block = text[text.index("The chart's ValidatingWebhookConfiguration:") :]
    block = block[block.index("```yaml") + 7 : block.index("```", block.index("```yaml") + 7)]
    documented = yaml.safe_load(
        block.replace("<the namespace>", "iop-system")
        .replace("<the EdgeConfig>", "iop-iop-edge")
        .replace("<operator webhook Service>", service_name)
        .replace("<ns>", "iop-system")
    )["webhooks"]
    hooks = by_kind(documents, "ValidatingWebhookConfiguration")[webhook_name]["webhooks"]
    assert hooks == documented


def test_without_the_operator_the_chart_leaves_out_exactly_its_objects(
    chart_tools: ChartTools,
) -> None:
    # operator.enabled=false is for an operator that runs elsewhere (the operator's e2e tests
    # and benchmark run it on the host): the workloads it drives stay, its own objects go.
    def names(values: dict[str, Any] | None) -> set[tuple[str, str]]:
        documents = chart_tools.documents(values=values)
        return {(d["kind"], d["metadata"]["name"]) for d in documents}

    everything = names(None)
    # (Nothing makes the hub's certificates then: the values name a Secret or turn TLS off.)
    without = names({"operator": {"enabled": False}, "tls": {"enabled": False}})
    assert everything - without == {
        ("ServiceAccount", "iop-iop-edge-operator"),
        ("Role", "iop-iop-edge-operator"),
        ("RoleBinding", "iop-iop-edge-operator"),
        ("ClusterRole", "iop-iop-edge-iop-system-webhook"),
        ("ClusterRoleBinding", "iop-iop-edge-iop-system-webhook"),
        ("Deployment", "iop-iop-edge-operator"),
        ("Service", "iop-iop-edge-operator-webhook"),
        ("Service", "iop-iop-edge-operator-metrics"),
        ("ValidatingWebhookConfiguration", "iop-iop-edge-iop-system"),
        ("NetworkPolicy", "iop-iop-edge-operator"),
    }
    assert without < everything
    workloads = {("Deployment", "iop-iop-edge-edge"), ("Deployment", "iop-iop-edge-node-node-1")}
    assert workloads < without


def test_an_api_key_without_the_hosts_it_is_for_fails_the_install(chart_tools: ChartTools) -> None:
    """A key must be bound: the schema refuses an `apiKeys` entry without `hosts`, and `public`
    as one of them."""
    unbound = {"env": "VLLM_A_KEY", "secretName": "keys", "secretKey": "a"}
    for entry in (unbound, {**unbound, "hosts": ["public"]}):
        with pytest.raises(RenderFailed) as caught:
            chart_tools.template(values={"nodes": [{"id": "node-1", "apiKeys": [entry]}]})
        assert "apiKeys" in str(caught.value)
    bound = {**unbound, "hosts": ["vllm-a.ml.svc:8000"]}
    values = {"upstreams": {"allow": ["vllm-a.ml.svc:8000"]}, "edge": {"apiKeys": [bound]}}
    chart_tools.template(values=values)
