"""The local cluster's layout: where it keeps things, what its parts are called, how it reports.

The per-user cache of built binaries (`cache_root`), this cluster's state directory
(`state_dir`, `IOP_CLUSTER_STATE`) and the lock that serialises `up` and `down`; the components
in their start order, the addresses and names they share (the kwok Node, the kubelet's Node, the
cluster domain); `ClusterError` and `log`, the one way every part reports to the user; how a
module of this checkout is started as a program of its own (`python_command`, `python_env`).
Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent


GO_MOD = HERE / "go.mod"


GO_SUM = HERE / "go.sum"


CHECKOUT = HERE.parent.parent


#: The command line's module (the executables `build`, `up`, `down`, `status` run it).
LAUNCHER = "e2e.cluster.localcluster"


# Start order; `down` stops in reverse.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "coredns",
    "kube-proxy",
    "kubelet",
)


LOOPBACK = "127.0.0.1"


# The Service range, pod range and host link are this cluster's slot of 10.250-252.N.0/24
# (clusternet.py): ClusterIPs are translated by kube-proxy in the node namespace, and every
# address is on this machine. kwok's fake pods get addresses from 10.244.0.0/16, which nothing
# routes: they never run.
KWOK_POD_CIDR = "10.244.0.1/16"


NODE_NAME = "kwok-node-0"


KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"


# kwok's Node is tainted, so only pods that tolerate this (and select it) go there; every other
# pod lands on the kubelet's Node and really runs.
KWOK_TAINT = {"key": KWOK_NODE_ANNOTATION, "value": "fake", "effect": "NoSchedule"}


KUBELET_NODE = "process-node-0"


CLUSTER_DOMAIN = "cluster.local"


MARKER = ".iop-cluster"


PROGRAM = "iop-cluster"


class ClusterError(Exception):
    """A failure the user must see: the message says what failed and why."""


def log(message: str) -> None:
    print(f"{PROGRAM}: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    configured = os.environ.get("IOP_CLUSTER_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "iop-edge" / "cluster"


def state_dir() -> Path:
    configured = os.environ.get("IOP_CLUSTER_STATE")
    if configured:
        return Path(configured).expanduser()
    return Path(f"/tmp/iop-cluster-{os.getuid()}")


def lock_path() -> Path:
    # Beside the state directory, not inside it: `down` deletes the directory.
    state = state_dir()
    return state.with_name(state.name + ".lock")


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def python_command(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """`python -P -m module args`: a module of this checkout as a program, run with
    `python_env`. -P keeps the current folder off the path, so another checkout's `e2e` there
    is never the one imported."""
    return [python, "-P", "-m", module, *args]


def python_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`env` with this checkout first on PYTHONPATH, where `python_command` finds its module."""
    rest = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(CHECKOUT), rest]))}
