"""`up`, `down`, `status` and `image`: start the components in order and wait until each is
healthy, stop exactly what `up` started, say what runs, and build the project's image and load
it into the cluster (imagebuild.py). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from . import clusternet, imagebuild
from .certificates import kubeconfig, make_pki
from .components import child_env, command_lines, spawn, write_configs
from .gobuilding import Build, current_build, ensure_built
from .layout import (
    COMPONENTS,
    HERE,
    KUBELET_NODE,
    KWOK_NODE_ANNOTATION,
    KWOK_TAINT,
    LOOPBACK,
    MARKER,
    NODE_NAME,
    PROGRAM,
    ClusterError,
    file_lock,
    lock_path,
    log,
    state_dir,
)
from .states import State, free_ports, tail


def no_proxy_opener(context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


@dataclass
class Probe:
    """HTTP(S) health and API calls against a (possibly half-started) cluster."""

    state: State

    def __post_init__(self) -> None:
        pki = self.state.pki
        self.verify_only = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.as_admin = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.as_admin.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self.plain = no_proxy_opener(None)
        self.verified = no_proxy_opener(self.verify_only)
        self.admin = no_proxy_opener(self.as_admin)

    def _get(self, opener: urllib.request.OpenerDirector, url: str) -> str | None:
        try:
            with opener.open(url, timeout=2) as response:
                body: bytes = response.read()
                return body.decode()
        except (OSError, urllib.error.URLError, ssl.SSLError):
            return None

    def check(self, name: str) -> Callable[[], bool]:
        return lambda: self.healthy(name)

    def healthy(self, name: str) -> bool:
        ports = self.state.ports
        if name == "etcd":
            body = self._get(self.plain, f"http://{LOOPBACK}:{ports['etcd']}/health")
            return body is not None and '"health":"true"' in body.replace(" ", "")
        if name == "kube-apiserver":
            return self._get(self.admin, f"{self.apiserver}/readyz") == "ok"
        if name == "kube-controller-manager":
            url = f"https://{LOOPBACK}:{ports['controller-manager']}/healthz"
            return self._get(self.verified, url) == "ok"
        if name == "kube-scheduler":
            url = f"https://{LOOPBACK}:{ports['scheduler']}/healthz"
            return self._get(self.verified, url) == "ok"
        if name == "kwok":
            return self.node_ready(NODE_NAME)
        net = self.state.net
        if name == "coredns":
            url = f"http://{net.host_ip}:{ports['coredns-ready']}/ready"
            return self._get(self.plain, url) is not None
        if name == "kube-proxy":
            url = f"http://{net.node_ip}:{ports['kube-proxy-health']}/healthz"
            return self._get(self.plain, url) is not None
        if name == "kubelet":
            return self.node_ready(KUBELET_NODE)
        raise ValueError(name)

    @property
    def apiserver(self) -> str:
        return self.state.apiserver

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.apiserver}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with self.admin.open(request, timeout=5) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            with error:
                return error.code, json.loads(error.read() or b"null")
        except (OSError, ValueError, ssl.SSLError):
            return 0, None

    def failing_readiness_checks(self) -> list[str]:
        try:
            with self.admin.open(f"{self.apiserver}/readyz?verbose", timeout=5) as response:
                body: bytes = response.read()
        except urllib.error.HTTPError as error:
            with error:
                body = error.read()
        except (OSError, ssl.SSLError):
            return []
        return [line for line in body.decode(errors="replace").splitlines() if "[-]" in line]

    def node_ready(self, name: str) -> bool:
        code, node = self.api("GET", f"/api/v1/nodes/{name}")
        if code != 200:
            return False
        conditions = node.get("status", {}).get("conditions", [])
        # The node lifecycle controller lifts the not-ready taint a moment after Ready: until
        # then nothing is scheduled there.
        taints = node.get("spec", {}).get("taints") or []
        not_ready = any(t.get("key") == "node.kubernetes.io/not-ready" for t in taints)
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        return ready and not not_ready

    def register_node(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": NODE_NAME,
                "annotations": {
                    KWOK_NODE_ANNOTATION: "fake",
                    "node.alpha.kubernetes.io/ttl": "0",
                },
                "labels": {
                    "kubernetes.io/hostname": NODE_NAME,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                },
            },
            "spec": {"taints": [KWOK_TAINT]},
        }
        code, body = self.api("POST", "/api/v1/nodes", node)
        if code not in (201, 409):
            raise ClusterError(f"registering Node {NODE_NAME} failed ({code}): {body}")

    def default_service_account(self) -> bool:
        code, _ = self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
        return code == 200


# The kubelet stops its pods (5 s grace each, in parallel) before it exits.
STOP_GRACE = {"kubelet": 20.0}


def stop_processes(state: State, *, grace: float = 10.0) -> list[str]:
    """Stop the processes recorded in `state`, newest first, by PID only. Returns their names.

    Then whatever still runs in the cluster's network namespaces (pods of a kubelet that died)
    is killed and the namespaces and host link are removed (clusternet.teardown).
    """
    stopped = []
    for name in reversed(COMPONENTS):
        started = state.processes.get(name)
        if started is None or not started.alive():
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(started.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE.get(name, grace)
        while started.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if started.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(started.pid, signal.SIGKILL)
            while started.alive():
                time.sleep(0.05)
        stopped.append(name)
    if state.network is not None:
        with clusternet.machine_lock():
            for what in clusternet.teardown(state.network):
                log(f"removed {what}")
    return stopped


def remove_state(root: Path) -> None:
    # Only a directory `up` made (it carries the marker) is ever deleted.
    if (root / MARKER).is_file():
        shutil.rmtree(root)


@dataclass(frozen=True)
class Health:
    running: dict[str, bool]
    healthy: dict[str, bool]

    @property
    def all_healthy(self) -> bool:
        return all(self.running.values()) and all(self.healthy.values())

    @property
    def anything_running(self) -> bool:
        return any(self.running.values())


def check(state: State) -> Health:
    probe = Probe(state)
    running = {
        name: state.processes[name].alive() for name in COMPONENTS if name in state.processes
    }
    running.update({name: False for name in COMPONENTS if name not in running})
    healthy = {name: running[name] and probe.healthy(name) for name in COMPONENTS}
    return Health(running=running, healthy=healthy)


def exports(state: State) -> str:
    return f"export KUBECONFIG={state.kubeconfig}\nexport PATH={state.bin_dir}:$PATH\n"


def ensure_image() -> imagebuild.Build:
    """The project's image, built from the Dockerfile unless its inputs are unchanged."""
    try:
        built = imagebuild.build()
        imagebuild.prepare(built)
        return built
    except imagebuild.ImageError as error:
        raise ClusterError(f"the project's image could not be built: {error}") from None


def load_image() -> None:
    """`image`: build the project's image if its inputs changed; load it into the cluster if
    one runs, so its next containers start from it."""
    built = ensure_image()
    root = state_dir()
    if State.load(root) is not None:
        imagebuild.load(root, built)
        log(f"loaded {built.reference}@{built.digest[:19]} into {root}")


def up(timeout: float) -> State:
    build_ = ensure_built()
    image = ensure_image()
    root = state_dir()
    with file_lock(lock_path()):
        existing = State.load(root)
        if existing is not None:
            health = check(existing)
            if health.all_healthy and existing.bin_dir == build_.bin_dir:
                imagebuild.load(root, image)
                log(f"already running: {root} (image {image.reference}@{image.digest[:19]})")
                return existing
            log("found a stopped or unhealthy cluster: cleaning it up first")
            stop_processes(existing)
        elif clusternet.Network(id=clusternet.cluster_id(root), slot=0).leftovers():
            # A state directory deleted by hand: its namespaces may still be there.
            with clusternet.machine_lock():
                clusternet.teardown(clusternet.Network(id=clusternet.cluster_id(root), slot=0))
        if root.exists():
            if not (root / MARKER).is_file():
                raise ClusterError(f"{root} exists but was not made by {PROGRAM}: not touching it")
            shutil.rmtree(root)
        for attempt in (1, 2):
            try:
                return start(root, build_, image, timeout)
            except PortTaken as error:
                if attempt == 2:
                    raise ClusterError(str(error)) from None
                log("a port was taken meanwhile: trying again with new ports")
                remove_state(root)
    raise AssertionError("unreachable")


class PortTaken(ClusterError):
    pass


def start(root: Path, build_: Build, image: imagebuild.Build, timeout: float) -> State:
    began = time.monotonic()
    root.mkdir(mode=0o700, parents=True)
    (root / MARKER).write_text(f"made by {HERE / 'localcluster.py'}\n")
    (root / "logs").mkdir()
    imagebuild.load(root, image)
    state = State(root=root, bin_dir=build_.bin_dir, ports={}, processes={})
    try:
        try:
            state.network = clusternet.create(root)
        except clusternet.NetworkError as error:
            raise ClusterError(f"the pod network could not be made: {error}") from None
        state.save()
        launch(state, build_, began, began + timeout)
    except BaseException as error:
        # Everything started so far stops; the network goes too (stop_processes).
        stop_processes(state)
        if isinstance(error, ClusterError):
            log(f"start failed; logs kept in {root / 'logs'}")
        raise
    log(f"ready in {time.monotonic() - began:.1f}s: {root}")
    return state


def launch(state: State, build_: Build, began: float, deadline: float) -> None:
    """Certificates, then every component in order, each awaited until healthy."""
    net = state.net
    log(f"network: pods {net.pod_cidr}, services {net.service_cidr}, node netns {net.node_netns}")
    loopback = ("etcd", "etcd-peer", "controller-manager", "scheduler")
    on_link = ("apiserver", "kubelet", "coredns-health", "coredns-ready")
    state.ports = {
        **dict(zip(loopback, free_ports(len(loopback)), strict=True)),
        **dict(zip(on_link, free_ports(len(on_link), net.host_ip), strict=True)),
        # In the node namespace, where nothing else listens.
        "kube-proxy-health": 10256,
        "kube-proxy-metrics": 10249,
    }
    make_pki(state.pki, net)
    state.kubeconfig.write_text(kubeconfig(state.apiserver, state.pki, "admin"))
    state.kubeconfig.chmod(0o600)
    write_configs(state)
    argv = command_lines(state, build_)
    env = child_env(state)
    state.save()
    probe = Probe(state)
    # etcd and the API server start together (the API server retries etcd); the others
    # start once it is ready, as they read RBAC-protected objects on start and give up.
    for name in ("etcd", "kube-apiserver"):
        state.processes[name] = spawn(name, argv[name], state, env)
        state.save()
    await_checks(state, began, deadline, {name: probe.check(name) for name in state.processes})
    for name in COMPONENTS[2:]:
        state.processes[name] = spawn(name, argv[name], state, env)
        state.save()
    probe.register_node()
    checks = {name: probe.check(name) for name in COMPONENTS[2:]}
    await_checks(state, began, deadline, checks)
    # Pods need their namespace's default ServiceAccount, which the controller manager
    # makes; seeing it in `default` shows its controllers run.
    sa_check = {"kube-controller-manager": probe.default_service_account}
    await_checks(state, began, deadline, sa_check, what="default ServiceAccount")


def await_checks(
    state: State,
    began: float,
    deadline: float,
    checks: Mapping[str, Callable[[], bool]],
    what: str = "healthy",
) -> None:
    """Poll each component's check until all pass; fail on a dead process or at the deadline."""
    pending = dict(checks)
    while pending:
        for name, started in state.processes.items():
            if not started.alive():
                failure(state, name, "exited")
        for name, check_ in list(pending.items()):
            if check_():
                del pending[name]
                log(f"{name}: {what} ({time.monotonic() - began:.1f}s)")
        if pending and time.monotonic() > deadline:
            name = next(iter(pending))
            failure(state, name, f"not {what} after {deadline - began:.0f}s")
        if pending:
            time.sleep(0.1)


def failure(state: State, name: str, what: str) -> NoReturn:
    log_text = tail(state.log_file(name))
    message = f"{name} {what}; last lines of {state.log_file(name)}:\n{log_text}"
    if name == "kube-apiserver" and state.processes[name].alive():
        # Which readiness checks still fail says more than the log's last lines.
        failing = Probe(state).failing_readiness_checks()
        if failing:
            message += "\nfailing readiness checks:\n" + "\n".join(failing)
    if "address already in use" in log_text:
        raise PortTaken(message)
    raise ClusterError(message)


def down() -> list[str]:
    root = state_dir()
    with file_lock(lock_path()):
        state = State.load(root)
        stopped = stop_processes(state) if state is not None else []
        if root.exists():
            if not (root / MARKER).is_file():
                raise ClusterError(f"{root} was not made by {PROGRAM}: not touching it")
            remove_state(root)
    return stopped


def status_report() -> tuple[int, dict[str, Any]]:
    root = state_dir()
    state = State.load(root)
    report: dict[str, Any] = {
        "state_dir": str(root),
        "kubeconfig": None,
        "bin_dir": str(current_build().bin_dir),
        "built": current_build().complete(),
        "components": {},
    }
    if state is None:
        report["status"] = "stopped"
        return 3, report
    health = check(state)
    report["kubeconfig"] = str(state.kubeconfig)
    report["bin_dir"] = str(state.bin_dir)
    report["ports"] = state.ports
    if state.network is not None:
        net = state.network
        report["network"] = {
            "id": net.id,
            "node_netns": net.node_netns,
            "host_link": f"{net.host_veth} {net.host_ip}",
            "pod_cidr": str(net.pod_cidr),
            "service_cidr": str(net.service_cidr),
            "cluster_dns": net.host_ip,
            "namespaces": net.namespaces(),
        }
    for name in COMPONENTS:
        started = state.processes.get(name)
        report["components"][name] = {
            "pid": started.pid if started else None,
            "running": health.running[name],
            "healthy": health.healthy[name],
            "log": str(state.log_file(name)),
        }
    if health.all_healthy:
        report["status"] = "running"
        return 0, report
    if health.anything_running:
        report["status"] = "degraded"
        return 1, report
    report["status"] = "stopped"
    return 3, report
