"""Cluster revisions through the real API server: a live change applied with `kubectl apply` is
revision 2 in `.status.history`, followed while the Edge judges it (no spec change wakes the
operator) to Promoted, or to RolledBack for a change that hurts; `kubectl get ec -o wide` shows
the revision and the rollout's state (printer columns the API server serves), the Events name
the revision once each, and `iop config history` lists it all.

The Edge and its Nodes run on the host (`host_stack`), the operator told their admin API.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from typing import TYPE_CHECKING, Any

import pytest

from iop.processes import iop_command
from testkit import find_provider
from tests.waiting import wait_for

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster
    from e2e.operator.conftest import EdgeConfigs, HostStack

pytestmark = pytest.mark.e2e

#: Quick to judge: three requests and a second of bake; a canary at half, then all.
ROLLOUT = {"bakeMs": 1000, "minRequests": 3, "maxWaitMs": 60000, "steps": [50, 100], "stepMs": 1000}
#: Each request a conversation of its own (a canary shares conversations).
_conversations = itertools.count()


async def one_request(stack: HostStack, model: str = "m") -> None:
    async with stack.client() as client:
        content = f"conversation {next(_conversations)}"
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}]
        )


async def serve_until(stack: HostStack, edgeconfigs: EdgeConfigs, outcome: str) -> dict[str, Any]:
    """Requests for `m`, one after another, until revision 2's outcome is `outcome` (what the
    Edge judges them by); the EdgeConfig then."""
    for _ in range(600):
        ec = await asyncio.to_thread(edgeconfigs.get, "demo")
        history = ec.get("status", {}).get("history") or []
        if history and history[0]["revision"] == 2 and history[0]["outcome"] == outcome:
            return ec
        await one_request(stack)
    pytest.fail(f"revision 2 never became {outcome}: {json.dumps(ec.get('status'), indent=1)}")


def wide(cluster: KubeCluster, namespace: str) -> dict[str, str]:
    """`kubectl get ec demo -o wide`, as header -> value."""
    lines = cluster.kubectl("get", "ec", "demo", "-n", namespace, "-o", "wide").stdout.splitlines()
    header, row = lines[0], lines[1]
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}


def reasons(edgeconfigs: EdgeConfigs) -> list[str]:
    return [e["reason"] for e in edgeconfigs.events("demo")]


async def test_a_live_change_is_a_revision_followed_to_promoted(
    operated, edgeconfigs, host_spec, kube_cluster, namespace
) -> None:
    spec = host_spec()
    spec["rollout"] = dict(ROLLOUT)
    stack = await operated(spec)
    ec = await asyncio.to_thread(edgeconfigs.get, "demo")
    assert [(e["revision"], e["outcome"]) for e in ec["status"]["history"]] == [(1, "Applied")]
    assert ec["status"]["revision"] == 1

    for _ in range(3):  # the stable revision's own figures
        await one_request(stack)
    changed = copy.deepcopy(spec)
    find_provider(changed, "pa")["priority"] = 20  # m now goes to pb: a touched model
    await asyncio.to_thread(edgeconfigs.apply, "demo", changed)
    await asyncio.to_thread(edgeconfigs.wait, "demo", generation=2)

    ec = await serve_until(stack, edgeconfigs, "Promoted")
    newest = ec["status"]["history"][0]
    assert newest["generation"] == 2
    assert newest["configHash"] == ec["status"]["desiredConfigHash"]
    assert newest["livePaths"] == ["nodes[node-1].providers[pa].priority"]
    assert newest["check"] == "bake"
    assert [e["revision"] for e in ec["status"]["history"]] == [2, 1]
    assert ec["status"]["rollout"]["state"] == "Promoted"
    wait_for(
        lambda: wide(kube_cluster, namespace).get("REVISION") == "2",
        timeout=30,
        what="the Revision column to say 2",
    )
    columns = wide(kube_cluster, namespace)
    assert (columns["REVISION"], columns["ROLLOUT"], columns["READY"]) == ("2", "Promoted", "True")
    seen = await asyncio.to_thread(reasons, edgeconfigs)
    assert seen.count("Watching") == 1 and seen.count("Promoted") == 1
    promoted = next(e for e in edgeconfigs.events("demo") if e["reason"] == "Promoted")
    assert promoted["message"].startswith("revision 2 (generation 2, config ")

    listed = await asyncio.create_subprocess_exec(
        *iop_command(),
        "config", "history", "--name", "demo", "-n", namespace,
        "--kubeconfig", str(kube_cluster.kubeconfig),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await listed.communicate()
    assert listed.returncode == 0
    lines = out.decode().splitlines()
    assert lines[1].startswith("*   2    2  ") and "Promoted" in lines[1]
    assert "nodes[node-1].providers[pa].priority" in lines[1]
    assert lines[2].startswith("    1    1  ") and "Applied" in lines[2]


async def test_a_change_that_hurts_is_rolled_back_and_a_new_spec_starts_over(
    operated, edgeconfigs, host_spec, kube_cluster, namespace
) -> None:
    spec = host_spec()
    spec["rollout"] = dict(ROLLOUT)
    stack = await operated(spec)
    for _ in range(3):  # the stable revision's own first tokens: pa answers at once
        await one_request(stack)
    slow = copy.deepcopy(spec)
    slow["models"][0]["providers"] = {"pd": "served-d"}  # m moved to the 1 s provider
    await asyncio.to_thread(edgeconfigs.apply, "demo", slow)

    ec = await serve_until(stack, edgeconfigs, "RolledBack")
    newest = ec["status"]["history"][0]
    assert newest["check"] == "first_token_p95"
    rollout = ec["status"]["rollout"]
    assert (rollout["state"], rollout["stable"]) == ("RolledBack", 1)
    assert rollout["rolledBackConfigHash"] == newest["configHash"]
    ec = await asyncio.to_thread(edgeconfigs.wait, "demo", "Stalled", "True", generation=2)
    assert {c["type"]: c for c in ec["status"]["conditions"]}["Stalled"]["reason"] == "RolledBack"
    columns = wide(kube_cluster, namespace)
    assert (columns["REVISION"], columns["ROLLOUT"]) == ("1", "RolledBack")
    rolled = [e for e in edgeconfigs.events("demo") if e["reason"] == "RolledBack"]
    assert len(rolled) == 1
    assert rolled[0]["message"].startswith("revision 2 (generation 2, config ")
    assert "first_token_p95" in rolled[0]["message"]
    # m moved to another provider: a change of what serves it, on canary first.
    assert (await asyncio.to_thread(reasons, edgeconfigs)).count("CanaryStarted") == 1

    fixed = copy.deepcopy(spec)
    find_provider(fixed, "pa")["capacity"] = 6  # another config: a new rollout
    await asyncio.to_thread(edgeconfigs.apply, "demo", fixed)
    ec = await asyncio.to_thread(edgeconfigs.wait, "demo", generation=3)
    assert [(e["revision"], e["outcome"]) for e in ec["status"]["history"]][1:] == [
        (2, "RolledBack"),
        (1, "Applied"),
    ]
    assert ec["status"]["history"][0]["revision"] == 3
