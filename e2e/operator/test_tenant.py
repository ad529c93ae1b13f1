"""The tenant of issue 34: a ServiceAccount that may edit EdgeConfigs and read no Secret tries to
read a provider key and internal services through the config, and the chart's webhook refuses.

The chart runs its operator (the webhook, given the upstream policy the chart renders from its
values) as a real pod; the Edge and the Node are placed on kwok's node, where nothing runs: what
is judged here is what the tenant may write. The Node and the Edge enforce the same policy where
the request is made (tests/node/test_upstream_policy_processes.py, with real processes).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.operator.conftest import chart_namespace, kwok_release
from e2e.operator.tenants import Tenant, make_tenant
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

NAME = "demo"
VLLM_A = "vllm-a.ml.svc:8000"  # the key's one host, and the one upstream the policy lists
KEY = "sk-vllm-a-e2e-0123456789abcdef"  # in a Secret the tenant cannot read


def chart_spec() -> dict[str, Any]:
    """The spec the chart is given (it adds its listeners, tokens and TLS)."""
    return {
        "edge": {"id": "edge-tenant"},
        "models": [{"id": "m", "providers": {"vllm-a": "served-a"}}],
        "nodes": [
            {
                "id": "node-1",
                "providers": [
                    {
                        "id": "vllm-a",
                        "adapter": {
                            "type": "openai",
                            "baseUrl": f"http://{VLLM_A}/v1",
                            "apiKeyEnv": "VLLM_A_KEY",
                        },
                        "servedModels": ["served-a"],
                        "capacity": 4,
                    }
                ],
            }
        ],
    }


def spec(tenant: Tenant) -> dict[str, Any]:
    """The EdgeConfig's spec as the tenant reads it (as the chart made it)."""
    found = tenant.kubectl("get", "edgeconfig", NAME, "-o", "json")
    assert found.returncode == 0, found.stderr
    body: dict[str, Any] = json.loads(found.stdout)["spec"]
    return body


def with_provider(base: dict[str, Any], pid: str, url: str, env: str | None) -> dict[str, Any]:
    changed = copy.deepcopy(base)
    adapter = {"type": "openai", "baseUrl": url, **({"apiKeyEnv": env} if env else {})}
    changed["nodes"][0]["providers"].append(
        {"id": pid, "adapter": adapter, "servedModels": [f"served-{pid}"], "capacity": 4}
    )
    changed["models"].append({"id": pid, "providers": {pid: f"served-{pid}"}})
    return changed


def manifest(body: dict[str, Any], name: str = NAME) -> dict[str, Any]:
    return {
        "apiVersion": "iop.dev/v1alpha1",
        "kind": "EdgeConfig",
        "metadata": {"name": name},
        "spec": body,
    }


@pytest.fixture(scope="module")
def release(kube_cluster: Any, edgeconfig_crd: None) -> Iterator[tuple[str, Tenant]]:
    """The chart with its operator (pods; the Edge and the Node on kwok's node), its policy
    listing vllm-a only and VLLM_A_KEY bound to it; the EdgeConfig it made; and the tenant."""
    values = kwok_release(NAME)
    values["nodes"][0]["apiKeys"] = [
        {
            "env": "VLLM_A_KEY",
            "secretName": "vllm-keys",
            "secretKey": "a",
            "hosts": [VLLM_A],
            "providers": ["vllm-a"],
        }
    ]
    values |= {"upstreams": {"allow": [VLLM_A]}, "edgeConfig": {"spec": chart_spec()}}
    with chart_namespace(kube_cluster, "e2e-tenant", {NAME: values}) as namespace:
        tenant = make_tenant(kube_cluster, namespace)
        # The webhook answers once the operator has made its certificate and the API server
        # has its CA bundle (until then it admits everything: failurePolicy Ignore): a model
        # naming an unknown provider, which only the webhook refuses, is refused then.
        said: list[str] = []

        def answered() -> bool:
            broken = spec(tenant)
            broken["models"][0]["providers"]["zz"] = "served-z"
            result = tenant.kubectl(
                "apply", "--dry-run=server", "-f", "-", stdin=json.dumps(manifest(broken))
            )
            said[:] = [result.stderr]
            return 'unknown provider "zz"' in result.stderr

        wait_for(answered, timeout=120, what="the webhook to answer", show=lambda: said)
        yield namespace, tenant


def refused(tenant: Tenant, body: dict[str, Any]) -> str:
    """What `kubectl apply` as the tenant says when the webhook refuses `body`."""
    result = tenant.apply(manifest(body))
    assert result.returncode != 0, f"admitted:\n{result.stdout}{result.stderr}"
    assert "denied the request" in result.stderr
    return result.stderr


def test_the_tenant_may_edit_edgeconfigs_and_read_no_secret(release: Any) -> None:
    _, tenant = release
    assert tenant.can("patch", "edgeconfigs")
    assert not tenant.can("get", "secrets")
    assert not tenant.can("create", "pods")
    # A change within the policy is admitted: the tenant edits, the policy only bounds.
    changed = spec(tenant)
    changed["nodes"][0]["providers"][0]["capacity"] = 6
    result = tenant.apply(manifest(changed))
    assert result.returncode == 0, result.stderr


def test_a_key_cannot_be_named_for_another_host_or_provider(release: Any) -> None:
    """Before: admitted with a `live:` warning, and the Node sent the key to the thief."""
    _, tenant = release
    thief = f"http://thief.{tenant.namespace}-other.svc:8000/v1"
    said = refused(tenant, with_provider(spec(tenant), "stolen", thief, "VLLM_A_KEY"))
    assert (
        "nodes[0].providers[1].adapter.apiKeyEnv: the key in VLLM_A_KEY may go only to hosts "
        f"{VLLM_A} and providers vllm-a (the upstream policy), not to provider stolen"
    ) in said
    assert (
        f"nodes[0].providers[1].adapter.baseUrl: thief.{tenant.namespace}-other.svc:8000 is not "
        "allowed by the upstream policy"
    ) in said
    # On its own host, under another provider id: refused too (the binding names vllm-a).
    said = refused(tenant, with_provider(spec(tenant), "twin", f"http://{VLLM_A}/v1", "VLLM_A_KEY"))
    assert "nodes[0].providers[1].adapter.apiKeyEnv" in said and "twin" in said
    # A variable the chart bound to nothing (any other of the Node's environment).
    said = refused(tenant, with_provider(spec(tenant), "home", f"http://{VLLM_A}/v1", "HOME"))
    assert "environment variable HOME is bound to no provider" in said
    assert KEY not in said


def test_internal_addresses_cannot_be_upstreams(release: Any, kube_cluster: Any) -> None:
    """Before: each was called, and its answer came back through the OpenAI API."""
    namespace, tenant = release
    apiserver = kube_cluster.get("service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
    targets = {
        "metadata": "http://169.254.169.254/latest/meta-data",
        "apiserver": "https://kubernetes.default.svc/api",
        "apiserverip": f"https://{apiserver}/api",
        "webhook": f"https://{NAME}-operator-webhook.{namespace}.svc/validate",
        "metrics": f"http://{NAME}-metrics.{namespace}.svc:9091/metrics",
        "loopback": "http://127.0.0.1:9090/status",
    }
    body = spec(tenant)
    for pid, url in targets.items():
        body = with_provider(body, pid, url, None)
    said = refused(tenant, body)
    assert f"{len(targets)} problems in the EdgeConfig spec" in said
    for index, pid in enumerate(targets, start=1):
        assert f"nodes[0].providers[{index}].adapter.baseUrl: " in said, pid
    assert "169.254.169.254 is in a range the upstream policy denies" in said
    assert "127.0.0.1 is in a range the upstream policy denies" in said
    assert f"{apiserver} is not allowed by the upstream policy" in said
