"""The operator on running pods: the product's chart installed (`deploy/helm/iop-edge`), the
operator itself a pod with its ServiceAccount's RBAC, the Edge (two replicas) and two Nodes run
by the process kubelet, requests through the Edge's Service with the official `openai` client
and the API key the chart generated.

- create -> Ready, every model served;
- each live class -> Applied with no pod restarted (same pod UIDs and PIDs), seen in requests;
- a restart at `edge` scope -> only the Edge pods roll, and the new pods serve the new config;
- a restart whose first new pod never becomes ready (the OpenAI listener moved off the port the
  Service targets) -> back on the last good template by the operator alone, one new pod at most;
- a node's restart whose new process serves worse (a provider moved to a closed port) -> back on
  its last good template, the node's model served again;
- an Edge pod that starts during a canary starts on the stable config and judges the candidate
  again from its first step;
- an adapter change on one node -> only that node's workload rolls;
- the operator killed in the middle of a roll -> it converges on restart, nothing rolls twice;
- a node's rollout under load -> no request lost, and its drain counted in the status;
- the Edge's rollout under load -> no connection through its Service lost;
- the webhook through its Service: an invalid spec refused with every path, the plan on a dry run.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import copy
import functools
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import httpx2
import openai
import pytest

from e2e.operator.conftest import Workloads
from testkit import find_provider
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

NAME = "demo"  # the release's fullnameOverride, so also the EdgeConfig's name
EDGE, NODE_1, NODE_2 = f"{NAME}-edge", f"{NAME}-node-node-1", f"{NAME}-node-node-2"
TOKEN_REF = "e2e-app"  # the principal token of host_spec
#: The Deployments' progress deadline: the gate of a restart.
GATE_S = 40


def chart_spec(host_spec: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The host-mode spec as the chart's `edgeConfig.spec`, without its token hashes: the chart
    generates every token into a Secret and puts its hash in. (It also sets the listeners and
    the admin API to its own ports and mounted token, over the host's.)"""
    spec = host_spec()
    for entry in [*spec["nodes"], *spec["openai"]["principalTokens"]]:
        del entry["tokenHashSha256"]
    return spec


@dataclass
class PodStack(Workloads):
    """The chart's release with its operator and running pods, and the EdgeConfig it made."""

    spec: dict[str, Any] = field(default_factory=dict)
    api_key: str = ""
    generation: int = 1

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, "-n", self.namespace, **kw)

    def get(self, *args: str) -> Any:
        return self.cluster.get(*args, "-n", self.namespace)

    def ec(self) -> dict[str, Any]:
        found: dict[str, Any] = self.get("ec", NAME)
        return found

    def pods(self, component: str) -> list[dict[str, Any]]:
        listed = self.get("pods", "-l", f"app.kubernetes.io/component={component}")["items"]
        return [p for p in listed if not p["metadata"].get("deletionTimestamp")]

    def identities(self) -> dict[str, tuple[str, str]]:
        """pod name -> (uid, containerID: iop://<pid>) for the Edge and Node pods."""
        found = {}
        for component in ("edge", "node"):
            for pod in self.pods(component):
                statuses = pod["status"].get("containerStatuses") or [{}]
                found[pod["metadata"]["name"]] = (
                    pod["metadata"]["uid"],
                    statuses[0].get("containerID", ""),
                )
        return found

    def scene(self) -> dict[str, Any]:
        """What a failed wait shows: each Edge and Node pod (ready, terminating) with its last
        log lines, and the EdgeConfig's status."""
        shown: dict[str, Any] = {"status": self.ec().get("status")}
        for pod in self.get("pods", "-l", "app.kubernetes.io/component in (edge,node)")["items"]:
            name = pod["metadata"]["name"]
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            log = self.kubectl("logs", name, "--tail=15", check=False)
            shown[name] = {
                "ready": conditions.get("Ready"),
                "terminating": bool(pod["metadata"].get("deletionTimestamp")),
                "ip": pod["status"].get("podIP"),
                "log": (log.stdout or log.stderr).splitlines(),
            }
        return shown

    def leader(self) -> str:
        """Who holds the Lease (the operator that reconciles): `POD_random`, or ""."""
        lease = self.get("lease", f"{NAME}-operator")
        return str(lease["spec"].get("holderIdentity") or "")

    def leader_pod(self) -> str:
        """The pod of the operator that holds the Lease."""
        return self.leader().rsplit("_", 1)[0]

    def secret(self, name: str, key: str) -> str:
        data = self.get("secret", name)["data"]
        return base64.b64decode(data[key]).decode()

    def base_url(self) -> str:
        service = self.get("service", f"{NAME}-openai")["spec"]
        return f"http://{service['clusterIP']}:{service['ports'][0]['port']}/v1"

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url(), api_key=self.api_key, max_retries=0, http_client=http_client()
        )

    def runs_in_flight(self, node_id: str) -> int:
        """The runs on `node_id` that the Edge pods' admin APIs count now (`GET /status`), the
        way the operator reads them (the chart's admin port and token)."""
        runs = 0
        for pod in self.pods("edge"):
            nodes = self.admin(pod, "/status")["nodes"]
            runs += sum(n["runs_in_flight"] for n in nodes if n["node_id"] == node_id)
        return runs

    def admin(self, pod: dict[str, Any], path: str) -> Any:
        """`GET path` on an Edge pod's admin API (the chart's port and token)."""
        token = self.secret(f"{NAME}-edge-admin", "token")
        response = httpx.get(
            f"http://{pod['status']['podIP']}:9090{path}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=5,
        )
        response.raise_for_status()
        return response.json()

    def routed(self) -> bool:
        """Whether the Edge's Service answers: kube-proxy follows the Service's endpoints a
        moment after they change."""
        try:
            response = httpx.get(
                f"{self.base_url()}/models",
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=httpx.Timeout(10, connect=2),
            )
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def apply(self, spec: dict[str, Any], *args: str) -> Any:
        manifest = {
            "apiVersion": "iop.dev/v1alpha1",
            "kind": "EdgeConfig",
            "metadata": {"name": NAME},
            "spec": spec,
        }
        return self.kubectl("apply", "-f", "-", *args, stdin=json.dumps(manifest))

    def change(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Apply `spec` as the next generation and wait until it is Ready."""
        self.apply(spec)
        self.generation += 1
        self.spec = spec
        return self.wait_ready(self.generation)

    def wait_ready(
        self, generation: int, timeout: float = 180, show: Callable[[], Any] | None = None
    ) -> dict[str, Any]:
        found: dict[str, Any] = {}

        def ready() -> bool:
            nonlocal found
            found = self.ec()
            status = found.get("status", {})
            conditions = {c["type"]: c for c in status.get("conditions", [])}
            got = conditions.get("Ready", {})
            return bool(
                status.get("observedGeneration") == generation
                and got.get("status") == "True"
                and got.get("observedGeneration") == generation
            )

        what = f"ec/{NAME} Ready for generation {generation}"
        wait_for(ready, timeout=timeout, what=what, show=show or (lambda: found.get("status")))
        return found


def http_client(**options: Any) -> httpx2.AsyncClient:
    """A client of the Edge's ClusterIP that dials again when a connection is refused or not
    answered (nothing was sent yet): until kube-proxy follows a rolled Service's endpoints, a
    connection may go to a pod that is gone. httpx2's, the library of the openai client it is
    given to (which takes httpx's only through a compatibility path)."""
    transport = httpx2.AsyncHTTPTransport(retries=5)
    return httpx2.AsyncClient(transport=transport, timeout=httpx2.Timeout(30, connect=2), **options)


@pytest.fixture(scope="module")
def pods(kube_cluster: Any, edgeconfig_crd: None, host_spec: Any) -> Iterator[PodStack]:
    """The chart installed with its operator, two Edge replicas, two Nodes, Ready; the spec as
    the chart made it (its listeners, its tokens' hashes), and the client API key it made."""
    namespace = f"e2e-pods-{secrets.token_hex(3)}"
    kube_cluster.kubectl("create", "namespace", namespace)
    webhook = f"{NAME}-{namespace}"  # the chart's ValidatingWebhookConfiguration
    values = {
        "fullnameOverride": NAME,
        # A restart's gate (its progress deadline) short enough for a test, long enough for a
        # good rollout on a loaded machine.
        "edge": {"replicas": 2, "progressDeadlineSeconds": GATE_S},
        "nodeDefaults": {"progressDeadlineSeconds": GATE_S},
        "nodes": [{"id": "node-1"}, {"id": "node-2"}],
        "edgeConfig": {"spec": chart_spec(host_spec)},
        # A Node's own loopback, which only a CIDR lets in: the closed port a test moves pc to.
        "upstreams": {"allow": ["127.0.0.1/32"]},
    }
    stack = PodStack(kube_cluster, namespace)
    try:
        stack.install(values)
        stack.spec = stack.wait_ready(1, timeout=240)["spec"]
        stack.api_key = stack.secret(f"{NAME}-api-keys", TOKEN_REF)
        for name in (EDGE, NODE_1, NODE_2):
            rolled_out = functools.partial(stack.rolled_out, name)
            wait_for(rolled_out, timeout=120, what=f"{name} to roll out")
        wait_for(
            lambda: stack.ec()["status"].get("nodesAcked") == "2/2",
            timeout=120,
            what="both nodes acked",
            show=lambda: stack.ec().get("status"),
        )
        wait_for(stack.routed, timeout=30, what="the Edge's Service to answer")
        yield stack
    finally:
        logs = kube_cluster.kubectl(
            "logs", f"deploy/{NAME}-operator", "-n", namespace, "--tail=200", check=False
        )
        print(f"--- operator log ---\n{logs.stdout}\n{logs.stderr}")
        kube_cluster.helm("uninstall", "iop", "-n", namespace, "--wait", check=False)
        kube_cluster.kubectl("delete", "validatingwebhookconfiguration", webhook, check=False)
        kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


async def served(stack: PodStack, model: str = "m", content: str = "hi") -> str:
    async with stack.client() as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}]
        )
    return reply.model


async def tokens(stack: PodStack, model: str) -> int:
    async with stack.client() as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}]
        )
    assert reply.usage is not None
    return reply.usage.completion_tokens


@contextlib.asynccontextmanager
async def under_load(stack: PodStack, model: str, workers: int = 4) -> AsyncIterator[list[str]]:
    """Requests for `model` sent back to back by `workers` clients for as long as the block runs;
    yields each answer's model, or `failed: <error>`."""
    done = asyncio.Event()
    outcomes: list[str] = []

    async def load() -> None:
        async with stack.client() as client:
            while not done.is_set():
                try:
                    reply = await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "hi"}]
                    )
                    outcomes.append(reply.model)
                except openai.APIError as error:
                    outcomes.append(f"failed: {error!r}")

    tasks = [asyncio.create_task(load(), name=f"load-{i}") for i in range(workers)]
    try:
        yield outcomes
    finally:
        done.set()
        await asyncio.gather(*tasks)


async def node_2_rolled_under_load(
    pods: PodStack, on_look: Callable[[], object] = lambda: None
) -> tuple[set[str], list[str]]:
    """`kubectl rollout restart` of node-2 while clients send requests for `n` (once some run on
    it), until its old pod has exited and the rollout is complete (`on_look` runs at each look):
    the old pods' names, and each request's outcome (see `under_load`)."""
    identities = await asyncio.to_thread(pods.identities)
    old = {name for name in identities if name.startswith(f"{NODE_2}-")}

    def old_pods_gone() -> bool:
        on_look()
        names = {p["metadata"]["name"] for p in pods.get("pods")["items"]}
        return not names & old

    async with under_load(pods, "n") as outcomes:
        # The clients' first requests reach the old pod before it is replaced: on a loaded
        # machine they can take longer than the new pod takes to start, and then the old pod
        # would have no run to finish. Reached: one of them answered (a run of a few ms is
        # seldom in flight at the moment of a look) or, for slow runs, one is in flight.
        await asyncio.to_thread(
            wait_for,
            lambda: "served-c" in outcomes or pods.runs_in_flight("node-2"),
            timeout=20,
            what="the load to reach node-2",
        )
        await asyncio.to_thread(pods.kubectl, "rollout", "restart", f"deployment/{NODE_2}")
        await asyncio.to_thread(
            wait_for, old_pods_gone, timeout=60, what="the old node-2 pod to exit", show=pods.scene
        )
        await asyncio.to_thread(
            wait_for,
            lambda: pods.rolled_out(NODE_2),
            timeout=20,
            what="node-2's rollout to complete",
            show=pods.scene,
        )
    return old, outcomes


async def test_an_edge_rollout_under_load_loses_no_connection(pods: PodStack) -> None:
    # Clients that open a connection for each request through the Service, and never retry one,
    # while both Edge pods are replaced: kube-proxy follows the endpoints a moment after an old
    # pod is deleted, and the pod's preStop sleep (edge.preStopSleepSeconds) keeps it serving
    # until then; without it, a connection routed to it is refused (its listener closed at
    # SIGTERM) or, once it is gone, lost until the connect times out.
    old = {name for name in await asyncio.to_thread(pods.identities) if name.startswith(EDGE)}
    done = asyncio.Event()
    outcomes: list[str] = []
    url = f"{await asyncio.to_thread(pods.base_url)}/chat/completions"
    body = {"model": "n", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {pods.api_key}"}

    async def load() -> None:
        while not done.is_set():
            try:
                async with httpx.AsyncClient(timeout=httpx.Timeout(30, connect=5)) as http:
                    answer = await http.post(url, json=body, headers=headers)
                outcomes.append(str(answer.status_code))
            except httpx.TransportError as error:
                outcomes.append(f"failed: {error!r}")

    def old_pods_gone() -> bool:
        return not {p["metadata"]["name"] for p in pods.get("pods")["items"]} & old

    tasks = [asyncio.create_task(load(), name=f"load-{i}") for i in range(4)]
    try:
        await asyncio.to_thread(pods.kubectl, "rollout", "restart", f"deployment/{EDGE}")
        await asyncio.to_thread(
            wait_for, old_pods_gone, timeout=150, what="the old Edge pods to exit", show=pods.scene
        )
        await asyncio.to_thread(
            wait_for, lambda: pods.rolled_out(EDGE), timeout=20, what="the Edge's rollout"
        )
    finally:
        done.set()
        await asyncio.gather(*tasks)
    lost = collections.Counter(o for o in outcomes if o != "200")
    assert not lost, f"{sum(lost.values())} of {len(outcomes)} requests lost: {dict(lost)}"
    assert len(outcomes) > 50
    print(f"{len(outcomes)} requests through the Edge's rollout, none lost")


async def test_created_ready_and_serving_every_model(pods: PodStack) -> None:
    ec = await asyncio.to_thread(pods.ec)
    assert [r["state"] for r in ec["status"]["replicas"]] == ["Applied", "Applied"]
    assert all(r["pod"].startswith(f"{EDGE}-") for r in ec["status"]["replicas"])
    for model, name in (("m", "served-a"), ("solo", "served-d"), ("n", "served-c")):
        assert await served(pods, model) == name


LIVE = [
    pytest.param(
        lambda s: find_provider(s, "pa").update(priority=20), "served-a", "served-b", id="priority"
    ),
    pytest.param(
        lambda s: find_provider(s, "pa").update(enabled=False), "served-a", "served-b", id="enabled"
    ),
    pytest.param(
        lambda s: s["models"].__setitem__(0, {**s["models"][0], "providers": {"pb": "served-b"}}),
        "served-a",
        "served-b",
        id="model-providers",
    ),
    pytest.param(
        lambda s: s["openai"].update(longContextThresholdTokens=100000),
        None,
        None,
        id="long-context-threshold",
    ),
]


@pytest.mark.parametrize(("edit", "before", "after"), LIVE)
async def test_a_live_change_restarts_no_pod(pods: PodStack, edit, before, after) -> None:
    identities = await asyncio.to_thread(pods.identities)
    original = copy.deepcopy(pods.spec)
    long = "lorem ipsum " * 600
    content = long if before is None else "hi"
    before = before or "served-b"  # long: only pb has a long slot
    after = after or "served-a"  # no longer long
    assert await served(pods, content=content) == before
    changed = copy.deepcopy(original)
    edit(changed)
    try:
        ec = await asyncio.to_thread(pods.change, changed)
        assert ec["status"]["lastChange"]["restartPaths"] == []
        # Every replica took it: each request may land on either one.
        assert {await served(pods, content=content) for _ in range(6)} == {after}
        assert await asyncio.to_thread(pods.identities) == identities
    finally:
        await asyncio.to_thread(pods.change, original)


async def test_capacity_and_generation_policy_restart_no_pod(pods: PodStack) -> None:
    identities = await asyncio.to_thread(pods.identities)
    original = copy.deepcopy(pods.spec)
    assert await tokens(pods, "m") == 8
    changed = copy.deepcopy(original)
    changed["models"][0]["generation"] = {"maxTokens": 3}
    find_provider(changed, "pc")["capacity"] = 6  # pushed to node-2, acked on both replicas
    try:
        ec = await asyncio.to_thread(pods.change, changed)
        assert sorted(ec["status"]["lastChange"]["livePaths"]) == [
            "models[m].generation.maxTokens",
            "nodes[node-2].providers[pc].capacity",
        ]
        assert ec["status"]["nodesAcked"] == "2/2"
        assert {await tokens(pods, "m") for _ in range(4)} == {3}
        assert await asyncio.to_thread(pods.identities) == identities
    finally:
        await asyncio.to_thread(pods.change, original)


async def test_a_load_runs_through_live_applies_without_a_failed_request(pods: PodStack) -> None:
    original = copy.deepcopy(pods.spec)
    try:
        async with under_load(pods, "n") as outcomes:
            for capacity in (6, 5, 7, 4):
                changed = copy.deepcopy(pods.spec)
                find_provider(changed, "pc")["capacity"] = capacity
                find_provider(changed, "pa")["priority"] = capacity
                await asyncio.to_thread(pods.change, changed)
    finally:
        await asyncio.to_thread(pods.change, original)
    assert [o for o in outcomes if o.startswith("failed")] == []
    assert len(outcomes) > 20


async def test_an_edge_restart_rolls_only_the_edge_pods(pods: PodStack) -> None:
    before = await asyncio.to_thread(pods.identities)
    revisions = await asyncio.to_thread(pods.revisions)
    changed = copy.deepcopy(pods.spec)
    changed["openai"]["allowUnauthenticated"] = True
    ec = await asyncio.to_thread(pods.change, changed)

    assert ec["status"]["lastChange"]["restartScopes"] == ["edge"]
    assert await asyncio.to_thread(pods.revisions) == {**revisions, EDGE: revisions[EDGE] + 1}
    after = await asyncio.to_thread(pods.identities)
    edge_before = {k for k in before if k.startswith(f"{EDGE}-")}
    edge_after = {k for k in after if k.startswith(f"{EDGE}-")}
    assert edge_before.isdisjoint(edge_after) and len(edge_after) == 2
    assert {k: v for k, v in after.items() if "-node-" in k} == {
        k: v for k, v in before.items() if "-node-" in k
    }
    assert pods.stamp(EDGE) == ec["status"]["desiredConfigHash"]
    # Ready means serving: the Nodes were back on the new pods before Ready, which then serve
    # the new config at once: no token needed now (the openai client always sends one: a
    # plain request).
    assert ec["status"]["nodesAcked"] == "2/2"
    async with http_client(base_url=pods.base_url()) as http:
        for _ in range(4):
            response = await http.post(
                "/chat/completions",
                json={"model": "n", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert response.status_code == 200, response.text
            assert response.json()["model"] == "served-c"


async def test_a_restart_whose_new_pod_never_gets_ready_goes_back_by_itself(
    pods: PodStack,
) -> None:
    """The OpenAI listener moved to a port the Service does not target (valid, and accepted):
    the Edge's surge pod never passes its readiness probe, no old pod stops, and once the
    progress deadline passes the operator puts the last good template back; requests are
    answered all along; the old file applied again rolls nothing."""
    before = await asyncio.to_thread(pods.identities)
    revisions = await asyncio.to_thread(pods.revisions)
    stamp = pods.stamp(EDGE)
    changed = copy.deepcopy(pods.spec)
    host, _, port = changed["openai"]["listen"].rpartition(":")
    changed["openai"]["listen"] = f"{host}:{int(port) + 11}"
    new_pods: set[str] = set()

    def look() -> dict[str, Any]:
        for pod in pods.pods("edge"):  # a pod of another template than the old one: a new pod
            annotations = pod["metadata"].get("annotations") or {}
            if annotations.get("iop.dev/config-hash", "") != stamp:
                new_pods.add(pod["metadata"]["name"])
        return pods.ec()

    def rolled_back(ec: dict[str, Any]) -> bool:
        history = ec.get("status", {}).get("history") or [{}]
        return bool(
            ec["metadata"]["generation"] == pods.generation + 1
            and history[0].get("outcome") == "RolledBack"
            and pods.stamp(EDGE) == stamp
        )

    async with under_load(pods, "m", workers=2) as outcomes:
        await asyncio.to_thread(pods.apply, changed)
        found: dict[str, Any] = {}

        def back() -> bool:
            nonlocal found
            found = look()
            return rolled_back(found)

        await asyncio.to_thread(
            wait_for, back, timeout=GATE_S + 60, what="the restart rolled back",
            show=lambda: found.get("status"),
        )  # fmt: skip
        await asyncio.to_thread(
            wait_for, lambda: pods.rolled_out(EDGE), timeout=60, what="the old template back"
        )
        await asyncio.sleep(1)  # requests on the old pods after the rollback too
    pods.generation += 1

    status = found["status"]
    entry = status["history"][0]
    assert (entry["check"], entry["generation"]) == ("restart", pods.generation)
    assert f"Deployment/{EDGE} (edge): progress deadline exceeded" in entry["reason"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Stalled"]["status"], conditions["Stalled"]["reason"]) == (
        "True",
        "RolledBack",
    )
    assert status["rollout"]["stable"] == status["history"][1]["revision"]
    assert len(new_pods) == 1, new_pods  # the surge pod, and never a second one
    # The old pods served throughout and still do; the new template's pod is gone.
    after = await asyncio.to_thread(pods.identities)
    assert {k: v for k, v in after.items() if k.startswith(f"{EDGE}-")} == {
        k: v for k, v in before.items() if k.startswith(f"{EDGE}-")
    }
    assert [o for o in outcomes if o.startswith("failed")] == []
    assert len(outcomes) > 10
    configmap = await asyncio.to_thread(pods.get, "configmap", f"{NAME}-edge")
    assert (
        configmap["metadata"]["annotations"]["iop.dev/config-hash"] == status["appliedConfigHash"]
    )

    # The GitOps way back: the old file again is the stable revision, and rolls nothing.
    ec = await asyncio.to_thread(pods.change, pods.spec)
    assert ec["status"]["history"][0]["restores"] == status["rollout"]["stable"]
    assert await asyncio.to_thread(pods.revisions) == {**revisions, EDGE: revisions[EDGE] + 1}
    assert await asyncio.to_thread(pods.identities) == after


async def test_a_node_restart_whose_new_process_serves_worse_goes_back_by_itself(
    pods: PodStack,
) -> None:
    """node-2's provider pc moved to a server that does not answer (a closed port): valid, and
    restart-required. node-2's new pod is ready (its adapter can run), but pc, healthy on the old
    process, fails its first probes on the new one: the gate compares the two and the operator
    puts node-2 back on its last good template; m (on node-1) never notices."""
    stamp = pods.stamp(NODE_2)
    changed = copy.deepcopy(pods.spec)
    provider_pc = changed["nodes"][1]["providers"][0]
    provider_pc["adapter"] = {"type": "openai", "baseUrl": "http://127.0.0.1:9/v1"}
    found: dict[str, Any] = {}

    def back() -> bool:
        nonlocal found
        found = pods.ec()
        history = found.get("status", {}).get("history") or [{}]
        return bool(
            found["metadata"]["generation"] == pods.generation + 1
            and history[0].get("outcome") == "RolledBack"
            and pods.stamp(NODE_2) == stamp
        )

    async with under_load(pods, "m", workers=2) as on_m, under_load(pods, "n", workers=2) as on_n:
        await asyncio.sleep(1)
        applied_at = time.monotonic()
        await asyncio.to_thread(pods.apply, changed)
        await asyncio.to_thread(
            wait_for, back, timeout=GATE_S + 60, what="node-2's restart rolled back",
            show=lambda: found.get("status"),
        )  # fmt: skip
        rolled_back_after = time.monotonic() - applied_at
        await asyncio.to_thread(
            wait_for, lambda: pods.rolled_out(NODE_2), timeout=90, what="node-2's old template"
        )
        served = len(on_n)

        def edges_see() -> Any:
            return on_n[-3:], [pods.admin(p, "/status")["nodes"] for p in pods.pods("edge")]

        await asyncio.to_thread(
            wait_for, lambda: len(on_n) > served + 20, timeout=40, what="n served again",
            show=edges_see,
        )  # fmt: skip
    pods.generation += 1

    entry = found["status"]["history"][0]
    assert entry["check"] == "restart"
    assert (
        "its new process serves worse than the old one: provider pc probe_failed"
        in (entry["reason"])
    )
    failed_n = [o for o in on_n if o.startswith("failed")]
    print(
        f"rolled back {rolled_back_after:.1f}s after the apply; m: {len(on_m)} answered, "
        f"n: {len(failed_n)} of {len(on_n)} failed: {failed_n[:3]}"
    )
    assert rolled_back_after < 30
    assert [o for o in on_m if o.startswith("failed")] == []
    assert len(failed_n) <= 0.02 * len(on_n), failed_n[:5]

    ec = await asyncio.to_thread(pods.change, pods.spec)  # the old file again: nothing rolls
    assert ec["status"]["history"][0]["restores"] == found["status"]["rollout"]["stable"]
    assert pods.stamp(NODE_2) == stamp


async def test_an_edge_pod_that_starts_mid_canary_judges_the_candidate_again(
    pods: PodStack,
) -> None:
    """A canary held at its first step; one Edge pod deleted: the new pod starts on the stable
    config (the ConfigMap holds it while the candidate is judged) and the operator gives it the
    candidate live, which its own log judges from the first step; never its first revision."""
    stable_hash = (await asyncio.to_thread(pods.ec))["status"]["appliedConfigHash"]
    changed = copy.deepcopy(pods.spec)
    changed["rollout"] = {"mode": "canary", "steps": [5, 100], "stepMs": 600_000}
    changed["models"][0]["providers"] = {"pb": "served-b"}  # what serves m: a canary
    await asyncio.to_thread(pods.apply, changed)
    pods.generation += 1

    def canary() -> bool:
        status = pods.ec().get("status", {})
        return (status.get("rollout") or {}).get("state") == "Canary" and (
            status.get("observedGeneration") == pods.generation
        )

    await asyncio.to_thread(wait_for, canary, timeout=60, what="the canary on both replicas")
    candidate_hash = (await asyncio.to_thread(pods.ec))["status"]["desiredConfigHash"]
    victim = (await asyncio.to_thread(pods.pods, "edge"))[0]["metadata"]["name"]
    await asyncio.to_thread(pods.kubectl, "delete", "pod", victim, "--wait=false")
    judged: dict[str, Any] = {}

    def new_pod_judges() -> bool:
        nonlocal judged
        for pod in pods.pods("edge"):
            if pod["metadata"]["name"] == victim or not pod["status"].get("podIP"):
                continue
            try:
                log = pods.admin(pod, "/revisions")
            except httpx.HTTPError:
                continue
            numbers = [r["revision"] for r in log["revisions"]]
            if 1 in numbers and len(numbers) >= 2:  # a pod started after the deletion
                judged = log
                return log["candidate"] is not None
        return False

    await asyncio.to_thread(wait_for, new_pod_judges, timeout=120, what="the new pod's canary")
    revisions = {r["revision"]: r for r in judged["revisions"]}
    assert (revisions[1]["config_hash"], revisions[1]["outcome"]) == (stable_hash, "started")
    candidate = revisions[judged["candidate"]]
    assert candidate["config_hash"] == candidate_hash
    assert (candidate["outcome"], candidate["share_percent"]) == ("watching", 5)

    await asyncio.to_thread(pods.change, pods.spec)  # back: the candidate superseded


async def test_an_adapter_change_rolls_only_that_nodes_workload_even_if_the_operator_dies(
    pods: PodStack,
) -> None:
    before = await asyncio.to_thread(pods.identities)
    revisions = await asyncio.to_thread(pods.revisions)
    stamps = (pods.stamp(EDGE), pods.stamp(NODE_1))
    assert await tokens(pods, "n") == 8
    changed = copy.deepcopy(pods.spec)
    changed["nodes"][1]["providers"][0]["adapter"]["completionTokens"] = 5
    unstamped = pods.stamp(NODE_2)
    await asyncio.to_thread(pods.apply, changed)
    pods.generation += 1
    pods.spec = changed

    # Kill the active operator as soon as it has stamped node-2's workload, before the roll is
    # done: the standby takes over and finishes it.
    wait_for(lambda: pods.stamp(NODE_2) != unstamped, timeout=60, what="node-2's workload stamped")
    pods.kubectl("delete", "pod", pods.leader_pod(), "--grace-period=0", "--force", "--wait=false")
    # (Within the test's 120 s: the Lease runs out in 15 s, the roll takes 10 s or so.)
    ec = await asyncio.to_thread(pods.wait_ready, pods.generation, 90, pods.scene)

    assert ec["status"]["lastChange"]["restartScopes"] == ["node:node-2"]
    assert await asyncio.to_thread(pods.revisions) == {
        **revisions,
        NODE_2: revisions[NODE_2] + 1,
    }
    assert (pods.stamp(EDGE), pods.stamp(NODE_1)) == stamps
    after = await asyncio.to_thread(pods.identities)
    unchanged = {k: v for k, v in before.items() if not k.startswith(f"{NODE_2}-")}
    assert {k: v for k, v in after.items() if not k.startswith(f"{NODE_2}-")} == unchanged
    assert {await tokens(pods, "n") for _ in range(4)} == {5}


async def test_a_nodes_rollout_under_load_loses_no_request(pods: PodStack) -> None:
    """`kubectl rollout restart` of node-2 (model `n` has no other provider) while requests run:
    the new pod takes the node id over before the old one drains (the chart's surge rollout), so
    requests keep being answered all along (with `Recreate` they wait in the queue for the new
    pod)."""
    before = await asyncio.to_thread(pods.identities)
    old, outcomes = await node_2_rolled_under_load(pods)
    assert [o for o in outcomes if o.startswith("failed")] == []
    assert len(outcomes) > 20
    after = await asyncio.to_thread(pods.identities)
    assert {name for name in after if name.startswith(f"{NODE_2}-")}.isdisjoint(old)
    # Nothing else moved, and the operator had nothing to do.
    assert {k: v for k, v in after.items() if not k.startswith(f"{NODE_2}-")} == {
        k: v for k, v in before.items() if not k.startswith(f"{NODE_2}-")
    }
    await asyncio.to_thread(pods.wait_ready, pods.generation, 60)


async def test_the_webhook_refuses_every_problem_and_states_the_plan(pods: PodStack) -> None:
    broken = copy.deepcopy(pods.spec)
    broken["models"][0]["providers"]["zz"] = "x"
    manifest = {
        "apiVersion": "iop.dev/v1alpha1",
        "kind": "EdgeConfig",
        "metadata": {"name": NAME},
        "spec": broken,
    }
    # After an operator restart (the test before kills it) the webhook serves again once the
    # new pod listens and has written its caBundle; until then failurePolicy Ignore admits.
    wait_for(
        lambda: (
            pods.kubectl(
                "apply", "-f", "-", "--dry-run=server", stdin=json.dumps(manifest), check=False
            ).returncode
            != 0
        ),
        timeout=60,
        what="the webhook to refuse an invalid spec",
    )
    result = pods.kubectl("apply", "-f", "-", stdin=json.dumps(manifest), check=False)
    assert result.returncode != 0
    assert 'models[0].providers.zz: unknown provider "zz"' in result.stderr
    live = copy.deepcopy(pods.spec)
    find_provider(live, "pa")["capacity"] = 3
    manifest["spec"] = live
    dry = pods.kubectl("apply", "-f", "-", "--dry-run=server", stdin=json.dumps(manifest))
    assert "Warning: live: nodes[node-1].providers[pa].capacity" in dry.stderr
    assert pods.ec()["metadata"]["generation"] == pods.generation


async def test_a_nodes_drain_shows_in_the_status_until_its_last_run_ends(pods: PodStack) -> None:
    """node-2's runs made slow (8 s each), then `kubectl rollout restart` of it under load: while
    its old pod finishes the runs it has, the EdgeConfig's status counts them
    (`nodes[].drainingRuns`), and the count is gone once they have ended. The adapter change
    rolls node-2 itself, so the restart waits for that rollout to end. The pass the old pod's
    deletion wakes may read the Edge before the Node's drain has reached it, and the next look
    comes within 5 s (`reconciling._RECHECK_S`): runs of 2.5 s ended in between when the machine
    was loaded, so they last 8 s here (well inside the Node's shutdown grace)."""
    slow = copy.deepcopy(pods.spec)
    slow["nodes"][1]["providers"][0]["adapter"] = {
        "type": "fake",
        "completionTokens": 16,
        "tokensPerSecond": 2,
    }
    await asyncio.to_thread(pods.change, slow)  # an adapter change: node-2 rolls
    await asyncio.to_thread(
        wait_for, lambda: pods.rolled_out(NODE_2), timeout=60, what="node-2's slow pod alone"
    )

    def draining() -> int:
        nodes = pods.ec()["status"].get("nodes") or []
        return sum(int(n.get("drainingRuns", 0)) for n in nodes if n["nodeId"] == "node-2")

    seen: list[int] = []
    _, outcomes = await node_2_rolled_under_load(pods, lambda: seen.append(draining()))
    assert max(seen) >= 1, seen
    assert [o for o in outcomes if o.startswith("failed")] == []
    await asyncio.to_thread(
        wait_for, lambda: draining() == 0, timeout=30, what="no drain in the status"
    )


async def test_a_deleted_or_edited_configmap_is_put_back_within_seconds(pods: PodStack) -> None:
    name = f"{NAME}-edge"
    before = pods.get("configmap", name)["data"]

    await asyncio.to_thread(pods.kubectl, "delete", "configmap", name)
    started = time.monotonic()

    def back() -> bool:
        found = pods.kubectl("get", "configmap", name, "-o", "json", check=False)
        return found.returncode == 0 and json.loads(found.stdout)["data"] == before

    await asyncio.to_thread(
        wait_for, back, timeout=10, what=f"ConfigMap {name} to be written again"
    )
    print(f"ConfigMap {name} deleted -> back in {time.monotonic() - started:.2f}s")

    patch = json.dumps({"data": {"edge.yaml": "{}"}})
    await asyncio.to_thread(pods.kubectl, "patch", "configmap", name, "--type=merge", "-p", patch)
    started = time.monotonic()
    await asyncio.to_thread(wait_for, back, timeout=10, what=f"ConfigMap {name} to be restored")
    print(f"ConfigMap {name} edited -> restored in {time.monotonic() - started:.2f}s")
    reasons = [
        e["reason"]
        for e in pods.get("events", "--field-selector", f"involvedObject.name={NAME}")["items"]
    ]
    assert "Repaired" in reasons


async def test_a_webhook_configuration_that_changed_is_trusted_again(pods: PodStack) -> None:
    """Someone (a `helm upgrade` that recreated it, a `kubectl apply`) puts another caBundle in
    the webhook configuration: the operator puts its own back within seconds (with failurePolicy
    Ignore, an untrusted webhook would silently stop validating)."""
    webhook = f"{NAME}-{pods.namespace}"
    ours = pods.get("secret", f"{NAME}-operator-webhook-tls")["data"]["tls.crt"]
    configuration = pods.cluster.get("validatingwebhookconfiguration", webhook)
    assert configuration["webhooks"][0]["clientConfig"]["caBundle"] == ours
    other = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    patch = [
        {"op": "replace", "path": "/webhooks/0/clientConfig/caBundle", "value": other.decode()}
    ]
    await asyncio.to_thread(
        pods.cluster.kubectl,
        "patch", "validatingwebhookconfiguration", webhook, "--type=json", "-p", json.dumps(patch),
    )  # fmt: skip
    started = time.monotonic()

    def trusted() -> bool:
        found = pods.cluster.get("validatingwebhookconfiguration", webhook)
        return bool(found["webhooks"][0]["clientConfig"].get("caBundle") == ours)

    await asyncio.to_thread(wait_for, trusted, timeout=10, what="the operator's caBundle back")
    print(f"caBundle replaced -> put back in {time.monotonic() - started:.2f}s")


async def test_the_standby_operator_takes_over_when_the_active_one_goes(pods: PodStack) -> None:
    """Failover: the pod holding the Lease deleted (SIGTERM: it releases the Lease), then the new
    leader killed outright (SIGKILL of its process: the Lease expires); each time the other
    replica leads and applies a live change. The times are printed (docs/benchmarks.md)."""
    for how in ("delete", "kill"):
        old = pods.leader()
        started = time.monotonic()
        if how == "delete":
            await asyncio.to_thread(
                pods.kubectl, "delete", "pod", pods.leader_pod(), "--wait=false"
            )
        else:
            pod = pods.get("pod", pods.leader_pod())
            pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("iop://"))
            os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(
            wait_for,
            lambda o=old: pods.leader() not in ("", o),
            timeout=60,
            what="another operator to lead",
        )
        took_over = time.monotonic() - started
        changed = copy.deepcopy(pods.spec)
        find_provider(changed, "pc")["capacity"] = 5 if how == "delete" else 4
        await asyncio.to_thread(pods.change, changed)
        applied = time.monotonic() - started
        print(f"failover by {how}: new leader after {took_over:.1f}s, a live change Ready "
              f"after {applied:.1f}s")  # fmt: skip
    await asyncio.to_thread(
        wait_for,
        lambda: len(pods.pods("operator")) == 2,
        timeout=120,
        what="two operator replicas again",
    )


def test_the_operators_role_is_what_it_calls(pods: PodStack) -> None:
    """Least privilege, checked against reality: every call the operator's ServiceAccount made
    during this module (the API server's audit log) was allowed, and every rule of its Role was
    needed by one of them. Runs last in the module, after everything above exercised it."""
    account = f"system:serviceaccount:{pods.namespace}:{NAME}-operator"
    calls = pods.cluster.audit(account)
    assert calls, "no audit events for the operator"
    refused = [
        (c["verb"], c["objectRef"].get("resource"), c["objectRef"].get("name"))
        for c in calls
        if c.get("responseStatus", {}).get("code") == 403
    ]
    assert refused == []
    used = {
        (
            c["objectRef"].get("apiGroup", ""),
            c["objectRef"]["resource"]
            + (f"/{c['objectRef']['subresource']}" if c["objectRef"].get("subresource") else ""),
            c["verb"],
            c["objectRef"].get("name") is not None or "metadata.name=" in c.get("requestURI", ""),
        )
        for c in calls
        if c.get("objectRef", {}).get("resource")
    }
    role = pods.get("role", f"{NAME}-operator")
    cluster_role = pods.cluster.get("clusterrole", f"{NAME}-{pods.namespace}-webhook")
    granted = {
        (group, resource, verb)
        for rule in [*role["rules"], *cluster_role["rules"]]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {(group, resource, verb) for group, resource, verb, _ in used}
    # A server-side apply that creates a ConfigMap is authorized as create too, but audited as a
    # patch (without the rule the first apply is refused: seen); and a rare path this module
    # does not walk: a generated key added to a Secret that exists.
    needed |= {("", "configmaps", "create")} if ("", "configmaps", "patch") in needed else set()
    rare = {("", "secrets", "patch")}
    assert granted - needed - rare == set()
    assert needed - granted == set()
