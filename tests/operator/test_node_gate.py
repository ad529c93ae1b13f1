"""Whole reconcile passes for a node restart's gate (a real in-process Edge, real Node agents, a
real fake upstream, and the fake Kubernetes API holding the node's Deployment): the node as it
was before its restart is kept in the applied record, so an operator restarted while the node's
new process comes up still holds that process to the old one and puts the node back on its last
good template by itself."""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from iop.edge import EdgeServer
from iop.edgeconfig import config_hash, load_data
from iop.fakes import FakeUpstream
from iop.node import NodeAgent
from iop.operator import conventions
from testkit import find_provider, provider
from tests.conftest import build_document

from .test_revisions_replicas import Cluster, admin_call
from .test_revisions_replicas import cluster as cluster  # the fixture, used by name

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

NODE_DEPLOYMENT = "/apis/apps/v1/namespaces/ns/deployments/demo-node-1"
RECORD = f"/api/v1/namespaces/ns/configmaps/{conventions.state_configmap_name('demo')}"
#: Probes every 0.2 s, and one failure marks a provider unhealthy: the test waits little.
HEALTH = {"path": "/v1/models", "interval_ms": 200, "timeout_ms": 500, "failure_threshold": 1}


def node_deployment(stamp: str = "") -> dict[str, Any]:
    """node-1's Deployment, rolled out (its template stamped with `stamp`, or not at all)."""
    annotations = {conventions.CONFIG_HASH_ANNOTATION: stamp} if stamp else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "demo-node-1",
            "namespace": "ns",
            "generation": 1,
            "labels": {
                conventions.EDGECONFIG_LABEL: "demo",
                conventions.COMPONENT_LABEL: conventions.COMPONENT_NODE,
                conventions.NODE_ID_LABEL: "node-1",
            },
        },
        "spec": {"replicas": 1, "template": {"metadata": {"annotations": annotations}}},
        "status": {
            "observedGeneration": 1,
            "replicas": 1,
            "updatedReplicas": 1,
            "availableReplicas": 1,
            "conditions": [
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
            ],
        },
    }


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
    template = cluster.fake.objects[NODE_DEPLOYMENT]["spec"]["template"]["metadata"]
    assert template["annotations"][conventions.CONFIG_HASH_ANNOTATION] == digest
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
    cluster.fake.objects[NODE_DEPLOYMENT]["spec"]["template"]["metadata"] = template
    await cluster.reconcile()

    template = cluster.fake.objects[NODE_DEPLOYMENT]["spec"]["template"]["metadata"]
    assert conventions.CONFIG_HASH_ANNOTATION not in (template.get("annotations") or {})
    (newest, *_) = cluster.status["history"]
    assert (newest["outcome"], newest["check"]) == ("RolledBack", "restart")
    assert "its new process serves worse than the old one: provider pa" in newest["reason"]
    assert "nodeBaselines" not in cluster.fake.objects[RECORD]["data"]  # the restart is over
