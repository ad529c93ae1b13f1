"""Whole reconcile passes (two real in-process Edges, the fake Kubernetes API holding the Edge's
Deployment): what the Edge ConfigMap holds while a live change is on trial and after it is
rolled back (the stable config, so an Edge pod that starts then starts on it), and a restart
that fails its gate (the Deployment's progress deadline passes before its first new pod is
available) put back on the last good pod template by the operator alone; and the emergency pin
(`iop.dev/pin-revision: stable`)."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from iop.edge import EdgeServer
from iop.edgeconfig import config_hash, load_data
from iop.operator import conventions

from .test_revisions_replicas import (
    PATH,
    Cluster,
    admin_call,
    cluster,
    document,
    edges,
    history,
    with_capacity,
)

__all__ = ["cluster", "edges"]  # the fixtures, used by name

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

DEPLOYMENT = "/apis/apps/v1/namespaces/ns/deployments/demo-edge"
CONFIGMAP = "/api/v1/namespaces/ns/configmaps/demo-edge"


def edge_deployment(stamp: str = "", *, stalled: bool = False) -> dict[str, Any]:
    """The Edge's Deployment as the controller leaves it: rolled out, or past its deadline."""
    annotations = {conventions.CONFIG_HASH_ANNOTATION: stamp} if stamp else {}
    condition = {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
    if stalled:
        condition = {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": 'ReplicaSet "demo-edge-7f9" has timed out progressing.',
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "demo-edge",
            "namespace": "ns",
            "generation": 1,
            "labels": {
                conventions.EDGECONFIG_LABEL: "demo",
                conventions.COMPONENT_LABEL: conventions.COMPONENT_EDGE,
            },
        },
        "spec": {"replicas": 2, "template": {"metadata": {"annotations": annotations}}},
        "status": {
            "observedGeneration": 1,
            "replicas": 3 if stalled else 2,
            "updatedReplicas": 1 if stalled else 2,
            "availableReplicas": 2,
            "conditions": [condition],
        },
    }


def configmap_hash(cluster: Cluster) -> str:
    """The hash of the config the Edge ConfigMap holds (what a starting pod runs)."""
    found = cluster.fake.objects[CONFIGMAP]
    text = found["data"][conventions.CONFIG_KEY]
    return config_hash(load_data(orjson.loads(text)))


def stamp_of(cluster: Cluster) -> str | None:
    template = cluster.fake.objects[DEPLOYMENT]["spec"]["template"]["metadata"]
    annotations: dict[str, str] = template.get("annotations") or {}
    return annotations.get(conventions.CONFIG_HASH_ANNOTATION)


def conditions(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in cluster.status["conditions"]}


async def first_applied(cluster: Cluster) -> tuple[dict[str, Any], str]:
    """The base document applied as revision 1 (it comes through at once): it and its hash."""
    base = document()
    cluster.set_spec(base)
    await cluster.reconcile()
    return base, config_hash(load_data(base))


async def test_the_configmap_holds_the_stable_config_while_a_change_is_judged_and_after(
    cluster: Cluster, edges: tuple[EdgeServer, EdgeServer]
) -> None:
    a, b = edges
    base, stable_hash = await first_applied(cluster)
    assert configmap_hash(cluster) == stable_hash

    changed = with_capacity(base, 6)
    cluster.set_spec(changed)
    await cluster.reconcile()
    assert history(cluster) == [(2, "Watching"), (1, "Applied")]
    # Both replicas judge it; a pod that started now would start on the stable config and be
    # given the candidate live (judged again), not take it as its first, unjudged revision.
    assert a.refresher.current.config_hash == config_hash(load_data(changed))
    assert configmap_hash(cluster) == stable_hash

    await admin_call(a, "POST", "/rollout", action="roll_back")
    await cluster.reconcile()
    assert history(cluster)[0] == (2, "RolledBack")
    assert configmap_hash(cluster) == stable_hash

    fixed = with_capacity(base, 8)
    fixed_hash = config_hash(load_data(fixed))
    cluster.set_spec(fixed)
    await cluster.reconcile()
    assert configmap_hash(cluster) == stable_hash  # on trial
    for edge in (a, b):
        await admin_call(edge, "POST", "/rollout", action="promote")
    await cluster.reconcile()
    assert history(cluster)[0] == (3, "Promoted")
    assert configmap_hash(cluster) == fixed_hash  # it came through: pods start on it


async def test_a_restart_past_its_progress_deadline_goes_back_to_the_last_good_template(
    cluster: Cluster, edges: tuple[EdgeServer, EdgeServer]
) -> None:
    a, b = edges
    cluster.fake.objects[DEPLOYMENT] = edge_deployment()
    base, stable_hash = await first_applied(cluster)
    assert history(cluster) == [(1, "Applied")]

    # A restart-required change of the Edge: its workload is stamped (the controller rolls it,
    # one surge pod first); the replicas keep the stable config until their pods are new.
    changed = copy.deepcopy(base)
    changed["openai"]["allow_unauthenticated"] = True
    changed_hash = config_hash(load_data(changed))
    cluster.set_spec(changed)
    await cluster.reconcile()
    assert stamp_of(cluster) == changed_hash
    assert configmap_hash(cluster) == changed_hash  # the new pods start on it
    assert history(cluster) == [(2, "Applying"), (1, "Applied")]
    assert a.refresher.current.config_hash == stable_hash

    # The surge pod never becomes ready: the controller reports the deadline passed.
    cluster.fake.objects[DEPLOYMENT] = edge_deployment(changed_hash, stalled=True)
    await cluster.reconcile()
    assert stamp_of(cluster) is None  # the template it had: the old ReplicaSet's again
    assert configmap_hash(cluster) == stable_hash
    assert history(cluster) == [(2, "RolledBack"), (1, "Applied")]
    entry = cluster.status["history"][0]
    assert entry["check"] == "restart"
    assert "Deployment/demo-edge (edge): progress deadline exceeded" in entry["reason"]
    stalled = conditions(cluster)["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "RolledBack")
    assert conditions(cluster)["Ready"]["status"] == "False"
    rolled = [m for _, reason, m in cluster.events.posted if reason == "RolledBack"]
    assert len(rolled) == 1 and "revision 1 serves again" in rolled[0], rolled
    assert a.refresher.current.config_hash == b.refresher.current.config_hash == stable_hash

    # Held back: later passes (and an operator restart) stamp nothing again.
    cluster.fake.objects[DEPLOYMENT] = edge_deployment()
    await cluster.restart()
    await cluster.reconcile()
    assert stamp_of(cluster) is None
    assert history(cluster) == [(2, "RolledBack"), (1, "Applied")]

    # Back to the old file, the GitOps way: it is the stable revision, and rolls nothing.
    cluster.set_spec(base)
    await cluster.reconcile()
    assert stamp_of(cluster) is None
    assert history(cluster)[0] == (3, "Applied")
    assert cluster.status["history"][0]["restores"] == 1
    assert conditions(cluster)["Stalled"]["status"] == "False"
    assert configmap_hash(cluster) == stable_hash


async def test_a_pin_holds_the_stable_revision_until_it_goes(
    cluster: Cluster, edges: tuple[EdgeServer, EdgeServer]
) -> None:
    a, b = edges
    base, stable_hash = await first_applied(cluster)
    changed = with_capacity(base, 6)
    changed_hash = config_hash(load_data(changed))
    cluster.set_spec(changed)
    await cluster.reconcile()
    assert history(cluster) == [(2, "Watching"), (1, "Applied")]

    # An emergency: pinned while the change is watched, with the spec unchanged.
    cluster.fake.objects[PATH]["metadata"]["annotations"] = {conventions.PIN_ANNOTATION: "stable"}
    await cluster.reconcile()
    assert a.refresher.current.config_hash == b.refresher.current.config_hash == stable_hash
    assert history(cluster) == [(3, "Applied"), (2, "Superseded"), (1, "Applied")]
    assert cluster.status["history"][0]["restores"] == 1
    assert configmap_hash(cluster) == stable_hash
    pinned = [m for _, reason, m in cluster.events.posted if reason == "Pinned"]
    assert pinned == [
        f"iop.dev/pin-revision=stable: the stable config {stable_hash[:12]} is held in effect "
        "in place of the spec; remove the annotation to apply the spec"
    ]
    await cluster.reconcile()  # held: nothing moves
    assert history(cluster)[0] == (3, "Applied")

    # Unpinned: the spec's config is a new revision, judged again.
    del cluster.fake.objects[PATH]["metadata"]["annotations"]  # (status writes store anew)
    await cluster.reconcile()
    assert a.refresher.current.config_hash == changed_hash
    assert history(cluster)[0] == (4, "Watching")


async def test_a_pin_with_nothing_to_hold_is_ignored_and_said(cluster: Cluster) -> None:
    base = document()
    cluster.set_spec(base)
    cluster.fake.objects[PATH]["metadata"]["annotations"] = {conventions.PIN_ANNOTATION: "stable"}
    await cluster.reconcile()  # the first config: no stable revision yet
    assert history(cluster) == [(1, "Applied")]
    (said,) = [m for _, reason, m in cluster.events.posted if reason == "PinIgnored"]
    assert "has no stable revision to hold yet" in said
