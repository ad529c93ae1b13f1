"""Two releases of the chart in one namespace: each one's operator sees, validates and writes only
its own EdgeConfig and what belongs to it (docs/operator.md, "One operator per EdgeConfig").

Both operators run as pods with their releases' RBAC (two replicas each); the Edges and Nodes
stand on kwok's node, where nothing runs: this is about who writes what, read from
`managedFields`, Events, the API server's audit log and each operator's own metrics.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from e2e.operator.conftest import chart_namespace, kwok_release
from tests.waiting import wait_for

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

# Two chart installs and four operator pods before the first look.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(360)]

RELEASES = ("alpha", "beta")


@pytest.fixture(scope="module")
def namespace(kube_cluster: KubeCluster, edgeconfig_crd: None) -> Iterator[str]:
    releases = {name: kwok_release(name) for name in RELEASES}
    with chart_namespace(kube_cluster, "e2e-releases", releases) as namespace:
        yield namespace


def managers(obj: dict[str, Any], subresource: str | None = None) -> set[str]:
    """Who wrote `obj` (or its `subresource`): `obj` read with `--show-managed-fields`."""
    return {
        entry["manager"]
        for entry in obj["metadata"].get("managedFields") or ()
        if entry.get("subresource") == subresource
    }


def operator_pods(cluster: KubeCluster, namespace: str, name: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=operator"
    return cluster.pods(namespace, selector)


def admissions(cluster: KubeCluster, namespace: str, name: str) -> float:
    """Admission reviews of its own EdgeConfig all of `name`'s operator replicas have answered
    (their /metrics; not the `unowned` ones: each also warns about the other's EdgeConfig)."""
    total = 0.0
    for pod in operator_pods(cluster, namespace, name):
        text = httpx.get(f"http://{pod['status']['podIP']}:8081/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith("iop_operator_webhook_admissions_total{") and "unowned" not in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_each_operator_writes_only_its_own_edgeconfig(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    def observed(name: str) -> bool:
        ec = kube_cluster.get("ec", name, "-n", namespace)
        # The Edges stand on kwok and never answer: the operator writes their config but applies
        # nothing (no `-edge-applied` record), which is all this test needs.
        made = kube_cluster.kubectl(
            "get", "configmap", f"{name}-edge", "-n", namespace, check=False
        )
        return ec.get("status", {}).get("observedGeneration") == 1 and made.returncode == 0

    def two_operator_pods_with_ips(name: str) -> bool:
        found = operator_pods(kube_cluster, namespace, name)
        return len(found) == 2 and all(p["status"].get("podIP") for p in found)

    for name in RELEASES:
        wait_for(functools.partial(observed, name), timeout=180, what=f"ec/{name} observed")
        wait_for(
            functools.partial(two_operator_pods_with_ips, name),
            timeout=120,
            what=f"{name}'s two operator pods",
        )

    for name in RELEASES:
        mine = f"iop-operator/{name}"

        def written(kind: str, obj: str, subresource: str | None = None) -> set[str]:
            found = kube_cluster.get(kind, obj, "-n", namespace, "--show-managed-fields")
            return managers(found, subresource)

        assert written("ec", name, "status") == {mine}
        assert written("configmap", f"{name}-edge") == {mine}
        for secret in (f"{name}-edge-admin", f"{name}-node-node-1", f"{name}-api-keys"):
            assert written("secret", secret) == {mine}
        pods = {p["metadata"]["name"] for p in operator_pods(kube_cluster, namespace, name)}
        events = kube_cluster.get(
            "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
        )["items"]
        assert events and {e["reportingInstance"] for e in events} <= pods

    # What each operator's ServiceAccount asked the API server for: only its own objects.
    for name in RELEASES:
        (other,) = set(RELEASES) - {name}
        calls = kube_cluster.audit(f"system:serviceaccount:{namespace}:{name}-operator")
        # Discovery calls (`/api`, `/apis`) have no objectRef.
        refs = [(c, c.get("objectRef") or {}) for c in calls]
        touched = [
            (c["verb"], ref.get("resource"), ref.get("name"))
            for c, ref in refs
            if (ref.get("name") or "").startswith(other)
            or f"metadata.name%3D{other}" in c.get("requestURI", "")
            or f"iop.dev%2Fedgeconfig%3D{other}" in c.get("requestURI", "")
        ]
        assert calls and touched == []
        assert [c for c in calls if c.get("responseStatus", {}).get("code") == 403] == []

    # A change to alpha is alpha's alone: its webhook answers (beta's only warns about what it
    # does not serve, and not even that: alpha's status is written by alpha), its operator
    # applies it, beta's EdgeConfig does not move.
    beta_before = kube_cluster.get("ec", "beta", "-n", namespace)
    patch = json.dumps({"spec": {"openai": {"longContextThresholdTokens": 5000}}})
    # The webhook answers only once the API server trusts its certificate and the Service has a
    # ready replica; until then failurePolicy Ignore admits without asking it. A server-side dry
    # run is admitted like the real patch and changes nothing: wait until alpha's answers one.
    asked = admissions(kube_cluster, namespace, "alpha")

    def answered() -> bool:
        kube_cluster.kubectl(
            "patch", "ec", "alpha", "-n", namespace, "--type=merge", "-p", patch,
            "--dry-run=server",
        )  # fmt: skip
        return admissions(kube_cluster, namespace, "alpha") > asked

    wait_for(answered, timeout=60, what="alpha's webhook to answer", interval=1)
    beta_admissions = admissions(kube_cluster, namespace, "beta")
    alpha_admissions = admissions(kube_cluster, namespace, "alpha")
    kube_cluster.kubectl("patch", "ec", "alpha", "-n", namespace, "--type=merge", "-p", patch)
    wait_for(
        lambda: (
            kube_cluster.get("ec", "alpha", "-n", namespace)["status"]["observedGeneration"] == 2
        ),
        timeout=60,
        what="alpha's generation 2 observed",
    )
    assert admissions(kube_cluster, namespace, "alpha") == alpha_admissions + 1
    assert admissions(kube_cluster, namespace, "beta") == beta_admissions
    beta_after = kube_cluster.get("ec", "beta", "-n", namespace)
    assert beta_after["metadata"]["generation"] == beta_before["metadata"]["generation"] == 1
    assert beta_after["status"]["observedGeneration"] == 1
