"""Whole reconcile passes for the restart gates that compare new with old (real in-process Edges,
real Node agents, a real fake upstream, and the fake Kubernetes API holding the workloads): a
node's new process is held to the old one's health, an Edge's new pod to the old pods' requests
in the same stretch. What the old ones were is kept in the applied record, so an operator
restarted while the new ones come up still holds them to it and puts the workload back on its
last good template by itself."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from iop.edge import EdgeServer
from iop.edgeconfig import config_hash, load_data
from iop.fakes import FakeUpstream
from iop.node import NodeAgent
from iop.operator import conventions
from iop.operator.values import EdgeReplica
from testkit import CLIENT_TOKEN, find_provider, provider
from tests.conftest import build_document

from .test_revisions_replicas import Cluster, admin_call
from .test_revisions_replicas import cluster as cluster  # the fixture, used by name

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

NODE_DEPLOYMENT = "/apis/apps/v1/namespaces/ns/deployments/demo-node-1"
EDGE_DEPLOYMENT = "/apis/apps/v1/namespaces/ns/deployments/demo-edge"
RECORD = f"/api/v1/namespaces/ns/configmaps/{conventions.state_configmap_name('demo')}"
#: Probes every 0.2 s, and one failure marks a provider unhealthy: the test waits little.
HEALTH = {"path": "/v1/models", "interval_ms": 200, "timeout_ms": 500, "failure_threshold": 1}


def deployment(name: str, labels: dict[str, str], replicas: int = 1) -> dict[str, Any]:
    """A workload of EdgeConfig demo, rolled out, its template stamped with nothing yet."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "generation": 1,
            "labels": {conventions.EDGECONFIG_LABEL: "demo", **labels},
        },
        "spec": {"replicas": replicas, "template": {"metadata": {"annotations": {}}}},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "availableReplicas": replicas,
            "conditions": [
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
            ],
        },
    }


def node_deployment() -> dict[str, Any]:
    labels = {conventions.COMPONENT_LABEL: conventions.COMPONENT_NODE}
    return deployment("demo-node-1", {**labels, conventions.NODE_ID_LABEL: "node-1"})


def stamp_of(cluster: Cluster, path: str) -> str | None:
    template = cluster.fake.objects[path]["spec"]["template"]["metadata"]
    found: str | None = (template.get("annotations") or {}).get(conventions.CONFIG_HASH_ANNOTATION)
    return found


@pytest.fixture
def upstream_document(fake_upstream: FakeUpstream) -> dict[str, Any]:
    """Model m on node-1's provider pa, an OpenAI server that answers; a change applies to all."""
    adapter = {"type": "openai", "base_url": fake_upstream.base_url}
    built = build_document([provider("pa", adapter, served="served-a", health=HEALTH)], admin=True)
    built["rollout"] = {"mode": "off"}
    return built


@pytest.fixture
async def edges(
    start_edge: Callable[..., Awaitable[EdgeServer]], upstream_document: dict[str, Any]
) -> tuple[EdgeServer]:
    return (await start_edge(upstream_document),)


async def node_view(edge: EdgeServer) -> dict[str, Any]:
    (view,) = (await admin_call(edge, "GET", "/status"))["nodes"]
    return dict(view)


async def test_a_node_restarts_gate_holds_across_an_operator_restart(
    cluster: Cluster,
    edges: tuple[EdgeServer],
    upstream_document: dict[str, Any],
    start_node: Callable[..., Awaitable[NodeAgent]],
    until: Callable[..., Awaitable[Any]],
) -> None:
    (edge,) = edges
    old_node = await start_node(edge.hub)
    cluster.fake.objects[NODE_DEPLOYMENT] = node_deployment()
    await until(lambda: edge.hub.connected_providers()["pa"].healthy)
    cluster.set_spec(upstream_document)
    await cluster.reconcile()
    await cluster.reconcile()  # the revision came through: the stable one, node-1 seen healthy

    # pa moved to a closed port: valid, and a restart of node-1 (its adapter changed).
    moved = copy.deepcopy(upstream_document)
    find_provider(moved, "pa")["adapter"]["base_url"] = "http://127.0.0.1:9/v1"
    digest = config_hash(load_data(moved))
    cluster.set_spec(moved)
    await cluster.reconcile()
    assert stamp_of(cluster, NODE_DEPLOYMENT) == digest
    kept = orjson.loads(cluster.fake.objects[RECORD]["data"]["nodeBaselines"])
    assert kept["node:node-1"]["configHash"] == digest
    assert kept["node:node-1"]["healthy"] == ["pa"]

    # The operator restarts while node-1's new process comes up (the Deployment rolled it).
    await cluster.restart()
    await old_node.stop()
    new_node = await start_node(edge.hub)
    assert new_node.identity.instance_id not in kept["node:node-1"]["instances"]

    async def worse() -> bool:
        view = await node_view(edge)
        return view["instance_id"] == new_node.identity.instance_id and any(
            p["provider_id"] == "pa" and not p["healthy"] and p["reason"] != "not_probed"
            for p in view["providers"]
        )

    await until(worse)
    await cluster.reconcile()

    assert stamp_of(cluster, NODE_DEPLOYMENT) is None  # back on its last good template
    (newest, *_) = cluster.status["history"]
    assert (newest["outcome"], newest["check"]) == ("RolledBack", "restart")
    assert "its new process serves worse than the old one: provider pa" in newest["reason"]
    assert "nodeBaselines" not in cluster.fake.objects[RECORD]["data"]  # the restart is over


class EdgePods:
    """The Edge's pods as the Deployment controller leaves them (a `ReplicaFinder`): each one's
    admin API and the stamp of the template it was created from."""

    def __init__(self) -> None:
        self.found: list[EdgeReplica] = []

    def add(self, name: str, edge: EdgeServer, stamp: str) -> None:
        self.found.append(EdgeReplica(name, name, str(edge.admin_url), True, stamp))

    async def replicas(self, namespace: str, name: str, admin_port: int) -> list[EdgeReplica]:
        return list(self.found)


async def chats(edge: EdgeServer, count: int) -> list[int]:
    """`count` chat completions on `edge`, at most the provider's capacity (8) of them in flight,
    so that on a pod that serves none waits in its queue (200 ms, which a busy machine's requests
    ahead can outlast): their statuses."""
    in_flight = asyncio.Semaphore(8)
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}

        async def chat() -> int:
            async with in_flight:
                answer = await http.post("/v1/chat/completions", json=body, headers=headers)
            return answer.status_code

        return await asyncio.gather(*(chat() for _ in range(count)))


async def test_an_edge_restarts_new_pod_that_serves_worse_goes_back_across_an_operator_restart(
    cluster: Cluster,
    start_edge: Callable[..., Awaitable[EdgeServer]],
    start_node: Callable[..., Awaitable[NodeAgent]],
) -> None:
    """A restart-required change whose new Edge pod is ready but cannot serve (no Node reaches
    it: its requests wait out their queue and fail) beside an old pod that serves: the new
    pod's failures against the old pod's, in the same stretch, put the Edge back on its last
    good template; the old pod's figures at the stamp were kept across an operator restart."""
    document = build_document([provider("pa", served="served-a", queue_timeout_ms=200)], admin=True)
    document["rollout"] = {"mode": "watch"}
    old = await start_edge(document)
    await start_node(old.hub)
    pods = EdgePods()
    pods.add("demo-edge-old", old, "")
    cluster.finder = pods
    await cluster.restart()
    labels = {conventions.COMPONENT_LABEL: conventions.COMPONENT_EDGE}
    cluster.fake.objects[EDGE_DEPLOYMENT] = deployment("demo-edge", labels)
    cluster.set_spec(document)
    await cluster.reconcile()
    assert await chats(old, 5) == [200] * 5
    await cluster.reconcile()  # (what the old pod served, as the operator last read it)

    # A listener's cap changed: valid, and a restart of the Edge.
    changed = copy.deepcopy(document)
    changed["openai"]["max_connections"] = 100
    digest = config_hash(load_data(changed))
    cluster.set_spec(changed)
    await cluster.reconcile()
    assert stamp_of(cluster, EDGE_DEPLOYMENT) == digest
    kept = orjson.loads(cluster.fake.objects[RECORD]["data"]["edgeBaseline"])
    assert kept["configHash"] == digest
    assert kept["replicas"]["demo-edge-old"]["requests"] == 5

    # The controller's surge pod, ready and on the new config; the old one serves beside it.
    status = cluster.fake.objects[EDGE_DEPLOYMENT]["status"]
    status.update(replicas=2, updatedReplicas=1)  # one old replica pending termination
    new = await start_edge(changed)
    pods.add("demo-edge-new", new, digest)
    await cluster.restart()  # and the operator restarts meanwhile
    served_old, served_new = await asyncio.gather(chats(old, 25), chats(new, 25))
    assert served_old == [200] * 25 and set(served_new) == {503}
    await cluster.reconcile()

    assert stamp_of(cluster, EDGE_DEPLOYMENT) is None  # back on its last good template
    (newest, *_) = cluster.status["history"]
    assert (newest["outcome"], newest["check"]) == ("RolledBack", "restart")
    assert (
        "its new pods serve worse than the old ones since the restart (errors): 100.0% of "
        "requests failed or needed a retry (25 failed, 0 retried of 25); the last good "
        "revision had 0.0%"
    ) in newest["reason"]
    assert "edgeBaseline" not in cluster.fake.objects[RECORD]["data"]  # the restart is over


async def test_a_nodes_new_process_welcomed_before_a_replica_took_the_change_gets_it_there(
    cluster: Cluster,
    start_edge: Callable[..., Awaitable[EdgeServer]],
    start_node: Callable[..., Awaitable[NodeAgent]],
    until: Callable[..., Awaitable[Any]],
) -> None:
    """node-1's restart for an adapter change, while Edge pod b is not ready (a pod starting):
    the operator stamps node-1's workload and applies the change on pod a only. node-1's new
    process connects to both: pod a welcomes it with the new payload, pod b with the old one.
    When pod b takes the change, it pushes it to that process (not among the processes the
    restart replaces, which the operator names from the node's baseline) rather than hold it
    for a restart that already happened, so the node runs the new payload everywhere."""
    document = build_document([provider("pa", served="served-a")], admin=True)
    document["rollout"] = {"mode": "off"}
    first, late = await start_edge(document), await start_edge(document)
    old_node = await start_node(first.hub, late.hub)
    pods = EdgePods()
    pods.add("demo-edge-a", first, "")
    pods.add("demo-edge-b", late, "")
    cluster.finder = pods
    await cluster.restart()
    cluster.fake.objects[NODE_DEPLOYMENT] = node_deployment()
    cluster.set_spec(document)
    await cluster.reconcile()
    await cluster.reconcile()  # node-1 as both pods see it: the baseline of its restart

    changed = copy.deepcopy(document)
    find_provider(changed, "pa")["adapter"]["completion_tokens"] = 5
    digest = config_hash(load_data(changed))
    expected = (await admin_call(first, "GET", "/status"))["nodes"][0]["expected_hash"]
    pods.found.pop()  # pod b is not ready
    cluster.set_spec(changed)
    await cluster.reconcile()
    assert stamp_of(cluster, NODE_DEPLOYMENT) == digest
    kept = orjson.loads(cluster.fake.objects[RECORD]["data"]["nodeBaselines"])
    assert kept["node:node-1"]["instances"] == [old_node.identity.instance_id]

    await old_node.stop()
    new_node = await start_node(first.hub, late.hub)
    new_payload = (await node_view(first))["expected_hash"]
    assert new_payload != expected
    await until(lambda: new_node.runner.registry.digest)
    pods.add("demo-edge-b", late, "")  # ready now, on the old config
    await cluster.reconcile()

    await until(lambda: new_node.runner.registry.digest == new_payload)
    for edge in (first, late):
        view = await node_view(edge)
        assert (view["instance_id"], view["current"]) == (new_node.identity.instance_id, True)
