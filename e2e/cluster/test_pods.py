"""Pods that really run: the process kubelet of e2e/cluster runs the project's image.

Deployments become Ready through real readiness probes, pods answer on their own IPs, a deleted
pod's process ends and a new one takes its place, a rolling restart replaces every process,
mounted ConfigMaps follow updates, and a pod talks to the API server as an in-cluster client.
"""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from e2e.cluster.imagebuild import project_reference
from tests.waiting import wait_for

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

pytestmark = pytest.mark.e2e

IMAGE = project_reference()  # what the cluster's node has: the Dockerfile's build
NODE = "process-node-0"
POD_NETWORK = ipaddress.ip_network("10.250.0.0/16")
PORT = 8000


def fake_upstream(name: str, replicas: int) -> dict[str, Any]:
    """A Deployment of `iop fake-upstream`, rolled one pod at a time (maxUnavailable 1)."""
    labels = {"app": name}
    probe = {"httpGet": {"path": "/v1/models", "port": "http"}, "periodSeconds": 1}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "upstream",
                            "image": IMAGE,
                            "args": ["fake-upstream", "--listen", f"0.0.0.0:{PORT}"],
                            "ports": [{"name": "http", "containerPort": PORT}],
                            "readinessProbe": probe,
                            "livenessProbe": {**probe, "periodSeconds": 5},
                        }
                    ],
                },
            },
        },
    }


def models(pod_ip: str) -> dict[str, Any]:
    """GET /v1/models from the host, straight to the pod's IP."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{pod_ip}:{PORT}/v1/models", timeout=5) as response:
        body: dict[str, Any] = json.loads(response.read())
        return body


def pid(pod: dict[str, Any]) -> int:
    """The container's PID, from its container ID (`iop://<pid>`)."""
    (status,) = pod["status"]["containerStatuses"]
    return int(status["containerID"].removeprefix("iop://"))


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def running_command(process_id: int) -> str:
    try:
        return Path(f"/proc/{process_id}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rollout(kube_cluster: KubeCluster, namespace: str, name: str) -> None:
    kube_cluster.kubectl(
        "rollout", "status", f"deployment/{name}", "-n", namespace, "--timeout=90s", timeout=100
    )


def test_a_deployment_runs_answers_and_replaces_a_deleted_pod(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    began = time.monotonic()
    kube_cluster.apply(fake_upstream("upstream", replicas=2), "-n", namespace)
    rollout(kube_cluster, namespace, "upstream")
    print(f"2 replicas Ready {time.monotonic() - began:.1f}s after kubectl apply")

    pods = kube_cluster.pods(namespace, "app=upstream")
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE
        assert ready(pod)
        assert ipaddress.ip_address(pod["status"]["podIP"]) in POD_NETWORK
        assert models(pod["status"]["podIP"])["object"] == "list"
        assert "fake-upstream" in running_command(pid(pod))
    assert len({pod["status"]["podIP"] for pod in pods}) == 2

    victim = pods[0]
    kube_cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", namespace)
    # `kubectl delete` returns once the kubelet has stopped the process and removed the pod.
    assert running_command(pid(victim)) == ""

    old_uids = {pod["metadata"]["uid"] for pod in pods}

    def replaced() -> list[dict[str, Any]] | None:
        current = kube_cluster.pods(namespace, "app=upstream")
        fresh = [p for p in current if p["metadata"]["uid"] not in old_uids and ready(p)]
        return fresh or None

    (fresh,) = wait_for(replaced, timeout=60, what="a Ready replacement pod")
    assert models(fresh["status"]["podIP"])["object"] == "list"


def test_a_rolling_restart_replaces_every_process_one_by_one(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    kube_cluster.apply(fake_upstream("roll", replicas=3), "-n", namespace)
    rollout(kube_cluster, namespace, "roll")
    before = kube_cluster.pods(namespace, "app=roll")
    old_uids = {pod["metadata"]["uid"] for pod in before}
    old_pids = {pid(pod) for pod in before}

    began = time.monotonic()
    stamp = {"spec": {"template": {"metadata": {"annotations": {"iop-edge.test/rev": "2"}}}}}
    kube_cluster.kubectl(
        "patch", "deployment", "roll", "-n", namespace, "--type=merge", "-p", json.dumps(stamp)
    )
    # Watch the rollout from the side: never more than 3 pods (maxSurge 0), never fewer than
    # 2 Ready (maxUnavailable 1).
    fewest_ready, most_pods = 3, 0
    while (
        kube_cluster.get("deployment", "roll", "-n", namespace)["status"].get("updatedReplicas")
        != 3
        or len(kube_cluster.pods(namespace, "app=roll")) != 3
    ):
        listed = kube_cluster.get("pods", "-n", namespace, "-l", "app=roll")["items"]
        live = [p for p in listed if "deletionTimestamp" not in p["metadata"]]
        most_pods = max(most_pods, len(live))
        fewest_ready = min(fewest_ready, sum(ready(p) for p in live))
        assert time.monotonic() - began < 90, "rolling restart did not finish in 90s"
    rollout(kube_cluster, namespace, "roll")
    print(f"rolling restart of 3 replicas: {time.monotonic() - began:.1f}s")

    after = wait_for(
        lambda: (lambda p: p if len(p) == 3 and all(map(ready, p)) else None)(
            kube_cluster.get("pods", "-n", namespace, "-l", "app=roll")["items"]
        ),
        timeout=30,
        what="exactly the 3 new pods",
    )
    assert not old_uids & {pod["metadata"]["uid"] for pod in after}
    assert not old_pids & {pid(pod) for pod in after}
    assert all(running_command(old) == "" for old in old_pids)
    assert fewest_ready >= 2
    assert most_pods <= 3


CONFIG_WATCHER = """
import json, os, time
print(json.dumps({k: os.environ.get(k) for k in
      ["POD_NAME", "POD_NAMESPACE", "POD_IP", "FROM_CONFIGMAP", "FROM_SECRET", "MEMORY_MI",
       "KUBERNETES_SERVICE_HOST", "HOSTNAME"]}), flush=True)
seen = None
while True:
    text = open("/etc/demo/greeting").read()
    if text != seen:
        print("greeting:", text, flush=True)
        seen = text
    time.sleep(0.2)
"""


def demo_pod(command: list[str], *, restart: str = "Always") -> dict[str, Any]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo", "labels": {"app": "demo"}},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "demo",
                    "image": IMAGE,
                    "command": command,
                    "env": [
                        {"name": "POD_NAME", **field("metadata.name")},
                        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                        {"name": "POD_IP", **field("status.podIP")},
                        {
                            "name": "FROM_CONFIGMAP",
                            "valueFrom": {"configMapKeyRef": {"name": "demo", "key": "greeting"}},
                        },
                        {
                            "name": "FROM_SECRET",
                            "valueFrom": {"secretKeyRef": {"name": "demo", "key": "password"}},
                        },
                        {
                            "name": "MEMORY_MI",
                            "valueFrom": {
                                "resourceFieldRef": {
                                    "resource": "limits.memory",
                                    "divisor": "1Mi",
                                }
                            },
                        },
                    ],
                    "resources": {"limits": {"memory": "256Mi"}},
                    "volumeMounts": [{"name": "config", "mountPath": "/etc/demo"}],
                }
            ],
            "volumes": [{"name": "config", "configMap": {"name": "demo"}}],
        },
    }


def logs(kube_cluster: KubeCluster, namespace: str, pod: str) -> str:
    return kube_cluster.kubectl("logs", pod, "-n", namespace, check=False).stdout


def test_env_and_a_mounted_configmap_that_follows_updates(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    kube_cluster.kubectl(
        "create", "configmap", "demo", "-n", namespace, "--from-literal=greeting=hello"
    )
    kube_cluster.kubectl(
        "create", "secret", "generic", "demo", "-n", namespace, "--from-literal=password=s3cret"
    )
    kube_cluster.apply(demo_pod(["python", "-c", CONFIG_WATCHER]), "-n", namespace)
    wait_for(
        lambda: "greeting: hello" in logs(kube_cluster, namespace, "demo"),
        timeout=30,
        what="the pod to print the mounted greeting",
    )
    pod = kube_cluster.get("pod", "demo", "-n", namespace)
    env = json.loads(logs(kube_cluster, namespace, "demo").splitlines()[0])
    assert env == {
        "POD_NAME": "demo",
        "POD_NAMESPACE": namespace,
        "POD_IP": pod["status"]["podIP"],
        "FROM_CONFIGMAP": "hello",
        "FROM_SECRET": "s3cret",
        "MEMORY_MI": "256",
        "KUBERNETES_SERVICE_HOST": env["KUBERNETES_SERVICE_HOST"],
        "HOSTNAME": "demo",
    }

    began = time.monotonic()
    update = {"data": {"greeting": "updated"}}
    kube_cluster.kubectl(
        "patch", "configmap", "demo", "-n", namespace, "--type=merge", "-p", json.dumps(update)
    )
    wait_for(
        lambda: "greeting: updated" in logs(kube_cluster, namespace, "demo"),
        timeout=20,
        what="the mounted file to show the update",
    )
    print(f"ConfigMap update reached the mounted file in {time.monotonic() - began:.1f}s")


IN_CLUSTER_CLIENT = """
import json, os
from kubernetes import client, config
config.load_incluster_config()
names = [p.metadata.name for p in client.CoreV1Api().list_namespaced_pod(
    open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()).items]
print(json.dumps({"pods": names}))
"""


def test_a_pod_is_an_in_cluster_client_of_the_api_server(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    kube_cluster.kubectl(
        "create", "role", "pod-reader", "-n", namespace, "--verb=list", "--resource=pods"
    )
    kube_cluster.kubectl(
        "create", "rolebinding", "pod-reader", "-n", namespace, "--role=pod-reader",
        f"--serviceaccount={namespace}:default",
    )  # fmt: skip
    kube_cluster.kubectl(
        "create", "configmap", "demo", "-n", namespace, "--from-literal=greeting=hi"
    )
    kube_cluster.kubectl(
        "create", "secret", "generic", "demo", "-n", namespace, "--from-literal=password=x"
    )
    kube_cluster.apply(
        demo_pod(["python", "-c", IN_CLUSTER_CLIENT], restart="Never"), "-n", namespace
    )
    done = wait_for(
        lambda: (lambda p: p if p["status"].get("phase") in ("Succeeded", "Failed") else None)(
            kube_cluster.get("pod", "demo", "-n", namespace)
        ),
        timeout=60,
        what="the in-cluster client pod to finish",
    )
    output = logs(kube_cluster, namespace, "demo")
    assert done["status"]["phase"] == "Succeeded", output
    assert json.loads(output.splitlines()[-1]) == {"pods": ["demo"]}


def test_an_image_that_cannot_run_here_waits_with_a_reason(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "foreign"},
        "spec": {"containers": [{"name": "nginx", "image": "nginx:1.27"}]},
    }
    kube_cluster.apply(pod, "-n", namespace)

    def waiting() -> dict[str, Any] | None:
        statuses = kube_cluster.get("pod", "foreign", "-n", namespace)["status"].get(
            "containerStatuses", []
        )
        return statuses[0]["state"].get("waiting") if statuses else None

    reason = wait_for(
        lambda: (lambda w: w if w and w["reason"] == "ErrImageNeverPull" else None)(waiting()),
        timeout=30,
        what="the ErrImageNeverPull waiting reason",
    )
    assert "ghcr.io/iop-edge/iop-edge" in reason["message"]


def test_a_crashing_container_is_restarted_with_back_off(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crasher"},
        "spec": {
            "containers": [
                {
                    "name": "crasher",
                    "image": IMAGE,
                    "command": [
                        "python",
                        "-c",
                        "print('attempt', flush=True); raise SystemExit(3)",
                    ],
                }
            ]
        },
    }
    kube_cluster.apply(pod, "-n", namespace)

    def restarted_twice() -> dict[str, Any] | None:
        statuses = kube_cluster.get("pod", "crasher", "-n", namespace)["status"].get(
            "containerStatuses", []
        )
        return statuses[0] if statuses and statuses[0]["restartCount"] >= 2 else None

    # Back-off 1 s, then 2 s: two restarts take about 3 s.
    status = wait_for(restarted_twice, timeout=30, what="two restarts")
    last = status["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (3, "Error")
    previous = kube_cluster.kubectl("logs", "crasher", "-n", namespace, "--previous").stdout
    assert previous == "attempt\n"


GRACEFUL = """
import pathlib, signal, sys, time
def stop(*_):
    pathlib.Path("/out/sigterm").write_text(str(pathlib.Path("/out/prestop").exists()))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_deletion_runs_pre_stop_then_sigterm(
    kube_cluster: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "graceful"},
        "spec": {
            "terminationGracePeriodSeconds": 10,
            "containers": [
                {
                    "name": "graceful",
                    "image": IMAGE,
                    "command": ["python", "-c", GRACEFUL],
                    "lifecycle": {
                        "preStop": {"exec": {"command": ["sh", "-c", "echo bye > /out/prestop"]}}
                    },
                    "volumeMounts": [{"name": "out", "mountPath": "/out"}],
                }
            ],
            "volumes": [{"name": "out", "hostPath": {"path": str(tmp_path)}}],
        },
    }
    tmp_path.chmod(0o777)  # the image runs as its user 10001, as a hostPath's user must know
    kube_cluster.apply(pod, "-n", namespace)
    kube_cluster.wait_condition("pod/graceful", "Ready", namespace=namespace)
    kube_cluster.kubectl("delete", "pod", "graceful", "-n", namespace, "--timeout=30s")

    assert (tmp_path / "prestop").read_text() == "bye\n"
    assert (tmp_path / "sigterm").read_text() == "True"  # the hook ran before SIGTERM
