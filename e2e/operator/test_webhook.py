"""The validating webhook: invalid specs refused with every path, valid ones admitted with the
plan as warnings (also under --dry-run=server), and what happens when it cannot be reached
(failure policy Ignore: admitted, and the operator still refuses an invalid spec in status)."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e


def invalid(spec: dict[str, Any]) -> dict[str, Any]:
    """Two mistakes the API server's schema cannot see (it would refuse the others itself)."""
    spec = copy.deepcopy(spec)
    spec["models"][0]["providers"]["zz"] = "served-z"
    spec["nodes"][1]["providers"][0]["id"] = "pa"  # pa is node-1's already
    return spec


PROBLEMS = (
    'models[0].providers.zz: unknown provider "zz"',
    'models[2].providers.pc: unknown provider "pc"',
    'nodes[1].providers[0].id: duplicate provider id "pa" (first at nodes[0].providers[0].id)',
)


def apply_output(kube_cluster, namespace: str, spec: dict[str, Any], *args: str):
    manifest = {
        "apiVersion": "iop.dev/v1alpha1",
        "kind": "EdgeConfig",
        "metadata": {"name": "demo"},
        "spec": spec,
    }
    return kube_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", *args, stdin=json.dumps(manifest), check=False
    )


async def test_an_invalid_spec_is_refused_with_every_path(
    kube_cluster, namespace, start_operator, host_stack, host_spec, edgeconfigs
) -> None:
    spec = host_spec()
    stack = await host_stack(spec)
    start_operator(edge_admins=[stack.admin_url])
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    await asyncio.to_thread(edgeconfigs.wait, "demo")

    result = await asyncio.to_thread(apply_output, kube_cluster, namespace, invalid(spec))

    assert result.returncode != 0
    assert "denied the request" in result.stderr
    assert "3 problems in the EdgeConfig spec" in result.stderr
    for problem in PROBLEMS:
        assert problem in result.stderr
    ec = await asyncio.to_thread(edgeconfigs.get, "demo")
    assert ec["metadata"]["generation"] == 1


async def test_warnings_state_the_plan_and_a_dry_run_changes_nothing(
    kube_cluster, namespace, start_operator, host_stack, host_spec, edgeconfigs
) -> None:
    spec = host_spec()
    stack = await host_stack(spec)
    start_operator(edge_admins=[stack.admin_url])
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    await asyncio.to_thread(edgeconfigs.wait, "demo")

    changed = copy.deepcopy(spec)
    changed["openai"]["allowUnauthenticated"] = True
    changed["nodes"][1]["providers"][0]["adapter"]["completionTokens"] = 4
    changed["nodes"][0]["providers"][0]["capacity"] = 7
    dry = await asyncio.to_thread(
        apply_output, kube_cluster, namespace, changed, "--dry-run=server"
    )

    assert dry.returncode == 0, dry.stderr
    warnings = [line for line in dry.stderr.splitlines() if line.startswith("Warning: ")]
    assert warnings == [
        f"Warning: edge.admin.listen {spec['edge']['admin']['listen']} is loopback: the operator "
        "cannot reach the Edge replicas to apply changes",
        "Warning: restart edge: openai.allowUnauthenticated",
        "Warning: restart node node-2: nodes[node-2].providers[pc].adapter.completionTokens",
        "Warning: live: nodes[node-1].providers[pa].capacity",
        "Warning: rollout: restart-required: the restart rolls it out, not judged by the Edges",
    ]
    ec = await asyncio.to_thread(edgeconfigs.get, "demo")
    assert ec["metadata"]["generation"] == 1
    assert ec["spec"] == spec

    # The same plan on a real apply.
    live_only = copy.deepcopy(spec)
    live_only["nodes"][0]["providers"][0]["capacity"] = 7
    real = await asyncio.to_thread(apply_output, kube_cluster, namespace, live_only)
    assert real.returncode == 0, real.stderr
    assert "Warning: live: nodes[node-1].providers[pa].capacity" in real.stderr
    # How the Edges put it on trial, and about how long it takes (docs/rollout.md).
    assert "Warning: rollout: all at once, watched, for m" in real.stderr
    assert "Warning: rollout: about 15s with 20 requests judged (at most 60s)" in real.stderr
    await asyncio.to_thread(edgeconfigs.wait, "demo", generation=2)

    # The emergency pin: refused unless it is `stable` or a revision number, and warned about
    # while it is set.
    def annotate(*args: str) -> Any:
        return kube_cluster.kubectl("annotate", "-n", namespace, "ec", "demo", *args, check=False)

    wrong = await asyncio.to_thread(annotate, "iop.dev/pin-revision=latest")
    assert wrong.returncode != 0
    assert "metadata.annotations[iop.dev/pin-revision]: 'latest' is not a pin" in wrong.stderr
    numbered = await asyncio.to_thread(annotate, "--overwrite", "iop.dev/pin-revision=99")
    assert numbered.returncode == 0, numbered.stderr
    assert (
        "Warning: pinned: iop.dev/pin-revision=99: revision 99 is not in the history"
    ) in numbered.stderr
    pinned = await asyncio.to_thread(annotate, "--overwrite", "iop.dev/pin-revision=stable")
    assert pinned.returncode == 0, pinned.stderr
    assert (
        "Warning: pinned: iop.dev/pin-revision=stable holds the stable revision in effect; this "
        "spec is not applied until the annotation is removed"
    ) in pinned.stderr
    unpinned = await asyncio.to_thread(annotate, "iop.dev/pin-revision-")
    assert unpinned.returncode == 0 and "pinned" not in unpinned.stderr


async def test_with_the_webhook_unreachable_an_invalid_spec_is_admitted_then_refused_in_status(
    kube_cluster, namespace, start_operator, host_stack, host_spec, edgeconfigs
) -> None:
    spec = host_spec()
    stack = await host_stack(spec)
    operator = start_operator(edge_admins=[stack.admin_url])
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    await asyncio.to_thread(edgeconfigs.wait, "demo")
    async with httpx.AsyncClient(base_url=stack.admin_url) as admin:
        before = (await admin.get("/status")).json()
    pids = stack.pids()

    # The operator down: its webhook is unreachable; failurePolicy Ignore admits the change.
    await asyncio.to_thread(operator.stop)
    result = await asyncio.to_thread(apply_output, kube_cluster, namespace, invalid(spec))
    assert result.returncode == 0, result.stderr
    assert "Warning:" not in result.stderr

    # Back up, without a webhook: the reconcile refuses it, with every path, and keeps the rest.
    start_operator(edge_admins=[stack.admin_url], webhook=False)
    ec = await asyncio.to_thread(edgeconfigs.wait, "demo", "Valid", "False", generation=2)
    valid = {c["type"]: c for c in ec["status"]["conditions"]}["Valid"]
    assert valid["reason"] == "InvalidSpec"
    for problem in PROBLEMS:
        assert problem in valid["message"]
    assert sorted(f"{p['path']}: {p['message']}" for p in ec["status"]["problems"]) == sorted(
        PROBLEMS
    )
    applied = {c["type"]: c for c in ec["status"]["conditions"]}["Applied"]
    assert (applied["status"], applied["observedGeneration"]) == ("True", 1)
    assert ec["status"]["appliedConfigHash"] == before["config_hash"]
    async with httpx.AsyncClient(base_url=stack.admin_url) as admin:
        after = (await admin.get("/status")).json()
    assert (after["config_hash"], after["generation"]) == (
        before["config_hash"],
        before["generation"],
    )
    assert stack.pids() == pids
    reasons = [e["reason"] for e in await asyncio.to_thread(edgeconfigs.events, "demo")]
    assert "InvalidSpec" in reasons

    # Fixed: applied as usual.
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    await asyncio.to_thread(edgeconfigs.wait, "demo", generation=3)
