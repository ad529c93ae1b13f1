"""The chart on a real cluster with running pods: install, serve, scrape, upgrade, test,
uninstall; and the Node link over mutual TLS with certificates made as the chart's README says.

The local cluster's process kubelet runs every pod of the chart as a real `iop` process
(e2e/cluster/README.md), so this is the product as a user installs it: the operator with its
ServiceAccount's RBAC and its webhook behind a Service, the Edge behind its Services, three
in-cluster Nodes dialling the headless hub, a fake upstream, the EdgeConfig from values.
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_for

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


def wait_ready(
    cluster: KubeCluster, namespace: str, generation: int, timeout: float = 180, name: str = EC
) -> Any:
    """The EdgeConfig once it is Ready for `generation` (a positive signal, polled)."""

    def ready() -> Any:
        ec = cluster.get("ec", name, "-n", namespace)
        status = ec.get("status", {})
        condition = {c["type"]: c for c in status.get("conditions", [])}.get("Ready", {})
        current = (
            status.get("observedGeneration") == generation
            and condition.get("status") == "True"
            and condition.get("observedGeneration") == generation
        )
        return ec if current else None

    return wait_for(
        ready,
        timeout=timeout,
        interval=0.5,
        what=f"EdgeConfig {name} Ready for generation {generation}",
        show=lambda: cluster.get("ec", name, "-n", namespace).get("status"),
    )


def chat(cluster: KubeCluster, namespace: str, model: str = "llama-3.1-8b") -> dict[str, Any]:
    """One chat completion through the Edge's OpenAI Service (its ClusterIP, from the host)."""
    key = cluster.kubectl(
        "get", "secret", "iop-api-keys", "-n", namespace, "-o", "jsonpath={.data.search-chat}"
    ).stdout
    service = cluster.get("service", "iop-openai", "-n", namespace)
    url = f"http://{service['spec']['clusterIP']}:8080/v1/chat/completions"

    # kube-proxy follows the Service's endpoints a moment after they change (a rolled Edge):
    # a refused connection is retried for a few seconds, anything else is the answer.
    def answer() -> httpx.Response | None:
        try:
            return httpx.post(
                url,
                headers={"Authorization": f"Bearer {base64.b64decode(key).decode()}"},
                json={"model": model, "messages": [{"role": "user", "content": "Hello!"}]},
                timeout=30,
            )
        except httpx.ConnectError:
            return None

    response = wait_for(answer, timeout=15, what=f"an answer (not a refused connection) at {url}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def respond(
    cluster: KubeCluster,
    namespace: str,
    body: dict[str, Any] | None = None,
    *,
    host: str | None = None,
    path: str = "/v1/responses",
    status: int = 200,
) -> dict[str, Any]:
    """One `POST /v1/responses` (or a `GET` of `path` when `body` is None) through the Edge's
    OpenAI Service, or to one Edge pod at `host`, as `chat` sends its own; its JSON answer,
    whose status must be `status`."""
    key = cluster.kubectl(
        "get", "secret", "iop-api-keys", "-n", namespace, "-o", "jsonpath={.data.search-chat}"
    ).stdout
    if host is None:
        host = cluster.get("service", "iop-openai", "-n", namespace)["spec"]["clusterIP"]
    response = httpx.request(
        "GET" if body is None else "POST",
        f"http://{host}:8080{path}",
        headers={"Authorization": f"Bearer {base64.b64decode(key).decode()}"},
        json=body,
        timeout=30,
    )
    assert response.status_code == status, response.text
    answer: dict[str, Any] = response.json()
    return answer


def requests_counted(url: str) -> dict[tuple[str, ...], float]:
    """`iop_edge_requests_total` scraped from `url`, by (principal, token ref, model, status)."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    counted: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "iop_edge_requests_total":
                labels = sample.labels
                key = (labels["principal_ref"], labels["token_ref"], labels["model"])
                counted[(*key, labels["status"])] = sample.value
    return counted


def assert_runs_from_the_image(pod: dict[str, Any]) -> None:
    """Each container's process has the image's root (not the checkout's) and the chart's
    security context: uid 10001, no capabilities, no_new_privs, a read-only root."""
    for status in pod["status"]["containerStatuses"]:
        assert status["imageID"].startswith("ghcr.io/iop-edge/iop-edge@sha256:"), status
        pid = int(status["containerID"].removeprefix("iop://"))
        root = Path(f"/proc/{pid}/root")
        assert (root / "opt" / "iop" / "bin" / "iop").exists()
        assert not (root / str(REPO).lstrip("/") / "pyproject.toml").exists()
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        process = {key: value.split() for key, _, value in (line.partition(":") for line in lines)}
        assert process["Uid"][0] == process["Gid"][0] == "10001", pod["metadata"]["name"]
        assert (process["CapEff"], process["NoNewPrivs"]) == (["0000000000000000"], ["1"])
        mounts = (Path(f"/proc/{pid}/mountinfo").read_text()).splitlines()
        assert "ro" in next(m for m in mounts if m.split()[4] == "/").split()[5].split(",")


def pods_left(cluster: KubeCluster, namespace: str) -> list[str]:
    """Each pod still in `namespace`: its name, phase, node, when its deletion was asked and its
    owners, with the process kubelet's last lines about it (what a wait for them to go shows
    when it times out)."""
    kubelet_log = cluster.kubeconfig.parent / "logs" / "kubelet.log"
    lines = kubelet_log.read_text(errors="replace").splitlines() if kubelet_log.exists() else []
    left = []
    for pod in cluster.get("pods", "-n", namespace)["items"]:
        name = pod["metadata"]["name"]
        said = [line for line in lines if name in line][-12:]
        left.append(
            f"{name} {pod['status'].get('phase')} on {pod['spec'].get('nodeName')} "
            f"deleted at {pod['metadata'].get('deletionTimestamp')} owned by "
            f"{[owner['name'] for owner in pod['metadata'].get('ownerReferences', [])]}; "
            f"the kubelet said: {said}"
        )
    return left


def chat_trace(cluster: KubeCluster, namespace: str) -> list[dict[str, Any]] | None:
    """The spans of a chat's trace at the chart's fake collector, once it holds the Edge's span
    of the request, its run, and the Node's span under that run."""
    service = cluster.get("service", "iop-fake-collector", "-n", namespace)["spec"]
    spans: list[dict[str, Any]] = httpx.get(
        f"http://{service['clusterIP']}:4320/spans", timeout=10
    ).json()
    for request in (s for s in spans if s["name"] == "chat llama-3.1-8b"):
        trace = [s for s in spans if s["trace_id"] == request["trace_id"]]
        runs = [s for s in trace if s["name"] == "iop.run"]
        if runs and any(s["parent_span_id"] == runs[0]["span_id"] for s in trace):
            return trace
    return None


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
    # Traces on, every one sampled, to the chart's fake collector; a LoRA adapter of the first
    # model.
    values["tracing"] = {"enabled": True, "samplerArg": "1.0"}
    values["fakeCollector"] = {"enabled": True}
    values["edgeConfig"]["spec"]["models"][0]["adapters"] = ["sql-lora"]
    installed = tmp_path / "values.yaml"
    installed.write_text(yaml.safe_dump(values))

    # Install: every pod runs, the operator writes the config, the EdgeConfig becomes Ready and
    # the Edge answers through its Service with the chart's generated API key.
    cluster.helm(
        "install", RELEASE, str(CHART), "-n", namespace, "-f", str(installed),
        "--wait", "--timeout=240s", timeout=300,
    )  # fmt: skip
    wait_ready(cluster, namespace, 1)
    assert chat(cluster, namespace)["choices"][0]["message"]["content"]
    # ... and its trace: the Edge pod's spans and the Node pod's, one trace across the gRPC link.
    trace = wait_for(
        lambda: chat_trace(cluster, namespace),
        timeout=60,
        what="the chat's trace at the fake collector",
    )
    assert {span["service"] for span in trace} == {"iop-edge", "iop-node"}
    edge_config = cluster.get("configmap", f"{EC}-edge", "-n", namespace)
    assert json.loads(edge_config["data"]["edge.yaml"])["edge"]["admin"]["listen"] == "0.0.0.0:9090"
    # The Node link is TLS by default, with the certificates the operator made (the chat above
    # was served through it): the Edge serves them, the Nodes verify them.
    assert json.loads(edge_config["data"]["edge.yaml"])["edge"]["tls"]["cert_file"]
    hub_tls = cluster.get("secret", "iop-hub-tls", "-n", namespace)
    assert set(hub_tls["data"]) == {"ca.crt", "tls.crt", "tls.key", "client.crt", "client.key"}

    # The metrics: served on their own Service and on each Edge pod's metrics port (the chart runs
    # two Edge replicas), with the chat above counted under its principal and token ref by the
    # replica that served it; the public Service has none.
    chatted = ("team-search", "search-chat", "llama-3.1-8b", "200")
    metrics = cluster.get("service", "iop-metrics", "-n", namespace)["spec"]
    edge_pods = cluster.pods(namespace, "app.kubernetes.io/component=edge")
    assert len(edge_pods) == 2  # the chart's default edge.replicas
    pod_urls = [f"http://{pod['status']['podIP']}:9091/metrics" for pod in edge_pods]
    wait_for(
        lambda: sum(requests_counted(url).get(chatted, 0) for url in pod_urls) == 1,
        timeout=30,
        what="the chat completion counted by one Edge replica",
    )
    service_url = f"http://{metrics['clusterIP']}:{metrics['ports'][0]['port']}/metrics"
    assert "iop_edge_requests_total" in httpx.get(service_url, timeout=10).text
    openai = cluster.get("service", "iop-openai", "-n", namespace)["spec"]["clusterIP"]
    assert httpx.get(f"http://{openai}:8080/metrics", timeout=10).status_code == 404

    # The adapter is a model of the catalog, served by its model's providers under its name.
    assert chat(cluster, namespace, "sql-lora")["model"] == "sql-lora"
    # The Responses API through the pool. A continuation reaches the server that holds the
    # response it continues through the replica that answered it; the other replica knows it
    # only through the shared store (`limitStore`, which this cluster cannot pull: the two
    # replicas sharing one are in tests/edge/http), and says so rather than ask another server.
    first = respond(cluster, namespace, {"model": "llama-3.1-8b", "input": "Hello!"})
    assert first["object"] == "response" and first["status"] == "completed"
    one, other = (pod["status"]["podIP"] for pod in edge_pods)
    opened = respond(cluster, namespace, {"model": "llama-3.1-8b", "input": "Hi"}, host=one)
    continued = {"model": "llama-3.1-8b", "input": "And?", "previous_response_id": opened["id"]}
    second = respond(cluster, namespace, continued, host=one)
    assert second["status"] == "completed" and second["previous_response_id"] == opened["id"]
    assert (
        respond(cluster, namespace, host=one, path=f"/v1/responses/{opened['id']}")["id"]
        == (opened["id"])
    )
    unknown = respond(cluster, namespace, continued, host=other, status=400)
    assert unknown["error"]["code"] == "previous_response_not_found", unknown

    # Every pod of the chart is a process of the image, as its security contexts say.
    for pod in cluster.pods(namespace, "app.kubernetes.io/instance=" + RELEASE):
        assert_runs_from_the_image(pod)

    tokens = secret_data(cluster, namespace)
    pods = pod_uids(cluster, namespace)
    assert {name.rsplit("-", 2)[0] for name in pods} == {
        "iop-edge", "iop-operator", "iop-fake-upstream", "iop-fake-collector",
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
    for name in ("edge-edge-admin", "iop-api-keys", "iop-node-node-1", "iop-hub-tls"):
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
    wait_for(
        lambda: not cluster.get("pods", "-n", namespace)["items"],
        timeout=120,
        what="the release's pods to go",
        show=lambda: pods_left(cluster, namespace),
    )
    wait_for(
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

    # What the operator made (token Secrets, the webhook's and the hub's certificate Secrets)
    # goes through the garbage collector with its owner (the EdgeConfig, their Services).
    def left() -> list[str]:
        return sorted(
            cluster.kubectl(
                "get", "all,secrets,ec,roles,rolebindings,networkpolicies,pdb,serviceaccounts",
                "-n", namespace, "-o", "name",
            ).stdout.split()
        )  # fmt: skip

    expected = ["secret/iop-provider-keys", "serviceaccount/default"]
    wait_for(lambda: left() == expected, timeout=60, what=f"only {expected} left")
    cluster_scoped = cluster.kubectl(
        "get", "validatingwebhookconfigurations,clusterroles,clusterrolebindings", "-o", "name"
    ).stdout
    assert f"iop-{namespace}" not in cluster_scoped
    assert cluster.get("crd", "edgeconfigs.iop.dev")["metadata"]["name"] == "edgeconfigs.iop.dev"


def readme_tls_commands(namespace: str) -> str:
    """The chart README's openssl and kubectl commands for the Node link's certificates, for a
    release `iop` in `namespace` (the README's is `iop`); its `helm` line is the test's own."""
    readme = (CHART / "README.md").read_text()
    block = readme[readme.index("With **openssl**") :]
    block = block[block.index("```sh\n") + 6 : block.index("\n```", block.index("```sh\n"))]
    commands = [
        command
        for command in block.replace("\\\n", " ").splitlines()
        if command.split(" ", 1)[0] in ("openssl", "printf", "kubectl")
        or command.startswith("HUB=")
    ]
    assert len(commands) == 10, block
    script = "\n".join(["set -eu", *commands])
    return script.replace(".iop.svc", f".{namespace}.svc").replace(" -n iop ", f" -n {namespace} ")


def demo_chat_answered(cluster: KubeCluster, namespace: str, model: str) -> bool:
    """One chat completion of release `iop` (no fullnameOverride) with its `demo` key, through
    its OpenAI Service: answered with content (False while kube-proxy does not follow the
    Service yet)."""
    key = cluster.kubectl(
        "get", "secret", "iop-iop-edge-api-keys", "-n", namespace,
        "-o", "jsonpath={.data.demo}",
    ).stdout  # fmt: skip
    url = cluster.get("service", "iop-iop-edge-openai", "-n", namespace)["spec"]["clusterIP"]
    try:
        response = httpx.post(
            f"http://{url}:8080/v1/chat/completions",
            headers={"Authorization": f"Bearer {base64.b64decode(key).decode()}"},
            json={"model": model, "messages": [{"role": "user", "content": "Hello!"}]},
            timeout=30,
        )
    except httpx.ConnectError:  # kube-proxy not yet following the new Service
        return False
    return response.status_code == 200 and bool(response.json()["choices"][0]["message"]["content"])


def test_install_with_mutual_tls_on_the_node_link(
    kube_cluster: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    # The chart's defaults (one in-cluster Node of the fake adapter), the hub over mutual TLS
    # with certificates made by the README's commands: the chat completion can only be served
    # if the Node verified the Edge's certificate under the hub Service's name and the Edge
    # accepted the Node's.
    cluster = kube_cluster
    script = readme_tls_commands(namespace)
    made = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=cluster.env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    try:
        cluster.helm(
            "install", RELEASE, str(CHART), "-n", namespace,
            "--set", "tls.enabled=true,tls.secretName=iop-hub-tls",
            "--set", "tls.mutual=true,tls.clientSecretName=iop-node-tls",
            "--wait", "--timeout=240s", timeout=300,
        )  # fmt: skip
        wait_ready(cluster, namespace, 1, name="iop-iop-edge")
        edge_config = cluster.get("configmap", "iop-iop-edge-edge", "-n", namespace)
        assert json.loads(edge_config["data"]["edge.yaml"])["edge"]["tls"] == {
            "cert_file": "/etc/iop/tls/tls.crt",
            "key_file": "/etc/iop/tls/tls.key",
            "client_ca_file": "/etc/iop/tls/ca.crt",
        }
        # The Node may still be dialling when the EdgeConfig is Ready: wait for an answer.
        wait_for(
            lambda: demo_chat_answered(cluster, namespace, "demo-echo"),
            timeout=60,
            interval=1,
            what="a chat completion over TLS",
        )
    finally:
        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", timeout=300, check=False)


def test_a_node_placed_on_the_edge_shares_its_capacity_among_the_edge_replicas(
    kube_cluster: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    # No Node workload: the Edge replicas run the provider themselves, reach the in-cluster
    # upstream through its Service, and count each other through the headless hub Service
    # (CoreDNS), each taking its share of the provider's capacity; a scale-up shrinks it.
    cluster = kube_cluster
    upstream = 'http://{{ include "iop-edge.fullname" . }}-fake-upstream:8000/v1'
    provider = {
        "id": "vllm-a",
        "adapter": {"type": "openai", "baseUrl": upstream},
        "servedModels": ["meta-llama/Llama-3.1-8B-Instruct"],
        "capacity": 8,
    }
    values = {
        "fakeUpstream": {"enabled": True},
        "nodes": [],
        "edgeConfig": {
            "spec": {
                "edge": {"id": "edge-a"},
                "openai": {"principalTokens": [{"tokenRef": "demo", "principalRef": "demo"}]},
                "models": [
                    {"id": "llama", "providers": {"vllm-a": "meta-llama/Llama-3.1-8B-Instruct"}}
                ],
                "nodes": [{"id": "in-edge", "placement": "edge", "providers": [provider]}],
            }
        },
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))

    def shares(replicas: int, capacity: int) -> bool:
        pods = [
            p
            for p in cluster.pods(namespace, "app.kubernetes.io/component=edge")
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")
        ]
        if len(pods) != replicas:
            return False
        for pod in pods:
            try:
                text = httpx.get(f"http://{pod['status']['podIP']}:9091/metrics", timeout=5).text
            except httpx.HTTPError:
                return False
            if f"iop_edge_replicas {replicas}.0" not in text or (
                f'iop_edge_provider_capacity{{provider="vllm-a"}} {capacity}.0' not in text
            ):
                return False
        return True

    try:
        cluster.helm(
            "install", RELEASE, str(CHART), "-n", namespace, "-f", str(path),
            "--wait", "--timeout=240s", timeout=300,
        )  # fmt: skip
        wait_ready(cluster, namespace, 1, name="iop-iop-edge")
        assert not cluster.pods(namespace, "app.kubernetes.io/component=node")

        def answered() -> bool:
            return demo_chat_answered(cluster, namespace, "llama")

        wait_for(answered, timeout=60, interval=1, what="a chat completion served by the Edge")
        wait_for(lambda: shares(2, 4), timeout=60, interval=1, what="2 replicas, 4 runs each")

        cluster.helm(
            "upgrade", RELEASE, str(CHART), "-n", namespace, "-f", str(path),
            "--set", "edge.replicas=3", "--wait", "--timeout=240s", timeout=300,
        )  # fmt: skip
        wait_for(lambda: shares(3, 2), timeout=90, interval=1, what="3 replicas, 2 runs each")
        wait_for(answered, timeout=60, interval=1, what="a chat completion after the scale-up")
    finally:
        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", timeout=300, check=False)
