"""The tenant against the operator (issue 34's low findings): a ServiceAccount that may edit
EdgeConfigs and nothing else (`tenants.py`), impersonated with `kubectl --as`.

- pointing the admin token at the webhook certificate's Secret is refused, with the path;
- a Secret value that cannot be a token (several lines, as a TLS key) makes the EdgeConfig
  `Degraded` (`TokenSecretInvalid`) with an Event naming the Secret and key, and the value shows
  in no Event, status or operator log line;
- an EdgeConfig of another name than the release's is admitted with a warning naming the one
  this namespace's operator serves.

One chart install (operator as a pod, its workloads on kwok's node) for the module.
"""

from __future__ import annotations

import base64
import copy
import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from e2e.operator.conftest import chart_namespace, kwok_release
from e2e.operator.tenants import Tenant, make_tenant
from tests.waiting import wait_for

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

# One chart install and its operator pod before the first look.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NAME = "demo"  # the release's fullnameOverride, so also the EdgeConfig's name
WEBHOOK_SECRET = f"{NAME}-operator-webhook-tls"
#: A Secret the cluster's admin made for the tenant (the operator may read it: extraSecretNames).
TENANT_SECRET = "tenant-admin-token"


@dataclass(frozen=True)
class Release:
    cluster: KubeCluster
    namespace: str
    tenant: Tenant

    def ec(self, name: str = NAME) -> dict[str, Any]:
        found: dict[str, Any] = self.cluster.get("ec", name, "-n", self.namespace)
        return found

    def spec(self) -> dict[str, Any]:
        """The release's spec as the chart made it (what the tenant would start from)."""
        return copy.deepcopy(self.ec()["spec"])

    def manifest(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "iop.dev/v1alpha1",
            "kind": "EdgeConfig",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": spec,
        }

    def events(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.get("events", "-n", self.namespace)["items"]
        return items

    def operator_logs(self) -> str:
        selector = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component=operator"
        logs = self.cluster.kubectl(
            "logs", "-n", self.namespace, "-l", selector, "--tail=-1", "--prefix", check=False
        )
        return logs.stdout + logs.stderr


@pytest.fixture(scope="module")
def release(kube_cluster: KubeCluster, edgeconfig_crd: None) -> Iterator[Release]:
    """The chart with one operator replica, the EdgeConfig observed, and the tenant."""
    values = kwok_release(NAME)
    values["operator"] = {"replicas": 1, "rbac": {"extraSecretNames": [TENANT_SECRET]}}
    with chart_namespace(kube_cluster, "e2e-tenant-op", {NAME: values}) as namespace:
        found = Release(kube_cluster, namespace, make_tenant(kube_cluster, namespace))
        wait_for(
            lambda: found.ec().get("status", {}).get("observedGeneration") == 1,
            timeout=180,
            what=f"ec/{NAME} observed",
        )
        yield found


def test_another_edgeconfig_is_admitted_with_a_warning_naming_the_one_served(
    release: Release,
) -> None:
    other = release.manifest("other", release.spec())
    said = f"reconciles only EdgeConfig '{NAME}' in {release.namespace}"
    # Until the API server trusts the webhook and its Service has a ready pod, failurePolicy
    # Ignore admits without asking it: a server-side dry run tells when it answers.
    wait_for(
        lambda: (
            said
            in release.tenant.kubectl(
                "apply", "-f", "-", "--dry-run=server", stdin=json.dumps(other)
            ).stderr
        ),
        timeout=120,
        what="the webhook to answer for another EdgeConfig",
        interval=1,
    )
    applied = release.tenant.apply(other)
    assert applied.returncode == 0, applied.stderr
    assert f"Warning: this namespace's operator (of EdgeConfig '{NAME}') {said}" in applied.stderr
    assert "'other' is neither validated nor applied by it" in applied.stderr
    # Its own EdgeConfig gets the plan, not that warning.
    own = release.tenant.apply(release.manifest(NAME, release.spec()))
    assert own.returncode == 0 and said not in own.stderr, own.stderr


def test_the_admin_token_cannot_be_read_from_the_webhook_certificate(release: Release) -> None:
    spec = release.spec()
    spec["edge"]["admin"]["tokenSecret"] = {"name": WEBHOOK_SECRET, "key": "tls.key"}
    manifest = release.manifest(NAME, spec)
    generation = release.ec()["metadata"]["generation"]
    answer = release.tenant.apply(manifest)
    if answer.returncode == 0:  # admitted unasked (the webhook not trusted yet): ask until refused
        wait_for(
            lambda: (
                release.tenant.kubectl(
                    "apply", "-f", "-", "--dry-run=server", stdin=json.dumps(manifest)
                ).returncode
                != 0
            ),
            timeout=120,
            what="the webhook to refuse",
            interval=1,
        )
        answer = release.tenant.kubectl(
            "apply", "-f", "-", "--dry-run=server", stdin=json.dumps(manifest)
        )
    else:
        assert release.ec()["metadata"]["generation"] == generation
    assert answer.returncode != 0
    assert "edge.admin.tokenSecret.name" in answer.stderr
    assert f"Secret {WEBHOOK_SECRET} holds a certificate the operator made" in answer.stderr


def test_a_multi_line_token_degrades_the_edgeconfig_and_is_never_shown(release: Release) -> None:
    marker = secrets.token_hex(16)  # the value's one line a leak would show
    value = f"a value of several lines, as a TLS key is\n{marker}\n"
    release.cluster.apply(  # by the admin: the tenant may not create Secrets
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": TENANT_SECRET, "namespace": release.namespace},
            "data": {"token": base64.b64encode(value.encode()).decode()},
        }
    )
    spec = release.spec()
    spec["edge"]["admin"]["tokenSecret"] = {"name": TENANT_SECRET, "key": "token"}
    applied = release.tenant.apply(release.manifest(NAME, spec))
    assert applied.returncode == 0, applied.stderr
    generation = release.ec()["metadata"]["generation"]
    found: dict[str, Any] = {}

    def degraded() -> bool:
        nonlocal found
        shown = release.tenant.kubectl("get", "ec", NAME, "-o", "json")  # what the tenant sees
        found = json.loads(shown.stdout) if shown.returncode == 0 else {}
        status = found.get("status", {})
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        got = conditions.get("Degraded", {})
        return bool(
            status.get("observedGeneration") == generation
            and got.get("status") == "True"
            and got.get("reason") == "TokenSecretInvalid"
        )

    wait_for(degraded, timeout=90, what="Degraded TokenSecretInvalid", show=lambda: found)
    conditions = {c["type"]: c for c in found["status"]["conditions"]}
    assert f"Secret {TENANT_SECRET} key token" in conditions["Degraded"]["message"]
    assert "holds a line break" in conditions["Degraded"]["message"]
    assert conditions["Ready"]["status"] == "False"

    def warned() -> list[dict[str, Any]]:
        return [
            e
            for e in release.events()
            if e.get("reason") == "TokenSecretInvalid" and e["involvedObject"].get("name") == NAME
        ]

    wait_for(warned, timeout=30, what="a TokenSecretInvalid Event")
    (event, *_) = warned()
    assert event["type"] == "Warning"
    assert f"Secret {TENANT_SECRET} key token" in event["message"]
    # The value nowhere: no Event of the namespace, not the status, no operator log line.
    assert not [e for e in release.events() if marker in json.dumps(e)]
    assert marker not in json.dumps(found)
    logs = release.operator_logs()
    assert logs and marker not in logs
