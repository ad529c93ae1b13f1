"""The chart on a real cluster with running pods: install, serve, upgrade, test, uninstall.

The local cluster's process kubelet runs every pod of the chart as a real `iop` process
(e2e/cluster/README.md), so this is the product as a user installs it: the operator with its
ServiceAccount's RBAC and its webhook behind a Service, the Edge behind its Services, three
in-cluster Nodes dialling the headless hub, a fake upstream, the EdgeConfig from values.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy" / "helm" / "iop-edge"
VALUES = REPO / "configs" / "helm-values.yaml"
RELEASE = "iop"
EC = "edge"  # edgeConfig.name in configs/helm-values.yaml


def pod_uids(cluster: KubeCluster, namespace: str) -> dict[str, str]:
    """Live pods (not terminating) by name -> uid."""
    pods = cluster.get("pods", "-n", namespace)["items"]
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
    }


def wait_ready(cluster: KubeCluster, namespace: str, generation: int, timeout: float = 180) -> Any:
    """The EdgeConfig once it is Ready for `generation` (a positive signal, polled)."""
    deadline = time.monotonic() + timeout
    while True:
        ec = cluster.get("ec", EC, "-n", namespace)
        status = ec.get("status", {})
        ready = {c["type"]: c for c in status.get("conditions", [])}.get("Ready", {})
        if (
            status.get("observedGeneration") == generation
            and ready.get("status") == "True"
            and ready.get("observedGeneration") == generation
        ):
            return ec
        if time.monotonic() > deadline:
            pytest.fail(f"EdgeConfig {EC} not Ready for generation {generation}: {status}")
        time.sleep(0.5)


def chat(cluster: KubeCluster, namespace: str, model: str = "llama-3.1-8b") -> dict[str, Any]:
    """One chat completion through the Edge's OpenAI Service (its ClusterIP, from the host)."""
    key = cluster.kubectl(
        "get", "secret", "iop-api-keys", "-n", namespace, "-o", "jsonpath={.data.search-chat}"
    ).stdout
    service = cluster.get("service", "iop-openai", "-n", namespace)
    url = f"http://{service['spec']['clusterIP']}:8080/v1/chat/completions"
    response = httpx.post(
        url,
        headers={"Authorization": f"Bearer {base64.b64decode(key).decode()}"},
        json={"model": model, "messages": [{"role": "user", "content": "Hello!"}]},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def secret_data(cluster: KubeCluster, namespace: str) -> dict[str, dict[str, str]]:
    return {
        s["metadata"]["name"]: s.get("data", {})
        for s in cluster.get("secrets", "-n", namespace)["items"]
    }


def test_install_serve_upgrade_live_and_restart_helm_test_and_uninstall(
    kube_cluster: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    cluster = kube_cluster
    cluster.kubectl(
        "create", "secret", "generic", "iop-provider-keys", "-n", namespace,
        "--from-literal=vllm-a=not-a-real-key",
    )  # fmt: skip
    values = yaml.safe_load(VALUES.read_text())

    # Install: every pod runs, the operator writes the config, the EdgeConfig becomes Ready and
    # the Edge answers through its Service with the chart's generated API key.
    cluster.helm(
        "install", RELEASE, str(CHART), "-n", namespace, "-f", str(VALUES),
        "--wait", "--timeout=240s", timeout=300,
    )  # fmt: skip
    wait_ready(cluster, namespace, 1)
    assert chat(cluster, namespace)["choices"][0]["message"]["content"]
    edge_config = cluster.get("configmap", f"{EC}-edge", "-n", namespace)
    assert json.loads(edge_config["data"]["edge.yaml"])["edge"]["admin"]["listen"] == "0.0.0.0:9090"
    tokens = secret_data(cluster, namespace)
    pods = pod_uids(cluster, namespace)
    assert {name.rsplit("-", 2)[0] for name in pods} == {
        "iop-edge", "iop-operator", "iop-fake-upstream",
        "iop-node-node-1", "iop-node-node-2", "iop-node-node-3",
    }  # fmt: skip

    # helm upgrade with a live change (a provider's capacity): applied on the running Edge,
    # no pod replaced, and the generated tokens are the same (read back with lookup).
    values["edgeConfig"]["spec"]["nodes"][0]["providers"][0]["capacity"] = 12
    live = tmp_path / "live.yaml"
    live.write_text(yaml.safe_dump(values))
    cluster.helm("upgrade", RELEASE, str(CHART), "-n", namespace, "-f", str(live), timeout=300)
    ec = wait_ready(cluster, namespace, 2)
    assert ec["status"]["lastChange"]["livePaths"] == ["nodes[node-1].providers[vllm-a].capacity"]
    assert pod_uids(cluster, namespace) == pods
    after = secret_data(cluster, namespace)
    for name in ("edge-edge-admin", "iop-api-keys", "iop-node-node-1"):
        assert after[name] == tokens[name], f"helm upgrade changed the Secret {name}"
    assert chat(cluster, namespace)

    # helm upgrade with an Edge restart (openai.maxRequestBytes): only the Edge is replaced.
    values["edgeConfig"]["spec"]["openai"]["maxRequestBytes"] = 4194304
    restart = tmp_path / "restart.yaml"
    restart.write_text(yaml.safe_dump(values))
    cluster.helm("upgrade", RELEASE, str(CHART), "-n", namespace, "-f", str(restart), timeout=300)
    ec = wait_ready(cluster, namespace, 3)
    assert ec["status"]["lastChange"]["restartScopes"] == ["edge"]
    now = pod_uids(cluster, namespace)
    replaced = {name for name, uid in pods.items() if now.get(name) != uid}
    assert {name.rsplit("-", 2)[0] for name in replaced} == {"iop-edge"}
    assert chat(cluster, namespace)

    # helm test: a pod of the image sends a chat completion through the Service.
    result = cluster.helm("test", RELEASE, "-n", namespace, timeout=300)
    assert "Phase:          Succeeded" in result.stdout, result.stdout

    # Uninstall leaves nothing of the release: not the EdgeConfig, not the operator's ConfigMaps
    # (owned by it), not the cluster-scoped objects; the CRD stays, as Helm documents.
    cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", timeout=300)
    cluster.wait_for(
        lambda: not cluster.get("pods", "-n", namespace)["items"],
        timeout=120,
        what="the release's pods to go",
    )
    cluster.wait_for(
        lambda: (
            not [
                c
                for c in cluster.get("configmaps", "-n", namespace)["items"]
                if c["metadata"]["name"] != "kube-root-ca.crt"
            ]
        ),
        timeout=60,
        what="the operator's ConfigMaps to be collected",
    )
    left = cluster.kubectl(
        "get", "all,secrets,ec,roles,rolebindings,networkpolicies,pdb,serviceaccounts",
        "-n", namespace, "-o", "name",
    ).stdout.split()  # fmt: skip
    assert sorted(left) == ["secret/iop-provider-keys", "serviceaccount/default"]
    cluster_scoped = cluster.kubectl(
        "get", "validatingwebhookconfigurations,clusterroles,clusterrolebindings", "-o", "name"
    ).stdout
    assert f"iop-{namespace}" not in cluster_scoped
    assert cluster.get("crd", "edgeconfigs.iop.dev")["metadata"]["name"] == "edgeconfigs.iop.dev"
