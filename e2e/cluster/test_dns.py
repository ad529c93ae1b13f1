"""Cluster DNS and Services: CoreDNS answers inside pods, kube-proxy carries ClusterIP traffic.

A headless Service resolves to every ready replica's pod IP (how Nodes find every Edge
replica); a normal Service resolves to its ClusterIP, which a pod and the host can connect to.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

import pytest

from e2e.cluster.imagebuild import project_reference
from tests.waiting import wait_for

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

pytestmark = pytest.mark.e2e

IMAGE = project_reference()  # what the cluster's node has: the Dockerfile's build

RESOLVER = """
import json, socket, sys, urllib.request
namespace = sys.argv[1]
def addresses(name):
    return sorted({info[4][0] for info in socket.getaddrinfo(name, 80, socket.AF_INET)})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open("http://upstream/v1/models", timeout=5) as response:
    status = response.status
print(json.dumps({
    "headless": addresses(f"upstream-pods.{namespace}.svc.cluster.local"),
    "service": addresses(f"upstream.{namespace}.svc.cluster.local"),
    "short": addresses("upstream"),
    "kubernetes": addresses("kubernetes.default"),
    "status": status,
}))
"""


def models_status(url: str) -> int | None:
    """The status of GET `url` from the host, or None when the connection is refused."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            status: int = response.status
            return status
    except urllib.error.URLError as error:
        if isinstance(error.reason, ConnectionRefusedError):
            return None
        raise


def service(name: str, *, headless: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": {"app": "upstream"},
        "ports": [{"name": "http", "port": 80, "targetPort": 8000}],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def upstream(replicas: int) -> dict[str, Any]:
    labels = {"app": "upstream"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "upstream"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "upstream",
                            "image": IMAGE,
                            "args": ["fake-upstream", "--listen", "0.0.0.0:8000"],
                            "readinessProbe": {
                                "httpGet": {"path": "/v1/models", "port": 8000},
                                "periodSeconds": 1,
                            },
                        }
                    ]
                },
            },
        },
    }


def test_headless_and_normal_services_resolve_and_connect_inside_a_pod(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    kube_cluster.apply(upstream(2), "-n", namespace)
    kube_cluster.apply(service("upstream", headless=False), "-n", namespace)
    kube_cluster.apply(service("upstream-pods", headless=True), "-n", namespace)
    kube_cluster.kubectl(
        "rollout", "status", "deployment/upstream", "-n", namespace, "--timeout=60s", timeout=70
    )
    pod_ips = sorted(p["status"]["podIP"] for p in kube_cluster.pods(namespace, "app=upstream"))

    def endpoints_ready() -> bool:
        slices = kube_cluster.get(
            "endpointslices", "-n", namespace, "-l", "kubernetes.io/service-name=upstream-pods"
        )["items"]
        ready = sorted(
            address
            for slice_ in slices
            for endpoint in slice_.get("endpoints") or []
            if endpoint.get("conditions", {}).get("ready")
            for address in endpoint["addresses"]
        )
        return ready == pod_ips

    wait_for(endpoints_ready, timeout=30, what="both pods in the EndpointSlice")

    # kube-proxy follows the EndpointSlice a moment later (until then its rule for a Service
    # with no endpoints refuses the connection). The host reaching the ClusterIP, through the
    # route to the Service range in the node namespace, shows the rule is in place.
    cluster_ip = kube_cluster.get("service", "upstream", "-n", namespace)["spec"]["clusterIP"]
    wait_for(
        lambda: models_status(f"http://{cluster_ip}/v1/models") == 200,
        timeout=30,
        what="kube-proxy to carry the ClusterIP to the pods",
    )

    client = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "resolver"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "resolver",
                    "image": IMAGE,
                    "command": ["python", "-c", RESOLVER, namespace],
                }
            ],
        },
    }
    kube_cluster.apply(client, "-n", namespace)
    finished = wait_for(
        lambda: (lambda p: p if p["status"].get("phase") in ("Succeeded", "Failed") else None)(
            kube_cluster.get("pod", "resolver", "-n", namespace)
        ),
        timeout=60,
        what="the resolver pod to finish",
    )
    output = kube_cluster.kubectl("logs", "resolver", "-n", namespace).stdout
    assert finished["status"]["phase"] == "Succeeded", output
    answer = json.loads(output.splitlines()[-1])

    api_ip = kube_cluster.get("service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
    assert answer == {
        "headless": pod_ips,
        "service": [cluster_ip],
        "short": [cluster_ip],
        "kubernetes": [api_ip],
        "status": 200,
    }
