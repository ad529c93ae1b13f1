"""Whole reconcile passes (two real in-process Edges, the fake Kubernetes API holding the Edge's
Deployment): what the Edge ConfigMap holds while a live change is on trial and after it is
rolled back (the stable config, so an Edge pod that starts then starts on it), and a restart
that fails its gate (the Deployment's progress deadline passes before its first new pod is
available) put back on the last good pod template by the operator alone; and the emergency pin
(`iop.dev/pin-revision: stable`, or a revision number: its config kept by the operator, read
back after an operator restart)."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from iop.edge import EdgeServer
from iop.edgeconfig import UpstreamPolicy, config_hash, load_data
from iop.operator import conventions
from iop.operator.discovering import FixedReplicas
from iop.operator.documents import KeptConfigs, Owner, kept_configmap
from iop.operator.reconciling import Reconciler
from testkit import find_provider

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
KEPT = "/api/v1/namespaces/ns/configmaps/demo-edge-revisions"


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


def pin(cluster: Cluster, value: str | None) -> None:
    """Set (or remove) the pin annotation, as `kubectl annotate` would."""
    metadata = cluster.fake.objects[PATH]["metadata"]
    metadata["annotations"] = {conventions.PIN_ANNOTATION: value} if value is not None else {}


def said(cluster: Cluster, reason: str) -> list[str]:
    return [m for _, why, m in cluster.events.posted if why == reason]


async def promoted(cluster: Cluster, edges: tuple[EdgeServer, EdgeServer]) -> None:
    """The change on trial promoted by both replicas, and the operator's pass that sees it."""
    for edge in edges:
        await admin_call(edge, "POST", "/rollout", action="promote")
    await cluster.reconcile()


async def three_revisions(
    cluster: Cluster, edges: tuple[EdgeServer, EdgeServer]
) -> list[tuple[dict[str, Any], str]]:
    """Revisions 1, 2 and 3 (capacities 4, 6, 8), each promoted: each document and its hash."""
    base, base_hash = await first_applied(cluster)
    made = [(base, base_hash)]
    for capacity in (6, 8):
        changed = with_capacity(base, capacity)
        cluster.set_spec(changed)
        await cluster.reconcile()
        await promoted(cluster, edges)
        made.append((changed, config_hash(load_data(changed))))
    assert history(cluster) == [(3, "Promoted"), (2, "Promoted"), (1, "Applied")]
    return made


async def test_a_pin_to_a_revision_number_holds_its_kept_config_across_an_operator_restart(
    cluster: Cluster, edges: tuple[EdgeServer, EdgeServer]
) -> None:
    a, b = edges
    (_, first_hash), (_, second_hash), (third, third_hash) = await three_revisions(cluster, edges)
    # Each config that came into effect is kept, by its hash, in a ConfigMap the EdgeConfig owns.
    kept = cluster.fake.objects[KEPT]
    assert kept["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert set(kept["binaryData"]) == {
        f"{h}.json.gz" for h in (first_hash, second_hash, third_hash)
    }
    assert [r["revision"] for r in orjson.loads(kept["data"]["revisions"])] == [3, 2, 1]

    # A new operator reads the kept configs only when a pin needs them.
    await cluster.restart()
    cluster.fake.calls.clear()
    await cluster.reconcile()
    assert ("GET", KEPT) not in cluster.fake.calls

    # Revision 1: neither the config last applied nor the stable one (revision 3): read back.
    pin(cluster, "1")
    await cluster.reconcile()
    assert ("GET", KEPT) in cluster.fake.calls
    assert a.refresher.current.config_hash == b.refresher.current.config_hash == first_hash
    assert history(cluster)[0] == (4, "Watching")  # judged as any change, live where it can
    assert cluster.status["history"][0]["restores"] == 1
    assert said(cluster, "Pinned") == [
        f"iop.dev/pin-revision=1: revision 1's config {first_hash[:12]} is held in effect in "
        "place of the spec; remove the annotation to apply the spec"
    ]
    await promoted(cluster, edges)
    assert history(cluster)[0] == (4, "Promoted")
    await cluster.reconcile()  # held: nothing moves
    assert history(cluster)[0] == (4, "Promoted")

    # Another revision while pinned: the pin moves, the spec still waits.
    pin(cluster, "2")
    await cluster.reconcile()
    assert a.refresher.current.config_hash == second_hash
    assert history(cluster)[0] == (5, "Watching")
    assert cluster.status["history"][0]["restores"] == 2
    kept = cluster.fake.objects[KEPT]
    assert [r["revision"] for r in orjson.loads(kept["data"]["revisions"])] == [5, 4, 3, 2, 1]

    # Unpinned: the spec (revision 3's config) is applied again, as a new revision.
    pin(cluster, None)
    await cluster.reconcile()
    assert a.refresher.current.config_hash == third_hash == config_hash(load_data(third))
    assert history(cluster)[0] == (6, "Watching")
    assert cluster.status["history"][0]["restores"] == 3

    # Pinned to revision 1 again: held again, and said again.
    pin(cluster, "1")
    await cluster.reconcile()
    assert a.refresher.current.config_hash == first_hash
    assert history(cluster)[0] == (7, "Applied")  # the Edges' stable config: no trial
    assert len([m for m in said(cluster, "Pinned") if "revision 1's config" in m]) == 2


@pytest.mark.parametrize(
    ("value", "why"),
    [
        pytest.param("9", "revision 9 is not in the history (revisions 1 to 3)", id="no-such"),
        pytest.param(
            "2",
            "the config of revision 2 ({hash}) is not kept (the operator keeps those of the "
            "revisions in the history, the newest first, up to 512 KiB compressed)",
            id="not-kept",
        ),
        pytest.param("latest", "the pin takes 'stable' or a revision number", id="not-a-pin"),
    ],
)
async def test_a_pin_that_cannot_be_held_is_ignored_and_said(
    cluster: Cluster, edges: tuple[EdgeServer, EdgeServer], value: str, why: str
) -> None:
    a, _ = edges
    made = await three_revisions(cluster, edges)
    (_, second_hash), (_, third_hash) = made[1], made[2]
    del cluster.fake.objects[KEPT]  # lost, and a new operator has no copy
    await cluster.restart()
    pin(cluster, value)
    await cluster.reconcile()
    assert said(cluster, "PinIgnored") == [
        f"iop.dev/pin-revision={value!r} is ignored: {why.format(hash=second_hash[:12])}; the "
        "spec is applied"
    ]
    assert said(cluster, "Pinned") == []
    assert a.refresher.current.config_hash == third_hash  # the spec's, as before
    assert history(cluster)[0] == (3, "Promoted")


async def test_a_pin_never_brings_back_what_the_upstream_policy_refuses_now(
    cluster: Cluster, edges: tuple[EdgeServer, EdgeServer]
) -> None:
    a, _ = edges
    # Revision 1 reached the cloud metadata address, kept before the platform set a policy.
    old = document()
    find_provider(old, "pa")["adapter"] = {
        "type": "openai",
        "base_url": "http://169.254.169.254/v1",
    }
    old_config = load_data(old)
    old_hash = config_hash(old_config)
    kept = KeptConfigs().keeping([(1, old_hash)], {old_hash: old_config})
    cluster.fake.objects[KEPT] = kept_configmap(Owner("demo", "ns", "uid-1"), kept)
    cluster.set_spec(document())
    cluster.fake.objects[PATH]["status"] = {
        "history": [
            {
                "revision": 1,
                "configHash": old_hash,
                "generation": 1,
                "appliedAt": "2026-12-02T09:12:41Z",
                "livePaths": [],
                "restartPaths": [],
                "outcome": "Applied",
            }
        ]
    }
    await cluster.reconciler.stop()
    cluster.reconciler = Reconciler(
        "ns",
        "demo",
        api=cluster.api,
        admin=cluster.admin,
        finder=FixedReplicas(cluster.urls),
        events=cluster.events,  # type: ignore[arg-type]
        policy=UpstreamPolicy(),  # no upstream at all (the fake adapters reach none)
    )
    pin(cluster, "1")
    await cluster.reconcile()
    assert said(cluster, "PinIgnored") == [
        f"iop.dev/pin-revision='1' is ignored: revision 1's config {old_hash[:12]} is not "
        "allowed now: nodes[0].providers[0].adapter.baseUrl: 169.254.169.254 is in a range the "
        "upstream policy denies; the spec is applied"
    ]
    assert a.refresher.current.config_hash == config_hash(load_data(document()))
    assert history(cluster)[0] == (2, "Applied")
