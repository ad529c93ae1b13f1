"""A second cluster beside the session's: it starts, runs a pod, and `down` leaves nothing.

Several clusters share one machine (each engineer's worktree has its own), so this one gets a
state directory of its own; the session's cluster must still be healthy afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from e2e.cluster.imagebuild import project_reference
from e2e.cluster.layout import LAUNCHER, python_command, python_env

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

pytestmark = pytest.mark.e2e

IMAGE = project_reference()  # what the cluster's node has: the Dockerfile's build


def launch(state: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = python_env({**os.environ, "IOP_CLUSTER_STATE": str(state)})
    return subprocess.run(
        python_command(LAUNCHER, *args),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def alive(process: dict[str, Any]) -> bool:
    """The recorded process still runs (a zombie waiting for its reaper does not count)."""
    try:
        stat = Path(f"/proc/{process['pid']}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] != "Z" and int(fields[19]) == process["start_time"]


@pytest.mark.timeout(240)
def test_down_of_a_second_cluster_leaves_nothing_and_spares_the_first(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    state = tmp_path / "second-cluster"
    started = launch(state, "up", timeout=150)
    try:
        assert started.returncode == 0, started.stderr
        recorded = json.loads((state / "cluster.json").read_text())
        network = recorded["network"]
        env = {**os.environ, "KUBECONFIG": str(state / "kubeconfig")}
        kubectl = [str(kube_cluster.bin_dir / "kubectl"), "-n", "default"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sleeper"},
            "spec": {
                "containers": [{"name": "sleeper", "image": IMAGE, "command": ["sleep", "3600"]}]
            },
        }
        subprocess.run(
            [*kubectl, "apply", "-f", "-"], input=json.dumps(pod), env=env, check=True,
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        waited = subprocess.run(
            [*kubectl, "wait", "--for=condition=Ready", "pod/sleeper", "--timeout=60s"],
            env=env, capture_output=True, text=True, timeout=70, check=False,
        )  # fmt: skip
        assert waited.returncode == 0, waited.stderr
        listed = subprocess.run(
            [*kubectl, "get", "pod", "sleeper", "-o", "json"], env=env, check=True,
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        (container,) = json.loads(listed.stdout)["status"]["containerStatuses"]
        sleeper = int(container["containerID"].removeprefix("iop://"))
        sleeper_start = int(Path(f"/proc/{sleeper}/stat").read_text().rsplit(")", 1)[1].split()[19])
        pod_netns = f"iop-{network['id']}-"
        assert any(name.startswith(pod_netns) for name in os.listdir("/run/netns"))
    finally:
        began = time.monotonic()
        stopped = launch(state, "down", timeout=90)
    print(f"down of the second cluster: {time.monotonic() - began:.1f}s")
    assert stopped.returncode == 0, stopped.stderr

    assert not state.exists()
    assert not [p for p in recorded["processes"].values() if alive(p)]
    assert not alive({"pid": sleeper, "start_time": sleeper_start})
    assert not [n for n in os.listdir("/run/netns") if n.startswith(f"iop-{network['id']}-")]
    assert not Path(f"/sys/class/net/iop{network['id']}").exists()
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    assert f"10.250.{network['slot']}.0/24" not in routes
    # The session's cluster is untouched.
    status = subprocess.run(
        python_command(LAUNCHER, "status"),
        env=python_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert status.returncode == 0, status.stdout
