"""Whole reconcile passes against two real in-process Edges (their admin API over sockets) and
the fake Kubernetes API: the cluster revisions follow the Edges' own logs, survive an operator
restart (a new reconciler reads the status back), and when one replica rolls a revision back
while the other promoted it, the operator puts the other back on the stable config, applies the
rolled-back one no more, and starts a new rollout for a new spec."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from iop.edge import EdgeServer
from iop.edgeconfig import config_hash, load_data
from iop.operator.adminapi import EdgeAdmin
from iop.operator.discovering import FixedReplicas, ReplicaFinder
from iop.operator.documents import Owner
from iop.operator.kubeapi import KubeApi
from iop.operator.reconciling import PassResult, Reconciler
from iop.operator.values import EventType
from testkit import edge_document, find_provider, provider

from .fakeapi import FakeApi, fake_api

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

PATH = "/apis/iop.dev/v1alpha1/namespaces/ns/edgeconfigs/demo"
#: A change touching `m` is watched until someone ends it (no traffic in this test).
WATCH_LONG = {"bake_ms": 600_000, "max_wait_ms": 600_000, "min_requests": 1000}


class Events:
    """Records what the reconciler posts (the EventPoster's `post`)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def post(self, owner: Owner, kind: EventType, reason: str, message: str) -> None:
        self.posted.append((kind, reason, message))

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.posted]


def document() -> dict[str, Any]:
    built = edge_document(
        {"local": [provider("pa", served="served-a", capacity=4)]},
        {"m": ["pa"]},
        placement="edge",
        admin=True,
    )
    built["rollout"] = dict(WATCH_LONG)
    return built


def with_capacity(base: dict[str, Any], capacity: int) -> dict[str, Any]:
    changed = copy.deepcopy(base)
    find_provider(changed, "pa")["capacity"] = capacity
    return changed


class Cluster:
    """The fake API holding one EdgeConfig, and an operator that can be restarted."""

    def __init__(self, fake: FakeApi, api: KubeApi, admin: EdgeAdmin, urls: list[str]) -> None:
        self.fake, self.api, self.admin, self.urls = fake, api, admin, urls
        #: Where the operator finds the replicas (the next `restart` takes a new one).
        self.finder: ReplicaFinder = FixedReplicas(urls)
        self.events = Events()
        self.reconciler = self._operator()
        self.generation = 0

    def _operator(self) -> Reconciler:
        return Reconciler(
            "ns",
            "demo",
            api=self.api,
            admin=self.admin,
            finder=self.finder,
            events=self.events,  # type: ignore[arg-type]
        )

    async def restart(self) -> None:
        await self.reconciler.stop()
        self.reconciler = self._operator()

    def set_spec(self, spec: dict[str, Any]) -> None:
        self.generation += 1
        found = self.fake.objects.get(PATH) or {"status": {}}
        self.fake.objects[PATH] = {
            "apiVersion": "iop.dev/v1alpha1",
            "kind": "EdgeConfig",
            "metadata": {
                "name": "demo",
                "namespace": "ns",
                "uid": "uid-1",
                "generation": self.generation,
                "resourceVersion": "1",
            },
            "spec": spec,
            "status": found.get("status") or {},
        }

    async def reconcile(self) -> PassResult:
        return await self.reconciler.reconcile(self.fake.objects[PATH], 0.0)

    @property
    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.fake.objects[PATH]["status"]
        return status


@pytest.fixture
async def edges(
    start_edge: Callable[..., Awaitable[EdgeServer]],
) -> tuple[EdgeServer, EdgeServer]:
    return await start_edge(document()), await start_edge(document())


@pytest.fixture
async def cluster(edges: tuple[EdgeServer, EdgeServer]) -> AsyncIterator[Cluster]:
    fake = FakeApi()
    admin = EdgeAdmin()
    await admin.start()
    try:
        async with fake_api(fake) as api:
            urls = [str(edge.admin_url) for edge in edges]
            built = Cluster(fake, api, admin, urls)
            try:
                yield built
            finally:
                await built.reconciler.stop()
    finally:
        await admin.stop()


async def admin_call(edge: EdgeServer, method: str, path: str, **body: Any) -> Any:
    async with httpx.AsyncClient(base_url=str(edge.admin_url), timeout=30) as client:
        response = await client.request(method, path, json=body or None)
    assert response.status_code == 200, response.text
    return response.json()


def history(cluster: Cluster) -> list[tuple[int, str]]:
    return [(e["revision"], e["outcome"]) for e in cluster.status["history"]]


async def test_one_replica_rolls_back_the_other_converges_and_a_new_spec_starts_over(
    cluster: Cluster, edges: tuple[EdgeServer, EdgeServer]
) -> None:
    a, b = edges
    base = document()
    stable_hash = config_hash(load_data(base))

    cluster.set_spec(base)
    await cluster.reconcile()
    assert history(cluster) == [(1, "Applied")]  # both run it from their start
    assert cluster.status["revision"] == 1
    assert cluster.status["rollout"]["state"] == "Applied"

    changed = with_capacity(base, 6)
    changed_hash = config_hash(load_data(changed))
    cluster.set_spec(changed)
    result = await cluster.reconcile()
    assert history(cluster) == [(2, "Watching"), (1, "Applied")]
    entry = cluster.status["history"][0]
    assert entry["configHash"] == changed_hash and entry["generation"] == 2
    assert entry["livePaths"] == ["nodes[local].providers[pa].capacity"]
    rollout = cluster.status["rollout"]
    assert (rollout["stable"], rollout["candidate"], rollout["state"]) == (1, 2, "Watching")
    assert result.recheck_after is not None and result.recheck_after <= 2.0  # it follows the Edges
    assert cluster.events.reasons().count("Watching") == 1

    # The Edges judge on their own: one rolls it back, the other promotes it.
    await admin_call(a, "POST", "/rollout", action="roll_back")
    await admin_call(b, "POST", "/rollout", action="promote")
    assert b.refresher.current.config_hash == changed_hash

    await cluster.restart()  # the new operator knows only the status
    await cluster.reconcile()
    assert history(cluster) == [(2, "RolledBack"), (1, "Applied")]
    assert b.refresher.current.config_hash == stable_hash  # put back on the stable config
    b_log = await admin_call(b, "GET", "/revisions")
    assert (b_log["revisions"][0]["revision"], b_log["revisions"][0]["restores"]) == (3, 1)
    rollout = cluster.status["rollout"]
    assert (rollout["stable"], rollout["state"]) == (1, "RolledBack")
    assert "candidate" not in rollout  # a merge patch's null removed it
    assert rollout["rolledBackConfigHash"] == changed_hash
    assert cluster.status["revision"] == 1
    conditions = {c["type"]: c for c in cluster.status["conditions"]}
    assert (conditions["Stalled"]["status"], conditions["Stalled"]["reason"]) == (
        "True",
        "RolledBack",
    )
    assert conditions["Ready"]["status"] == "False"
    assert {r["state"] for r in cluster.status["replicas"]} == {"Failed"}
    rolled = [m for _, reason, m in cluster.events.posted if reason == "RolledBack"]
    assert len(rolled) == 1 and rolled[0].startswith("revision 2 (generation 2")

    # Held back: another pass (and another restart) applies nothing and says nothing new.
    await cluster.restart()
    posted = len(cluster.events.posted)
    await cluster.reconcile()
    assert b.refresher.current.config_hash == stable_hash
    assert len((await admin_call(b, "GET", "/revisions"))["revisions"]) == 3
    assert cluster.events.reasons()[posted:].count("RolledBack") == 0
    assert history(cluster) == [(2, "RolledBack"), (1, "Applied")]

    # A new spec (another hash) is a new rollout, on both replicas.
    fixed = with_capacity(base, 8)
    cluster.set_spec(fixed)
    await cluster.reconcile()
    fixed_hash = config_hash(load_data(fixed))
    assert a.refresher.current.config_hash == b.refresher.current.config_hash == fixed_hash
    assert history(cluster) == [(3, "Watching"), (2, "RolledBack"), (1, "Applied")]
    conditions = {c["type"]: c for c in cluster.status["conditions"]}
    assert conditions["Stalled"]["status"] == "False"
    assert "rolledBackConfigHash" not in cluster.status["rollout"]
