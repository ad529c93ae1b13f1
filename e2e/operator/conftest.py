"""Fixtures for the operator's end-to-end tests: the CRD, `iop operator run` as a real process,
the webhook configuration that points the API server at it, and EdgeConfig documents.

Two ways the Edge runs in these tests:

- on the host (`host_stack`): `iop edge run` and `iop node run` processes started by the test,
  and the operator told where their admin API is (`--edge-admin`): what runs without pods;
- as pods (`test_pods.py`): the product's chart (`deploy/helm/iop-edge`), its operator, Edge and
  Nodes run by the process kubelet, with the operator finding the replicas through the API.

Tests of the host Edge that need workloads to stamp and roll install the same chart without its
operator, its pods on kwok's node, where nothing runs (`workloads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from e2e.tools import healthcheck
from iop.edgeconfig import token_sha256
from iop.processes import free_port, iop_command, spawn_edge, spawn_node, terminate
from tests.waiting import wait_available, wait_for

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "deploy" / "crds" / "edgeconfigs.iop.dev.yaml"
CLIENT_TOKEN = "sk-e2e-operator-client"


# -- EdgeConfig documents ----------------------------------------------------------------------


def host_spec() -> dict[str, Any]:
    """A spec (camelCase, as users write it) for an Edge on the host, listening on free ports.

    - model `m`: pa (priority 0, no long-context slot) and pb (priority 10, one long slot), on
      node-1: which one answers shows priority, `enabled` and the long-context threshold;
    - model `solo`: pd alone on node-1, slow (1 s: a change that moves `m` to it fails the
      first-token check even on a loaded machine, whose baseline p95 reached 250 ms), capacity
      1, no queue: two requests at once show the capacity;
    - model `n`: pc on node-2 (the background load's model).

    A live change applies to all at once (watched, `rollout.mode: watch`), so a test sees each
    live field on every request that follows; test_canary.py and test_revisions.py set their
    own `rollout` (the canary).
    """

    def fake(pid: str, **settings: Any) -> dict[str, Any]:
        return {
            "id": pid,
            "adapter": {"type": "fake", "completionTokens": 8},
            "servedModels": [f"served-{pid[1]}"],
            "capacity": 4,
            **settings,
        }

    return {
        # Fixed free ports, so an Edge restarted by hand runs exactly this config again.
        "edge": {
            "id": "edge-e2e",
            "listen": f"127.0.0.1:{free_port()}",
            "admin": {"listen": f"127.0.0.1:{free_port()}"},
        },
        "openai": {
            "listen": f"127.0.0.1:{free_port()}",
            "longContextThresholdTokens": 1000,
            "principalTokens": [
                {
                    "tokenRef": "e2e-app",
                    "tokenHashSha256": token_sha256(CLIENT_TOKEN),
                    "principalRef": "team-e2e",
                }
            ],
        },
        "rollout": {"mode": "watch"},
        "models": [
            {"id": "m", "providers": {"pa": "served-a", "pb": "served-b"}},
            {"id": "solo", "providers": {"pd": "served-d"}},
            {"id": "n", "providers": {"pc": "served-c"}},
        ],
        "nodes": [
            {
                "id": "node-1",
                "tokenHashSha256": token_sha256("node-1-token"),
                "providers": [
                    fake("pa", priority=0, longContextSlots=0),
                    fake("pb", priority=10, longContextSlots=1),
                    fake(
                        "pd",
                        adapter={"type": "fake", "latencyMs": 1000},
                        capacity=1,
                        maxQueue=0,
                    ),
                ],
            },
            {
                "id": "node-2",
                "tokenHashSha256": token_sha256("node-2-token"),
                "providers": [fake("pc")],
            },
        ],
    }


def edgeconfig(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "iop.dev/v1alpha1",
        "kind": "EdgeConfig",
        "metadata": {"name": name},
        "spec": spec,
    }


# -- what kstatus and Argo CD make of an EdgeConfig -----------------------------------------------


def pytest_collection_finish(session: pytest.Session) -> None:
    healthcheck.collection_finished(session)


@pytest.fixture(scope="session")
def health_readers(pytestconfig: pytest.Config) -> healthcheck.HealthReaders:
    """kstatus and the Argo CD health check (`healthcheck.HealthReaders`); fails, never skips,
    when they cannot be built."""
    return healthcheck.readers_for(pytestconfig)


# -- the cluster side ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def edgeconfig_crd(kube_cluster: KubeCluster) -> None:
    """The EdgeConfig CRD from deploy/crds, installed and established (cluster-wide, once)."""
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kube_cluster.wait_condition("crd/edgeconfigs.iop.dev", "Established")
    # Established comes a moment before discovery serves the resource.
    wait_for(
        lambda: kube_cluster.kubectl("get", "ec", "-A", check=False).returncode == 0,
        timeout=30,
        what="the EdgeConfig resource to be served",
    )


def webhook_configuration(name: str, namespace: str, url: str) -> dict[str, Any]:
    """What the chart installs (docs/operator.md, "The webhook"), for one test namespace, but
    pointing the API server at the operator on the host (`url`) instead of a Service."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "validate.edgeconfigs.iop.dev",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Ignore",
                "timeoutSeconds": 5,
                "matchPolicy": "Equivalent",
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "rules": [
                    {
                        "apiGroups": ["iop.dev"],
                        "apiVersions": ["v1alpha1"],
                        "resources": ["edgeconfigs"],
                        "operations": ["CREATE", "UPDATE"],
                        "scope": "Namespaced",
                    }
                ],
                "clientConfig": {"url": url},
            }
        ],
    }


@dataclass
class OperatorProcess:
    """`iop operator run` on the host, for one namespace, logging to a file."""

    cluster: KubeCluster
    namespace: str
    log_path: Path
    edge_admins: list[str] = field(default_factory=list)
    webhook_configuration: str | None = None
    webhook_port: int = 0
    liveness_port: int = 0
    metrics_port: int = 0
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [
            *iop_command(), "operator", "run",
            "--namespace", self.namespace,
            "--kubeconfig", str(self.cluster.kubeconfig),
            "--liveness-listen", f"127.0.0.1:{self.liveness_port}",
            "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
            "--log-level", "INFO",
        ]  # fmt: skip
        for url in self.edge_admins:
            args += ["--edge-admin", url]
        if self.webhook_configuration:
            args += [
                "--webhook-listen", f"127.0.0.1:{self.webhook_port}",
                "--webhook-configuration", self.webhook_configuration,
                "--webhook-url", f"https://127.0.0.1:{self.webhook_port}",
            ]  # fmt: skip
        else:
            args.append("--no-webhook")
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        log.close()
        wait_for(self._live, timeout=60, what="the operator's liveness endpoint")

    def _live(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            pytest.fail(f"the operator exited with {self.process.returncode}:\n{self.log()}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1).is_success
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no goodbye, as when a node dies under it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture
def start_operator(
    kube_cluster: KubeCluster, namespace: str, edgeconfig_crd: None, tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    """`start_operator(edge_admins=[...], webhook=True)`: the operator, stopped at the end."""
    started: list[OperatorProcess] = []
    configurations: list[str] = []

    def start(
        *, edge_admins: list[str] | None = None, webhook: bool = True, port: int | None = None
    ) -> OperatorProcess:
        name = None
        webhook_port = port or free_port()
        if webhook:
            name = f"iop-e2e-{namespace}"
            if name not in configurations:
                kube_cluster.apply(
                    webhook_configuration(
                        name, namespace, f"https://127.0.0.1:{webhook_port}/validate"
                    )
                )
                configurations.append(name)
        operator = OperatorProcess(
            kube_cluster,
            namespace,
            tmp_path / f"operator-{len(started)}.log",
            edge_admins=list(edge_admins or []),
            webhook_configuration=name,
            webhook_port=webhook_port,
            liveness_port=free_port(),
            metrics_port=free_port(),
        )
        started.append(operator)
        operator.start()
        return operator

    yield start
    for operator in started:
        operator.stop()
    for name in configurations:
        kube_cluster.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found")
    for operator in started:
        sys.stdout.write(f"--- {operator.log_path.name} ---\n{operator.log()[-6000:]}\n")


# -- EdgeConfig helpers ---------------------------------------------------------------------------


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


@dataclass
class EdgeConfigs:
    """Read and wait on the EdgeConfigs of one namespace."""

    cluster: KubeCluster
    namespace: str

    def get(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.cluster.get("ec", name, "-n", self.namespace)
        return found

    def apply(self, name: str, spec: dict[str, Any], *args: str) -> str:
        return self.cluster.apply(edgeconfig(name, spec), "-n", self.namespace, *args)

    def wait(
        self,
        name: str,
        condition: str = "Ready",
        status: str = "True",
        *,
        generation: int | None = None,
        timeout: float = 60,
    ) -> dict[str, Any]:
        """Until `condition` has `status` for the newest (or the given) generation."""
        found: dict[str, Any] = {}

        def holds() -> bool:
            nonlocal found
            found = self.get(name)
            wanted = generation or found["metadata"]["generation"]
            got = conditions(found).get(condition)
            return (
                found.get("status", {}).get("observedGeneration") == wanted
                and got is not None
                and got["status"] == status
                and got.get("observedGeneration") == wanted
            )

        try:
            wait_for(holds, timeout=timeout, what=f"{condition}={status} on ec/{name}")
        except BaseException:
            sys.stdout.write(json.dumps(found.get("status"), indent=1) + "\n")
            raise
        return found

    def events(self, name: str) -> list[dict[str, Any]]:
        listed = self.cluster.get(
            "events", "-n", self.namespace, "--field-selector", f"involvedObject.name={name}"
        )
        return sorted(listed["items"], key=lambda e: e.get("lastTimestamp") or "")


@pytest.fixture(name="host_spec", scope="session")
def host_spec_fixture() -> Callable[[], dict[str, Any]]:
    """`host_spec()`: a fresh copy of the host-mode spec."""
    return host_spec


@pytest.fixture
def edgeconfigs(kube_cluster: KubeCluster, namespace: str) -> EdgeConfigs:
    return EdgeConfigs(kube_cluster, namespace)


# -- an Edge and its Nodes on the host ------------------------------------------------------------


@dataclass
class HostStack:
    """`iop edge run` and (unless told otherwise) one `iop node run` per node, on the host, from a
    spec."""

    folder: Path
    edge: asyncio.subprocess.Process | None = None
    nodes: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    url: str = ""
    admin_url: str = ""
    hub_port: int = 0
    stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    async def start(self, spec: dict[str, Any], *, nodes: bool = True) -> HostStack:
        """Start the Edge, and with `nodes` a Node process for every node of `spec`."""
        config = self.folder / "edge.yaml"
        config.write_text(json.dumps(spec))
        self.edge, started = await spawn_edge(config, startup_timeout=30)
        self.stack.push_async_callback(terminate, self.edge)
        self.url, self.admin_url = started["url"], started["admin_url"]
        self.hub_port = started["hub_port"]
        for node in spec["nodes"] if nodes else ():
            token = self.folder / f"{node['id']}.token"
            token.write_text(f"{node['id']}-token")
            process = await spawn_node(self.hub_port, node["id"], token)
            self.stack.push_async_callback(terminate, process)
            self.nodes[node["id"]] = process
        return self

    async def restart_edge(self, spec: dict[str, Any]) -> None:
        """A restart by hand (what the operator cannot do for an Edge outside the cluster)."""
        assert self.edge is not None
        await terminate(self.edge)
        config = self.folder / "edge.yaml"
        config.write_text(json.dumps(spec))
        self.edge, started = await spawn_edge(config, startup_timeout=30)
        self.stack.push_async_callback(terminate, self.edge)
        self.url, self.admin_url = started["url"], started["admin_url"]

    async def restart_node(self, node_id: str) -> None:
        """A Node restarted by hand: a new process, welcomed with the current payload."""
        await terminate(self.nodes[node_id])
        token = self.folder / f"{node_id}.token"
        process = await spawn_node(self.hub_port, node_id, token)
        self.stack.push_async_callback(terminate, process)
        self.nodes[node_id] = process

    def pids(self) -> dict[str, int]:
        assert self.edge is not None
        return {"edge": self.edge.pid, **{n: p.pid for n, p in self.nodes.items()}}

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=CLIENT_TOKEN, max_retries=0)

    async def wait_available(self, providers: list[str], timeout: float = 90) -> None:
        await wait_available(self.url, providers, timeout)


@pytest.fixture
async def host_stack(tmp_path: Path) -> AsyncIterator[Callable[[dict[str, Any]], Any]]:
    stacks: list[HostStack] = []

    async def start(spec: dict[str, Any], *, nodes: bool = True) -> HostStack:
        stack = HostStack(tmp_path / f"stack-{len(stacks)}")
        stack.folder.mkdir()
        stacks.append(stack)
        return await stack.start(spec, nodes=nodes)

    yield start
    for stack in stacks:
        await stack.stack.aclose()


@pytest.fixture
def operated(
    host_stack: Callable[..., Any],
    start_operator: Callable[..., OperatorProcess],
    edgeconfigs: EdgeConfigs,
) -> Callable[..., Any]:
    """`await operated(spec, providers=[...])`: the host stack of `spec` with `providers` (all
    four of `host_spec` by default) available, the operator told its admin API, and `spec`
    applied as EdgeConfig `demo` and Ready."""

    async def start(
        spec: dict[str, Any], providers: Sequence[str] = ("pa", "pb", "pc", "pd")
    ) -> HostStack:
        stack: HostStack = await host_stack(spec)
        await stack.wait_available(sorted(providers))
        start_operator(edge_admins=[stack.admin_url])
        await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
        await asyncio.to_thread(edgeconfigs.wait, "demo")
        return stack

    return start


# -- the chart's workloads on kwok's node ----------------------------------------------------------

CHART = REPO / "deploy" / "helm" / "iop-edge"
# Pods that select and tolerate kwok's Node are reported Running there, and nothing runs
# (e2e/cluster/README.md, "Which node a pod lands on").
ON_KWOK: dict[str, Any] = {
    "nodeSelector": {"type": "kwok"},
    "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
}


@dataclass
class Workloads:
    """The chart's release in one namespace, and what its Deployments did."""

    cluster: KubeCluster
    namespace: str
    release: str = "iop"

    def install(self, values: dict[str, Any], *, wait: bool = False) -> None:
        path = Path(self.cluster.client_home) / f"values-{self.namespace}.json"
        path.write_text(json.dumps(values))
        args = [
            "upgrade",
            "--install",
            self.release,
            str(CHART),
            "-n",
            self.namespace,
            "-f",
            str(path),
        ]
        if wait:
            args += ["--wait", "--timeout=120s"]
        self.cluster.helm(*args, timeout=180)

    def deployment(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.cluster.get("deployment", name, "-n", self.namespace)
        return found

    def stamp(self, name: str) -> str:
        template = self.deployment(name)["spec"]["template"]["metadata"]
        stamped: str = (template.get("annotations") or {}).get("iop.dev/config-hash", "")
        return stamped

    def revisions(self) -> dict[str, int]:
        """Deployment name -> how many pod templates it has had (its ReplicaSets)."""
        listed = self.cluster.get("rs", "-n", self.namespace, "-l", "iop.dev/edgeconfig")
        counts: dict[str, int] = {}
        for rs in listed["items"]:
            owner = rs["metadata"]["ownerReferences"][0]["name"]
            counts[owner] = counts.get(owner, 0) + 1
        return counts

    def install_kwok(self, nodes: list[str]) -> None:
        self.install(kwok_values(nodes))

    def wait_rolled_out(self, name: str, timeout: float = 60) -> None:
        wait_for(lambda: self.rolled_out(name), timeout=timeout, what=f"{name} to roll out")

    def rolled_out(self, name: str) -> bool:
        deployment = self.deployment(name)
        status = deployment.get("status", {})
        wanted = deployment["spec"]["replicas"]
        return bool(
            status.get("observedGeneration", 0) >= deployment["metadata"]["generation"]
            and status.get("updatedReplicas", 0) == wanted
            and status.get("replicas", 0) == wanted
            and status.get("availableReplicas", 0) == wanted
        )


@pytest.fixture
def workloads(kube_cluster: KubeCluster, namespace: str) -> Iterator[Workloads]:
    release = Workloads(kube_cluster, namespace)
    yield release
    kube_cluster.helm(
        "uninstall", release.release, "-n", namespace, "--ignore-not-found", check=False
    )


def kwok_values(nodes: list[str]) -> dict[str, Any]:
    """The chart's workloads for the EdgeConfig `demo` that the test applies itself, named after
    it, on kwok's node: stamped and rolled by the operator, but nothing runs. No operator: the
    test runs its own on the host."""
    return {
        "fullnameOverride": "demo",
        "operator": {"enabled": False},
        # Nothing makes the hub's certificates without the chart's operator, and nothing runs.
        "tls": {"enabled": False},
        "edgeConfig": {"create": False},
        "edge": {"replicas": 2, **ON_KWOK},
        "nodes": [{"id": node, **ON_KWOK} for node in nodes],
    }


def kwok_release(name: str) -> dict[str, Any]:
    """The chart's values for its demo EdgeConfig, named `name`, with its operator (as pods) and
    its workloads on kwok's node, where nothing runs: enough for what the operator writes and
    the webhook answers, at the price of the operator's pods alone."""
    return {
        "fullnameOverride": name,
        "edge": {"replicas": 1, **ON_KWOK},
        "nodes": [{"id": "node-1", **ON_KWOK}],
    }


@contextlib.contextmanager
def chart_namespace(
    cluster: KubeCluster, prefix: str, releases: Mapping[str, dict[str, Any]]
) -> Iterator[str]:
    """A fresh namespace `prefix-<random>` with the chart installed once per release (name ->
    values); on the way out each operator's log is printed, the releases and the namespace go."""
    namespace = f"{prefix}-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        for name, values in releases.items():
            path = cluster.client_home / f"values-{namespace}-{name}.json"
            path.write_text(json.dumps(values))
            cluster.helm("install", name, str(CHART), "-n", namespace, "-f", str(path))
        yield namespace
    finally:
        for name in releases:
            logs = cluster.kubectl(
                "logs", f"deploy/{name}-operator", "-n", namespace, "--tail=60", check=False
            )
            print(f"--- {name}'s operator log ---\n{logs.stdout}{logs.stderr}")
            cluster.helm("uninstall", name, "-n", namespace, "--wait", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
