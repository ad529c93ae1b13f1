"""End-to-end fixtures: a real, local Kubernetes control plane from e2e/cluster.

`kube_cluster` (session scope) gives a running cluster: the one already running (per
`e2e/cluster/status`) or one started for this session and stopped at its end. Its pods run the
project's image, built from the Dockerfile first if its inputs changed (e2e/cluster/imagebuild.py).
The cluster is started before the first test that uses the fixture, outside that test's timeout,
and only when a selected test uses it; if that fails, every test that needs it fails with the
reason (none is skipped). In a parallel run (pytest-xdist, `--dist loadgroup`) a module's tests
run on one worker, in order, and each worker that runs such a test gets a cluster of its own: a
state directory of its own (`IOP_CLUSTER_STATE` with the run and the worker appended), hence its
own network slot and ports, started for this run and stopped at the worker's end.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from e2e.cluster.layout import LAUNCHER, lock_path, python_command, python_env
from iop.processes import share_ports
from tests.waiting import wait_for

T = TypeVar("T")

FIXTURE = "kube_cluster"


class CommandFailed(AssertionError):
    """A kubectl or helm call that was expected to succeed did not."""


@dataclass(frozen=True)
class KubeCluster:
    """A running cluster and its clients, kubectl and helm, preconfigured for it."""

    kubeconfig: Path
    bin_dir: Path
    client_home: Path

    @property
    def env(self) -> dict[str, str]:
        """Environment for any client of this cluster (kubectl, helm, a test's own program)."""
        home = self.client_home
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "KUBECACHEDIR": str(home / "kube-cache"),
            "HELM_CACHE_HOME": str(home / "helm-cache"),
            "HELM_CONFIG_HOME": str(home / "helm-config"),
            "HELM_DATA_HOME": str(home / "helm-data"),
        }

    def run(
        self,
        tool: str,
        *args: str,
        stdin: str | None = None,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.bin_dir / tool), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise CommandFailed(
                f"{tool} {' '.join(args)} exited with {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, stdin=stdin, check=check, timeout=timeout)

    def helm(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, stdin=stdin, check=check, timeout=timeout)

    def get(self, *args: str) -> Any:
        """`kubectl get ... -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, manifest: dict[str, Any] | str, *args: str) -> str:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self.kubectl("apply", "-f", "-", *args, stdin=text).stdout

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Pods matching `selector` that are not being deleted."""
        items = self.get("pods", "-n", namespace, "-l", selector)["items"]
        return [pod for pod in items if "deletionTimestamp" not in pod["metadata"]]

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (e2e/cluster/localcluster.py, AUDIT_POLICY): the calls of
        workloads' ServiceAccounts."""
        return self.kubeconfig.parent / "logs" / "audit.log"

    def audit(self, user: str) -> list[dict[str, Any]]:
        """The audit events of `user` (`system:serviceaccount:NS:NAME`), in order."""
        events = []
        for path in sorted(self.audit_log.parent.glob("audit*.log")):
            with path.open(encoding="utf-8") as stream:
                for line in stream:
                    if f'"{user}"' in line:
                        event = json.loads(line)
                        if event.get("user", {}).get("username") == user:
                            events.append(event)
        return events

    def condition(self, resource: str, kind: str, *, namespace: str | None = None) -> str | None:
        """The status ("True", "False", "Unknown") of condition `kind` of `resource`
        (`crd/NAME`, `pod/NAME`), or None while it has none: an object the API server has just
        written may have no conditions yet (or `conditions: null`), which `kubectl wait
        --for=condition` reports as an error instead of waiting."""
        args = ["get", resource, "-o", "json", *(["-n", namespace] if namespace else [])]
        found = self.kubectl(*args, check=False)
        if found.returncode != 0:
            return None
        conditions = (json.loads(found.stdout).get("status") or {}).get("conditions") or ()
        return next((c.get("status") for c in conditions if c.get("type") == kind), None)

    def wait_condition(
        self, resource: str, kind: str, *, namespace: str | None = None, timeout: float = 30
    ) -> None:
        """Wait until condition `kind` of `resource` is True, as a user's script must."""
        wait_for(
            lambda: self.condition(resource, kind, namespace=namespace) == "True",
            timeout=timeout,
            what=f"{resource} to be {kind}",
        )


@dataclass
class ClusterSession:
    """What the session did: the cluster it got or why it got none, and whether it started it."""

    cluster: KubeCluster | None = None
    error: str | None = None
    started_here: bool = False
    client_home: tempfile.TemporaryDirectory[str] = field(
        default_factory=lambda: tempfile.TemporaryDirectory(prefix="iop-e2e-clients-")
    )


SESSION = pytest.StashKey[ClusterSession]()


def _launch(config: pytest.Config, command: str, *args: str) -> tuple[int, str]:
    """Run a launcher subcommand, showing its progress live; returns (code, last lines)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    # A worker's terminal reporter writes nowhere; its standard error is the run's.
    reporter = None if worker else config.pluginmanager.getplugin("terminalreporter")
    prefix = f"[{worker}] " if worker else ""

    def show(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(f"{prefix}{line}", file=sys.stderr, flush=True)

    last: collections.deque[str] = collections.deque(maxlen=60)
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        show(f"e2e cluster: {' '.join([f'cluster/{command}', *args])}")
        with subprocess.Popen(
            python_command(LAUNCHER, command, *args),
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as process:
            assert process.stdout is not None
            for line in process.stdout:
                last.append(line.rstrip("\n"))
                show(f"  {line.rstrip()}")
            code = process.wait()
    return code, "\n".join(last)


def _status() -> tuple[int, dict[str, Any]]:
    result = subprocess.run(
        python_command(LAUNCHER, "status", "--json"),
        env=python_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        report: dict[str, Any] = json.loads(result.stdout)
    except ValueError:
        report = {"status": "unknown", "error": result.stderr}
    return result.returncode, report


def _open_session(config: pytest.Config) -> ClusterSession:
    session = ClusterSession()
    # The image the pods run is built from the Dockerfile when its inputs changed, and loaded
    # into the cluster if one runs already (`up` loads it into a cluster it starts).
    code, output = _launch(config, "image")
    if code != 0:
        session.error = f"the project's image could not be built:\n{output}"
        return session
    code, report = _status()
    if code != 0:
        code, output = _launch(config, "up")
        if code != 0:
            session.error = f"the local Kubernetes cluster did not start:\n{output}"
            return session
        session.started_here = True
        code, report = _status()
        if code != 0:
            session.error = f"the cluster started but is not healthy: {json.dumps(report)}"
            return session
    session.cluster = KubeCluster(
        kubeconfig=Path(report["kubeconfig"]),
        bin_dir=Path(report["bin_dir"]),
        client_home=Path(session.client_home.name),
    )
    return session


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:  # ports and a cluster of this worker's own, as in tests/conftest.py
        share_ports(int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "run")[:8]
        shared = os.environ.get("IOP_CLUSTER_STATE") or str(
            Path(tempfile.gettempdir()) / f"iop-cluster-{os.getuid()}"
        )
        os.environ["IOP_CLUSTER_STATE"] = f"{shared}-{run}-{worker}"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own choice
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadgroup` (as `make test` runs): the tests of one end-to-end module are one
    unit of work, run by one worker in their order, so what a module sets up once (a chart
    installed, an operator started) and what its later tests read of its earlier ones stay on
    one cluster; every other test is a unit of its own. The units with the most tests go first.

    pytest-xdist's own loadgroup scheduler groups by the `xdist_group` mark through the test's
    node id, which pytest 9.2 no longer lets it change (pytest-xdist#1386): it groups nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndModules(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith("e2e/"):
                return nodeid.partition("::")[0]
            return nodeid

    return EndToEndModules(config, log)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)  # outside pytest-timeout's timer
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    config = item.config
    if FIXTURE in getattr(item, "fixturenames", ()) and SESSION not in config.stash:
        config.stash[SESSION] = _open_session(config)
    yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash.get(SESSION, None)
    if state is None:
        return
    if state.started_here:
        _launch(session.config, "down")
        if os.environ.get("PYTEST_XDIST_WORKER") is not None:
            # This run's own state name (`pytest_configure`): nobody else locks it again.
            lock_path().unlink(missing_ok=True)
    state.client_home.cleanup()


@pytest.fixture(scope="session")
def kube_cluster(pytestconfig: pytest.Config) -> KubeCluster:
    """A running local cluster (see e2e/cluster/README.md); fails the test if there is none."""
    if SESSION not in pytestconfig.stash:  # requested dynamically, not seen at collection
        pytestconfig.stash[SESSION] = _open_session(pytestconfig)
    state = pytestconfig.stash[SESSION]
    if state.cluster is None:
        pytest.fail(state.error or "no cluster", pytrace=False)
    return state.cluster


@pytest.fixture
def namespace(kube_cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (with everything in it)."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{slug}-{secrets.token_hex(3)}"
    kube_cluster.kubectl("create", "namespace", name)
    # Pods cannot be created before the controller manager gives the namespace its default
    # ServiceAccount; waiting here keeps that race out of every test.
    probe = ("get", "serviceaccount", "default", "-n", name)
    wait_for(
        lambda: kube_cluster.kubectl(*probe, check=False).returncode == 0,
        timeout=30,
        interval=0.1,
        what=f"namespace {name}'s default ServiceAccount",
    )
    try:
        yield name
    finally:
        kube_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")
