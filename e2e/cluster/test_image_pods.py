"""Pods start from the image's own root file system, as their security context says.

The process kubelet runs a container of the project's image (built from the Dockerfile by
e2e/cluster/imagebuild.py) on an overlay of the image's unpacked root: the process sees the
image's files and not the host's, runs as the user the security context (or the image) names,
without the capabilities it drops, with no_new_privs, on a read-only root where asked, so a
write outside its volumes fails as it would on a real node. runAsNonRoot is refused for the
base image (whose user is root) with the kubelet's own reason.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from e2e.cluster import imagebuild
from e2e.cluster.imagebuild import dockerfile_base, project_reference
from e2e.cluster.kubelet.securitycontexts import CAPABILITIES, DEFAULT_CAPABILITIES
from tests.waiting import wait_for

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
IMAGE = project_reference()
BASE = dockerfile_base((REPO / "Dockerfile").read_text())  # the node has it too; user root
# The chart's security contexts (deploy/helm/iop-edge/values.yaml).
POD_SECURITY = {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001, "runAsNonRoot": True}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}

# What the process finds from inside: printed as one JSON line, then it waits to be inspected.
INSPECT = """
import json, os, pathlib, ssl, sys, time
def attempt(path):
    try:
        pathlib.Path(path).write_text("x")
        return "written"
    except OSError as error:
        return error.strerror
print(json.dumps({
    "ids": [os.getuid(), os.getgid(), sorted(os.getgroups())],
    "home": os.environ.get("HOME"), "path": os.environ.get("PATH"), "cwd": os.getcwd(),
    "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
    "tmp": attempt("/tmp/scratch"), "opt": attempt("/opt/iop/written"),
    "etc": attempt("/etc/written"),
    "ca_certificates": ssl.create_default_context().cert_store_stats()["x509_ca"],
    "checkout": os.path.exists(sys.argv[1]), "iop": os.path.exists("/opt/iop/bin/iop"),
}), flush=True)
time.sleep(600)
"""


def pod(name: str, container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [container], **spec},
    }


def wait_status(cluster: KubeCluster, namespace: str, name: str, state: str) -> dict[str, Any]:
    """The container's status once it is in `state` (running, waiting, terminated)."""

    def reached() -> dict[str, Any] | None:
        statuses = cluster.get("pod", name, "-n", namespace)["status"].get("containerStatuses")
        return statuses[0] if statuses and state in statuses[0]["state"] else None

    return wait_for(reached, timeout=120, what=f"{name}'s container {state}")


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def capability_mask(names: list[str]) -> int:
    return sum(1 << CAPABILITIES[name] for name in names)


def last_json_line(cluster: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    def printed() -> dict[str, Any] | None:
        out = cluster.kubectl("logs", name, "-n", namespace, check=False).stdout
        lines = [line for line in out.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else None

    return wait_for(printed, timeout=60, what=f"{name}'s report")


def test_a_pod_of_the_chart_runs_as_its_security_context_says_from_the_images_root(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    container = {
        "name": "app",
        "image": IMAGE,
        "command": ["python", "-c", INSPECT, str(REPO)],
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    kube_cluster.apply(
        pod("chart-like", container, securityContext=POD_SECURITY, volumes=[
            {"name": "tmp", "emptyDir": {}}]), "-n", namespace,
    )  # fmt: skip
    status = wait_status(kube_cluster, namespace, "chart-like", "running")
    seen = last_json_line(kube_cluster, namespace, "chart-like")
    pid = int(status["containerID"].removeprefix("iop://"))

    assert seen["ids"] == [10001, 10001, [10001]]  # fsGroup joins the groups
    assert seen["home"] == "/nonexistent"  # the image's passwd entry for 10001
    assert seen["path"].startswith("/opt/iop/bin:")  # the image's ENV
    assert (seen["unbuffered"], seen["cwd"]) == ("1", "/")
    assert seen["tmp"] == "written"  # the emptyDir
    assert seen["opt"] == "Read-only file system"
    assert seen["etc"] == "Read-only file system"
    assert seen["ca_certificates"] > 100  # the image finds its CA certificates
    assert (seen["checkout"], seen["iop"]) == (False, True)  # the image's root, not the host's

    process = proc_status(pid)
    assert process["Uid"].split()[:2] == ["10001", "10001"]
    assert process["Gid"].split()[:2] == ["10001", "10001"]
    assert int(process["CapEff"], 16) == int(process["CapBnd"], 16) == 0
    assert process["NoNewPrivs"] == "1"
    root = Path(f"/proc/{pid}/root")
    assert (root / "opt" / "iop" / "bin" / "iop").exists()
    assert not (root / str(REPO).lstrip("/")).exists()
    assert "bookworm" in (root / "etc" / "os-release").read_text()
    assert status["imageID"].startswith("ghcr.io/iop-edge/iop-edge@sha256:")


@pytest.mark.parametrize(
    ("security", "path", "error"),
    [
        pytest.param(CONTAINER_SECURITY, "/opt/iop/written", "Read-only file system", id="ro-root"),
        pytest.param({}, "/etc/written", "Permission denied", id="image-user-not-root"),
    ],
)
def test_a_process_writing_outside_its_volumes_fails_as_on_a_real_node(
    kube_cluster: KubeCluster, namespace: str, security: dict[str, Any], path: str, error: str
) -> None:
    container = {
        "name": "writer",
        "image": IMAGE,
        "command": ["python", "-c", f"open({path!r}, 'w').write('x')"],
        "securityContext": security,
    }
    kube_cluster.apply(pod("writer", container, restartPolicy="Never"), "-n", namespace)

    status = wait_status(kube_cluster, namespace, "writer", "terminated")

    assert status["state"]["terminated"]["exitCode"] == 1
    output = kube_cluster.kubectl("logs", "writer", "-n", namespace).stdout
    assert f"[Errno {30 if 'Read-only' in error else 13}] {error}: '{path}'" in output


@pytest.mark.parametrize(
    ("image", "security", "reason"),
    [
        pytest.param(
            BASE, {"runAsNonRoot": True}, "container has runAsNonRoot and image will run as root",
            id="root-image-user",
        ),
        pytest.param(
            IMAGE, {"runAsNonRoot": True, "runAsUser": 0},
            "container's runAsUser breaks non-root policy", id="run-as-user-0",
        ),
    ],
)  # fmt: skip
def test_run_as_non_root_with_a_root_user_is_refused_with_the_kubelets_reason(
    kube_cluster: KubeCluster, namespace: str, image: str, security: dict[str, Any], reason: str
) -> None:
    container = {
        "name": "app",
        "image": image,
        "command": ["sleep", "600"],
        "securityContext": security,
    }
    kube_cluster.apply(pod("rootless", container), "-n", namespace)

    def refused() -> dict[str, Any] | None:
        statuses = kube_cluster.get("pod", "rootless", "-n", namespace)["status"].get(
            "containerStatuses"
        )
        waiting = statuses[0]["state"].get("waiting") if statuses else None
        return waiting if waiting and waiting["reason"] == "CreateContainerConfigError" else None

    waiting = wait_for(refused, timeout=60, what="CreateContainerConfigError")
    uid = kube_cluster.get("pod", "rootless", "-n", namespace)["metadata"]["uid"]
    assert waiting["message"] == (f'{reason} (pod: "rootless_{namespace}({uid})", container: app)')


def test_a_root_image_runs_as_root_with_the_runtimes_default_capabilities(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    """The base image has no USER: root, with the default set and no no_new_privs; a drop
    takes one capability away from the bounding set."""
    container = {
        "name": "app",
        "image": BASE,
        "command": ["sleep", "600"],
        "securityContext": {"capabilities": {"drop": ["NET_RAW"]}},
    }
    kube_cluster.apply(pod("root", container), "-n", namespace)
    status = wait_status(kube_cluster, namespace, "root", "running")
    pid = int(status["containerID"].removeprefix("iop://"))

    process = proc_status(pid)
    expected = capability_mask([c for c in DEFAULT_CAPABILITIES if c != "NET_RAW"])
    assert process["Uid"].split()[0] == "0"
    assert int(process["CapBnd"], 16) == int(process["CapEff"], 16) == expected
    assert process["NoNewPrivs"] == "0"
    assert not Path(f"/proc/{pid}/root/opt/iop").exists()  # the base's root, not the project's


def test_entrypoint_and_cmd_run_when_the_pod_gives_neither(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    container = {"name": "app", "image": IMAGE}
    kube_cluster.apply(pod("defaults", container, restartPolicy="Never"), "-n", namespace)

    status = wait_status(kube_cluster, namespace, "defaults", "terminated")

    assert status["state"]["terminated"]["exitCode"] == 0
    output = kube_cluster.kubectl("logs", "defaults", "-n", namespace).stdout
    assert output.startswith("usage: iop"), output  # ENTRYPOINT ["iop"], CMD ["--help"]


def test_the_project_is_a_small_layer_of_its_own_over_the_dependencies(
    kube_cluster: KubeCluster,
) -> None:
    """The image's last layer holds the project and nothing else, the one below it the locked
    dependencies without the project: a change under src/ rebuilds only the last (the Dockerfile's
    final stage), and the layer of dependencies keeps its digest, so neither buildah nor the
    kubelet's unpacking redo it. Every module is there with its bytecode (the root is read-only)."""
    built = imagebuild.build()  # the session's build: up to date, a no-op
    layout = Path(built.layout)

    def blob(digest: str) -> Path:
        return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")

    def files(digest: str) -> dict[str, int]:
        with tarfile.open(blob(digest), "r:*") as tar:
            return {member.name: member.size for member in tar if member.isfile()}

    base = {layer["digest"] for layer in json.loads(blob(built.base_digest).read_text())["layers"]}
    layers = json.loads(blob(built.digest).read_text())["layers"]
    *_, dependencies, project = [files(x["digest"]) for x in layers if x["digest"] not in base]

    site = re.compile(r"opt/iop/lib/python3\.\d+/site-packages/")
    ours = re.compile(site.pattern + r"(iop/|iop_edge-[^/]+\.dist-info/)|opt/iop/bin/iop$")
    assert sorted(name for name in project if not ours.match(name)) == []
    assert sum(project.values()) < 5_000_000, sum(project.values())
    modules = {
        path.relative_to(REPO / "src").as_posix()
        for path in (REPO / "src" / "iop").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    in_layer = {site.sub("", name) for name in project}
    assert modules <= in_layer
    compiled = {
        f"{name.rsplit('/', 1)[0]}/__pycache__/{name.rsplit('/', 1)[1][:-3]}.cpython-"
        for name in modules
    }
    assert all(any(name.startswith(prefix) for name in in_layer) for prefix in compiled)
    assert not [name for name in dependencies if ours.match(name)]
    assert any(site.sub("", name) == "kubernetes/client/__init__.py" for name in dependencies)
