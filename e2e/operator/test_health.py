"""What kstatus and Argo CD make of real EdgeConfigs while the operator works on them.

kstatus is `sigs.k8s.io/cli-utils`' library itself (what Flux's health checks, Helm 4's `--wait`
and kstatus-based CI run), the Argo CD verdict is `deploy/argocd/edgeconfig-health.lua`
(e2e/tools/healthcheck.py). Every object these tests read is read by both, which must agree, and
kstatus must never say Current unless `Ready=True` holds for the object's newest generation: a
pipeline that waits on kstatus never reports success for a config that is not in effect.

The Edge and its Nodes run on the host (`--edge-admin`); the chart's workloads, where a test needs
them, run on kwok's node, where the operator stamps and follows them (as in test_restarts.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from e2e.operator.conftest import EdgeConfigs
from e2e.tools.healthcheck import HealthReaders, Reading
from iop.edgeconfig import config_hash, load_data
from tests.waiting import wait_for

# Each test starts an Edge, its Nodes and the operator; two also install the chart and go through
# a rollout: 1-3 minutes each on a shared 2-core machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EDGE, NODE_1, NODE_2 = "demo-edge", "demo-node-node-1", "demo-node-node-2"
#: Every provider of host_spec(), available once the Nodes on the host have connected.
PROVIDERS = ["pa", "pb", "pc", "pd"]
#: One mistake the API server's schema cannot see (the webhook would refuse it).
UNKNOWN_PROVIDER = 'models[0].providers.zz: unknown provider "zz"'


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}


def invalid(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec["models"][0]["providers"]["zz"] = "served-z"
    return spec


@dataclass
class Health:
    """Reads one EdgeConfig with kstatus and the Argo CD check, and checks every reading."""

    edgeconfigs: EdgeConfigs
    readers: HealthReaders
    name: str = "demo"
    #: (generation, kstatus status, kstatus message) of every reading, in order.
    seen: list[tuple[int, str, str]] = field(default_factory=list)

    def read(self) -> tuple[dict[str, Any], Reading]:
        obj = self.edgeconfigs.get(self.name)
        reading = self.readers.read_one(obj)
        generation = obj["metadata"]["generation"]
        self.seen.append((generation, reading.kstatus.status, reading.kstatus.message))
        where = f"ec/{self.name} generation {generation}: {json.dumps(obj.get('status'))}"
        assert reading.agree, f"kstatus {reading.kstatus} but Argo CD {reading.argocd} on {where}"
        if reading.kstatus.status == "Current":
            ready = conditions(obj).get("Ready", {})
            assert (
                obj["status"]["observedGeneration"],
                ready.get("status"),
                ready.get("observedGeneration"),
            ) == (generation, "True", generation), f"kstatus says Current on {where}"
        return obj, reading

    def until(
        self, wanted: Callable[[dict[str, Any], Reading], bool], what: str, timeout: float = 60
    ) -> tuple[dict[str, Any], Reading]:
        def holds() -> tuple[dict[str, Any], Reading] | None:
            obj, reading = self.read()
            return (obj, reading) if wanted(obj, reading) else None

        try:
            found: tuple[dict[str, Any], Reading] = wait_for(
                holds, timeout=timeout, what=f"{what} on ec/{self.name}", interval=0.1
            )
        except BaseException:
            print(f"kstatus readings (generation, status, message): {self.seen[-20:]}")
            raise
        return found

    def until_kstatus(self, status: str, timeout: float = 60) -> tuple[dict[str, Any], Reading]:
        return self.until(
            lambda _, reading: reading.kstatus.status == status, f"kstatus {status}", timeout
        )


@pytest.fixture
def health(edgeconfigs: EdgeConfigs, health_readers: HealthReaders) -> Health:
    return Health(edgeconfigs, health_readers)


async def test_a_new_edgeconfig_is_in_progress_until_it_is_ready_then_current(
    host_stack, host_spec, start_operator, edgeconfigs, health
) -> None:
    spec = host_spec()
    stack = await host_stack(spec)
    await stack.wait_available(PROVIDERS)

    # No operator yet: the EdgeConfig as the API server serves it before any reconcile.
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    _, reading = await asyncio.to_thread(health.read)
    assert (reading.kstatus.status, reading.argocd.status) == ("InProgress", "Progressing")

    start_operator(edge_admins=[stack.admin_url])
    obj, reading = await asyncio.to_thread(health.until_kstatus, "Current")

    assert reading.argocd.status == "Healthy"
    assert obj["metadata"]["generation"] == 1
    assert conditions(obj)["Applied"]["status"] == "True"
    assert {status for _, status, _ in health.seen} <= {"InProgress", "Current"}


async def test_an_invalid_spec_admitted_with_the_webhook_down_is_failed(
    kube_cluster, namespace, host_stack, host_spec, start_operator, edgeconfigs, health
) -> None:
    spec = host_spec()
    stack = await host_stack(spec)
    await stack.wait_available(PROVIDERS)
    operator = start_operator(edge_admins=[stack.admin_url])
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    await asyncio.to_thread(health.until_kstatus, "Current")

    # The operator down: its webhook is unreachable; failurePolicy Ignore admits the change.
    await asyncio.to_thread(operator.stop)
    await asyncio.to_thread(edgeconfigs.apply, "demo", invalid(spec))
    obj, reading = await asyncio.to_thread(health.read)
    assert obj["metadata"]["generation"] == 2
    assert (reading.kstatus.status, reading.argocd.status) == ("InProgress", "Progressing")

    # Back up, without a webhook: the pass refuses the spec, and says it is stuck.
    start_operator(edge_admins=[stack.admin_url], webhook=False)
    obj, reading = await asyncio.to_thread(health.until_kstatus, "Failed")

    stalled = conditions(obj)["Stalled"]
    assert (stalled["status"], stalled["reason"], stalled["observedGeneration"]) == (
        "True",
        "InvalidSpec",
        2,
    )
    assert UNKNOWN_PROVIDER in stalled["message"]
    assert reading.argocd.status == "Degraded"
    assert reading.kstatus.message == reading.argocd.message == stalled["message"]
    assert conditions(obj)["Reconciling"]["status"] == "False"
    assert obj["status"]["observedGeneration"] == 2

    # Fixed: InProgress again, then Current on the new generation.
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    obj, reading = await asyncio.to_thread(health.until_kstatus, "Current")
    assert obj["metadata"]["generation"] == 3
    assert reading.argocd.status == "Healthy"
    assert conditions(obj)["Stalled"]["status"] == "False"


async def ready_with_workloads(host_stack, spec, start_operator, edgeconfigs, workloads, health):
    stack = await host_stack(spec)
    await stack.wait_available(PROVIDERS)
    await asyncio.to_thread(workloads.install_kwok, ["node-1", "node-2"])
    start_operator(edge_admins=[stack.admin_url])
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    await asyncio.to_thread(health.until_kstatus, "Current")
    for name in (EDGE, NODE_1, NODE_2):
        await asyncio.to_thread(workloads.wait_rolled_out, name)
    return stack


def reconciling_on(generation: int) -> Callable[[dict[str, Any], Reading], bool]:
    """The operator has observed `generation` and says it works towards it."""

    def holds(obj: dict[str, Any], _: Any) -> bool:
        reconciling = conditions(obj).get("Reconciling", {})
        return (obj.get("status") or {}).get("observedGeneration") == generation and (
            reconciling.get("status"),
            reconciling.get("observedGeneration"),
        ) == ("True", generation)

    return holds


async def test_an_update_is_in_progress_until_the_new_generation_is_ready(
    host_stack, host_spec, start_operator, edgeconfigs, workloads, health
) -> None:
    spec = host_spec()
    stack = await ready_with_workloads(
        host_stack, spec, start_operator, edgeconfigs, workloads, health
    )

    # An Edge-scope restart: the operator rolls the Edge workload (on kwok), and the change is in
    # effect only once the Edge on the host runs it, which happens when the test restarts it.
    changed = copy.deepcopy(spec)
    changed["openai"]["allowUnauthenticated"] = True
    await asyncio.to_thread(edgeconfigs.apply, "demo", changed)
    obj, reading = await asyncio.to_thread(
        health.until, reconciling_on(2), "Reconciling=True of generation 2"
    )
    reconciling = conditions(obj)["Reconciling"]
    assert (reading.kstatus.status, reading.argocd.status) == ("InProgress", "Progressing")
    assert reading.kstatus.message == reading.argocd.message == reconciling["message"]

    # The Edge workload has rolled, but the Edge that serves still runs generation 1's config.
    await asyncio.to_thread(workloads.wait_rolled_out, EDGE)
    obj, reading = await asyncio.to_thread(health.read)
    assert (reading.kstatus.status, reading.argocd.status) == ("InProgress", "Progressing")
    assert conditions(obj)["Ready"]["status"] != "True"

    await stack.restart_edge(changed)
    obj, reading = await asyncio.to_thread(health.until_kstatus, "Current", 90)
    assert obj["metadata"]["generation"] == 2
    assert obj["status"]["appliedConfigHash"] == config_hash(load_data(changed))
    assert reading.argocd.status == "Healthy"
    assert conditions(obj)["Reconciling"]["status"] == "False"
    # Never Current between the update and its Ready (Health.read checks every reading).
    after = [status for generation, status, _ in health.seen if generation == 2]
    assert after[0] == "InProgress" and after[-1] == "Current"


async def test_a_rollout_past_its_progress_deadline_is_failed_and_rolled_back(
    kube_cluster, namespace, host_stack, host_spec, start_operator, edgeconfigs, workloads, health
) -> None:
    spec = host_spec()
    await ready_with_workloads(host_stack, spec, start_operator, edgeconfigs, workloads, health)
    # The Edge workload's new pods can land nowhere, and it gives a rollout 2 seconds (the
    # deadline must be longer than the chart's minReadySeconds, so that goes to 1 s).
    patch = {
        "spec": {
            "progressDeadlineSeconds": 2,
            "minReadySeconds": 1,
            "template": {"spec": {"nodeSelector": {"iop.dev/e2e": "nowhere"}}},
        }
    }
    await asyncio.to_thread(
        kube_cluster.kubectl,
        "patch", "deployment", EDGE, "-n", namespace, "--type=strategic", "-p", json.dumps(patch),
    )  # fmt: skip

    changed = copy.deepcopy(spec)
    changed["openai"]["allowUnauthenticated"] = True
    await asyncio.to_thread(edgeconfigs.apply, "demo", changed)
    obj, reading = await asyncio.to_thread(health.until_kstatus, "Failed", 90)

    # The restart failed its gate: the operator put the last good template back by itself.
    stalled = conditions(obj)["Stalled"]
    assert (stalled["status"], stalled["reason"], stalled["observedGeneration"]) == (
        "True",
        "RolledBack",
        2,
    )
    assert f"Deployment/{EDGE} (edge): progress deadline exceeded" in stalled["message"]
    template = workloads.deployment(EDGE)["spec"]["template"]["metadata"]
    assert "iop.dev/config-hash" not in (template.get("annotations") or {})
    assert reading.argocd.status == "Degraded"
    assert reading.kstatus.message == reading.argocd.message == stalled["message"]
    assert obj["metadata"]["generation"] == 2
