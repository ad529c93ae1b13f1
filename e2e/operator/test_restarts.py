"""Restart-required changes roll only the smallest scope, once, even across an operator restart.

The Edge and its Nodes run on the host (the operator reaches the Edge through `--edge-admin`);
the chart's workloads run on kwok's node, where the operator stamps and follows them. A restart
the operator cannot make itself (processes on the host) is made by hand, as for a Node on a
bare-metal host; `test_pods.py` has the same on pods the operator rolls for real.
"""

from __future__ import annotations

import asyncio
import copy
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from iop.edgeconfig import config_hash, load_data
from tests.waiting import wait_for

if TYPE_CHECKING:
    from e2e.operator.conftest import HostStack

# Each test waits for two rollouts and an operator restart: 35-60 s alone, up to 3x that beside
# the other clusters of a parallel run; the default 120 s bound is for single-step tests.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EDGE, NODE_1, NODE_2 = "demo-edge", "demo-node-node-1", "demo-node-node-2"


async def tokens_of(stack: HostStack, model: str) -> int:
    async with stack.client() as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}]
        )
    assert reply.usage is not None
    return reply.usage.completion_tokens


async def ready_with_workloads(host_stack, spec, start_operator, edgeconfigs, workloads):
    stack = await host_stack(spec)
    await stack.wait_available(["pa", "pb", "pc", "pd"])
    await asyncio.to_thread(workloads.install_kwok, ["node-1", "node-2"])
    operator = start_operator(edge_admins=[stack.admin_url])
    await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
    await asyncio.to_thread(edgeconfigs.wait, "demo")
    for name in (EDGE, NODE_1, NODE_2):
        await asyncio.to_thread(workloads.wait_rolled_out, name)
    return stack, operator


def waiting_for_node_2(ec: dict[str, Any]) -> bool:
    status = ec.get("status", {})
    return status.get("pendingRestart") == "node:node-2" and any(
        r["workload"] == f"Deployment/{NODE_2}" and r["state"] == "Complete"
        for r in status.get("rollouts", [])
    )


async def test_an_adapter_change_on_one_node_rolls_only_that_nodes_workload_once(
    host_stack, host_spec, start_operator, edgeconfigs, workloads, kube_cluster
) -> None:
    spec = host_spec()
    stack, operator = await ready_with_workloads(
        host_stack, spec, start_operator, edgeconfigs, workloads
    )
    revisions = await asyncio.to_thread(workloads.revisions)
    assert await tokens_of(stack, "n") == 8
    pids = stack.pids()

    changed = copy.deepcopy(spec)
    changed["nodes"][1]["providers"][0]["adapter"]["completionTokens"] = 4
    changed["nodes"][0]["providers"][0]["capacity"] = 5  # a live path in the same change
    desired = config_hash(load_data(changed))
    await asyncio.to_thread(edgeconfigs.apply, "demo", changed)

    # Stamped and rolled: only node-2's workload; then it waits for node-2 to take the payload.
    ec = await asyncio.to_thread(edgeconfigs.wait, "demo", "Applied", "False", generation=2)
    await asyncio.to_thread(workloads.wait_rolled_out, NODE_2)
    found: dict[str, Any] = {}

    def waiting() -> bool:
        nonlocal found
        found = edgeconfigs.get("demo")
        return waiting_for_node_2(found)

    await asyncio.to_thread(edgeconfigs_wait, edgeconfigs, waiting)
    ec = found
    assert ec["status"]["lastChange"]["restartPaths"] == [
        {"path": "nodes[node-2].providers[pc].adapter.completionTokens", "scope": "node:node-2"}
    ]
    assert ec["status"]["lastChange"]["livePaths"] == ["nodes[node-1].providers[pa].capacity"]
    stamps = {name: workloads.stamp(name) for name in (EDGE, NODE_1, NODE_2)}
    assert stamps == {EDGE: "", NODE_1: "", NODE_2: desired}
    after = await asyncio.to_thread(workloads.revisions)
    assert after == {**revisions, NODE_2: revisions[NODE_2] + 1}
    # The Edge took the change live and held node-2's push: its running adapter is the old one.
    async with httpx.AsyncClient(base_url=stack.admin_url) as admin:
        assert (await admin.get("/status")).json()["config_hash"] == desired
    assert await tokens_of(stack, "n") == 8
    reasons = [e["reason"] for e in await asyncio.to_thread(edgeconfigs.events, "demo")]
    assert "Rolling" in reasons

    # The operator dies in the middle (stamped, not yet done) and comes back: nothing rolls again.
    operator.kill()
    start_operator(edge_admins=[stack.admin_url])

    # node-2 restarts by hand (the workload ran on kwok): it is welcomed with the new adapter.
    await stack.restart_node("node-2")
    ec = await asyncio.to_thread(edgeconfigs.wait, "demo", generation=2, timeout=90)
    assert ec["status"]["pendingRestart"] == "none"
    assert ec["status"]["nodesAcked"] == "2/2"
    assert await tokens_of(stack, "n") == 4
    assert await asyncio.to_thread(workloads.revisions) == after
    assert stack.pids()["edge"] == pids["edge"] and stack.pids()["node-1"] == pids["node-1"]


async def test_an_edge_restart_rolls_only_the_edge_workload(
    host_stack, host_spec, start_operator, edgeconfigs, workloads
) -> None:
    spec = host_spec()
    stack, _ = await ready_with_workloads(host_stack, spec, start_operator, edgeconfigs, workloads)
    revisions = await asyncio.to_thread(workloads.revisions)

    changed = copy.deepcopy(spec)
    changed["openai"]["allowUnauthenticated"] = True
    desired = config_hash(load_data(changed))
    await asyncio.to_thread(edgeconfigs.apply, "demo", changed)
    await asyncio.to_thread(edgeconfigs.wait, "demo", "Progressing", "True", generation=2)
    await asyncio.to_thread(workloads.wait_rolled_out, EDGE)

    assert {name: workloads.stamp(name) for name in (EDGE, NODE_1, NODE_2)} == {
        EDGE: desired,
        NODE_1: "",
        NODE_2: "",
    }
    assert await asyncio.to_thread(workloads.revisions) == {**revisions, EDGE: revisions[EDGE] + 1}
    ec = await asyncio.to_thread(edgeconfigs.get, "demo")
    assert ec["status"]["pendingRestart"] == "edge"
    assert [r["state"] for r in ec["status"]["replicas"]] == ["AwaitingRestart"]
    degraded = {c["type"]: c for c in ec["status"]["conditions"]}["Degraded"]
    assert degraded["status"] == "False"

    # The Edge (on the host, outside any workload) restarts by hand with the new config.
    await stack.restart_edge(changed)
    ec = await asyncio.to_thread(edgeconfigs.wait, "demo", generation=2, timeout=90)
    assert ec["status"]["appliedConfigHash"] == desired
    async with httpx.AsyncClient(base_url=stack.url) as http:  # no token: now allowed
        response = await http.post(
            "/v1/chat/completions",
            json={"model": "n", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert response.status_code == 200


def edgeconfigs_wait(edgeconfigs: Any, probe: Any, timeout: float = 60) -> None:
    wait_for(
        probe,
        timeout=timeout,
        interval=0.1,
        what="ec/demo",
        show=lambda: edgeconfigs.get("demo").get("status"),
    )
