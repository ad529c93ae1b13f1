#!/usr/bin/env python3
"""A real, local Kubernetes cluster for the end-to-end tests, with pods that really run.

`kind` needs a container engine and this project's machines have none, so the control plane is
built from pinned Go modules (go.mod/go.sum beside this file, CoreDNS from coredns/go.mod) and
run as plain processes: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok (a
fake Node whose Pods reach Running without running), CoreDNS, kube-proxy and a process kubelet
(kubelet/, a Node whose pods run as processes of the project's image in network namespaces of
their own, wired as clusternet.py says), with kubectl and helm for the tests.

Subcommands (the executables `build`, `up`, `down`, `status` beside this file call them):

    build   build the binaries into the per-user cache unless they already match the pins
    up      start the cluster (building first if needed), print `export KUBECONFIG=...`
    down    stop exactly the processes `up` started and remove the state directory
    status  say what runs (`--json` for machines); exit 0 healthy, 1 degraded, 3 stopped
    pin     re-pin k8s.io/kubernetes and rewrite the staging `replace` block in go.mod

Standard library only (plus the `openssl` and `ip` commands), so it runs on any python3 >=
3.11; the kubelet it starts runs in the checkout's virtualenv (scripts/bootstrap makes it).
etcd, the controller manager and the scheduler bind 127.0.0.1; the API server, CoreDNS and the
kubelet bind the host's end of this cluster's link to its node namespace (clusternet.py).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
GO_MOD = HERE / "go.mod"
GO_SUM = HERE / "go.sum"
CHECKOUT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import clusternet  # noqa: E402
import hostpackages  # noqa: E402
import imagebuild  # noqa: E402
from clusternet import Network  # noqa: E402

# Bump when the way binaries are built changes (flags, ldflags, extra files): it is part of the
# cache key, so every checkout rebuilds instead of trusting binaries made by an older recipe.
RECIPE = "2"

# Output name -> Go package (each one is listed in go.mod's `tool` block).
BINARIES: dict[str, str] = {
    "etcd": "go.etcd.io/etcd/server/v3",
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "kwok": "sigs.k8s.io/kwok/cmd/kwok",
    "helm": "helm.sh/helm/v3/cmd/helm",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
    "coredns": "iop-edge.local/e2e/cluster/coredns",  # coredns/main.go
}

# Binaries built from a Go module folder of their own (its dependency graph is its own);
# everything else is built from this folder's go.mod.
MODULE_DIRS: dict[str, Path] = {"coredns": HERE / "coredns"}

# The modules whose versions are "the pins" shown to people and stamped into the binaries.
PINNED_MODULES = (
    "k8s.io/kubernetes",
    "go.etcd.io/etcd/server/v3",
    "sigs.k8s.io/kwok",
    "helm.sh/helm/v3",
)
COREDNS_MODULE = "github.com/coredns/coredns"

# Debian packages the cluster needs on the host (command -> package): kube-proxy's nftables
# mode runs `nft`; the network and the kubelet run `ip` and `nsenter`.
DEBIAN_PACKAGES = {"nft": "nftables", "ip": "iproute2", "nsenter": "util-linux"}

# kwok ships its default stages (what kwokctl feeds it) as kustomize folders; the build copies the
# pinned module's own files, so a kwok bump brings its matching stages.
KWOK_STAGE_DIRS = (
    "kustomize/stage/node/fast",
    "kustomize/stage/node/heartbeat-with-lease",
    "kustomize/stage/pod/fast",
)

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


# --------------------------------------------------------------------------------------------
# Paths


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


# --------------------------------------------------------------------------------------------
# Pins and the build


def module_versions(go_mod_text: str) -> dict[str, str]:
    """The required version of each module in go.mod (`require` lines, single or in blocks)."""
    versions: dict[str, str] = {}
    for match in re.finditer(
        r"^(?:require\s+|\t)([\w./~-]+)\s+(v[^\s/]+)", go_mod_text, flags=re.MULTILINE
    ):
        versions.setdefault(match.group(1), match.group(2))
    return versions


def pins() -> dict[str, str]:
    versions = module_versions(GO_MOD.read_text())
    missing = [module for module in PINNED_MODULES if module not in versions]
    if missing:
        raise ClusterError(f"{GO_MOD} does not require {', '.join(missing)}")
    found = {module: versions[module] for module in PINNED_MODULES}
    coredns = module_versions((MODULE_DIRS["coredns"] / "go.mod").read_text())
    if COREDNS_MODULE not in coredns:
        raise ClusterError(f"{MODULE_DIRS['coredns'] / 'go.mod'} does not require {COREDNS_MODULE}")
    found[COREDNS_MODULE] = coredns[COREDNS_MODULE]
    return found


def ldflags(name: str, versions: Mapping[str, str]) -> str:
    """-ldflags for one binary: strip symbols and stamp the version the way upstream does."""
    flags = ["-s", "-w"]
    if BINARIES[name].startswith("k8s.io/kubernetes/"):
        kube = versions["k8s.io/kubernetes"]
        major, minor = kube.lstrip("v").split(".")[:2]
        stamp = {
            "gitVersion": kube,
            "gitMajor": major,
            "gitMinor": minor,
            "gitTreeState": "clean",
            "buildDate": "1970-01-01T00:00:00Z",
        }
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [f"-X={package}.{key}={value}" for key, value in stamp.items()]
    elif name == "helm":
        flags += [
            f"-X=helm.sh/helm/v3/internal/version.version={versions['helm.sh/helm/v3']}",
            "-X=helm.sh/helm/v3/internal/version.gitTreeState=clean",
        ]
    # etcd and kwok carry their versions as constants in their source.
    return " ".join(flags)


def pin_hash() -> str:
    """The cache key: everything that decides what the binaries are."""
    versions = pins()
    recipe = {name: [package, ldflags(name, versions)] for name, package in BINARIES.items()}
    digest = hashlib.sha256()
    module_files = [GO_MOD, GO_SUM]
    for folder in sorted(set(MODULE_DIRS.values())):
        module_files += [folder / "go.mod", folder / "go.sum"]
    texts = [path.read_text() for path in module_files]
    for part in (RECIPE, *texts, json.dumps(recipe)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Build:
    """One pinned set of binaries in the cache."""

    root: Path

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def kwok_stages(self) -> Path:
        return self.root / "share" / "kwok-stages.yaml"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def complete(self) -> bool:
        return (
            self.manifest.is_file()
            and self.kwok_stages.is_file()
            and all(os.access(self.binary(name), os.X_OK) for name in BINARIES)
        )


def current_build() -> Build:
    return Build(cache_root() / pin_hash())


def go_command() -> str:
    found = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.access(found, os.X_OK):
        raise ClusterError("the Go toolchain (`go`) is not on PATH nor at /usr/local/go/bin/go")
    return found


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CGO_ENABLED"] = "0"
    env["GOFLAGS"] = "-mod=readonly -buildvcs=false"
    return env


def run_go(args: Sequence[str], *, what: str, heartbeat: float = 60.0, cwd: Path = HERE) -> None:
    """Run a go command in `cwd`, letting its own output through, with a heartbeat."""
    started = time.monotonic()
    process = subprocess.Popen([go_command(), *args], cwd=cwd, env=go_env())
    next_beat = started + heartbeat
    while True:
        try:
            code = process.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= next_beat:
                log(f"  ... still {what} ({(time.monotonic() - started) / 60:.0f} min)")
                next_beat += heartbeat
        except BaseException:
            process.kill()
            process.wait()
            raise
    if code != 0:
        raise ClusterError(f"{what} failed: go {' '.join(args[:2])} ... exited with {code}")


def go_output(args: Sequence[str]) -> str:
    result = subprocess.run(
        [go_command(), *args], cwd=HERE, env=go_env(), capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise ClusterError(f"go {' '.join(args)} failed:\n{result.stderr.strip()}")
    return result.stdout


def kustomize_resources(folder: Path) -> list[Path]:
    """The files a plain kustomization.yaml lists under `resources:` (no YAML library needed)."""
    resources: list[Path] = []
    listing = False
    for line in (folder / "kustomization.yaml").read_text().splitlines():
        if not line.strip():
            continue
        if not line.startswith((" ", "-")):
            listing = line.strip() == "resources:"
            continue
        if listing and line.lstrip().startswith("- "):
            resources.append(folder / line.lstrip()[2:].strip())
    if not resources:
        raise ClusterError(f"no resources listed in {folder / 'kustomization.yaml'}")
    return resources


def write_kwok_stages(target: Path) -> None:
    kwok_dir = Path(go_output(["list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/kwok"]).strip())
    documents = []
    for stage_dir in KWOK_STAGE_DIRS:
        for resource in kustomize_resources(kwok_dir / stage_dir):
            documents.append(f"# {stage_dir}/{resource.name}\n{resource.read_text().strip()}\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("---\n".join(documents))


def build(*, force: bool = False) -> Build:
    """Build every binary into the cache unless a complete build for these pins is there."""
    versions = pins()
    target = current_build()
    ensure_host_packages()
    with file_lock(cache_root() / ".build.lock"):
        if target.complete() and not force:
            log(f"binaries up to date: {target.bin_dir}")
            return target
        log(f"building the control plane into {target.root}")
        log("  pins: " + ", ".join(f"{module}@{version}" for module, version in versions.items()))
        # Holding the lock, any temporary folder is a dead build's leftover.
        for leftover in cache_root().glob("*.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        work = target.root.with_name(f"{target.root.name}.tmp-{os.getpid()}")
        started = time.monotonic()
        timings: dict[str, float] = {}
        try:
            for index, (name, package) in enumerate(BINARIES.items(), start=1):
                log(f"[{index}/{len(BINARIES)}] go build {package}")
                began = time.monotonic()
                run_go(
                    [
                        "build",
                        "-trimpath",
                        f"-ldflags={ldflags(name, versions)}",
                        "-o",
                        str(work / "bin" / name),
                        package,
                    ],
                    what=f"building {name}",
                    cwd=MODULE_DIRS.get(name, HERE),
                )
                timings[name] = round(time.monotonic() - began, 1)
                log(f"[{index}/{len(BINARIES)}] {name} built in {timings[name]:.0f}s")
            write_kwok_stages(work / "share" / "kwok-stages.yaml")
            manifest = {
                "pins": versions,
                "recipe": RECIPE,
                "go": go_output(["env", "GOVERSION"]).strip(),
                "build_seconds": round(time.monotonic() - started, 1),
                "binary_seconds": timings,
            }
            (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            shutil.rmtree(target.root, ignore_errors=True)
            work.rename(target.root)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        log(f"built in {time.monotonic() - started:.0f}s: {target.bin_dir}")
        return target


def ensure_host_packages() -> None:
    """Install the Debian packages the cluster needs (as root, with apt-get) if missing."""
    try:
        hostpackages.ensure_commands(DEBIAN_PACKAGES, log)
    except hostpackages.PackageError as error:
        raise ClusterError(str(error)) from None


def ensure_built() -> Build:
    ensure_host_packages()
    target = current_build()
    return target if target.complete() else build()


def replace_block(go_mod_text: str, staging: Sequence[str], version: str, source: str) -> str:
    """go.mod with its k8s.io `replace` directives swapped for one block mapping `staging`."""
    kept: list[str] = []
    in_block = False
    for line in go_mod_text.splitlines():
        if line.startswith(("// Staging modules of k8s.io/kubernetes", "// `localcluster.py pin`")):
            continue
        if line.startswith("replace ("):
            in_block = True
            continue
        if in_block:
            if line.startswith(")"):
                in_block = False
            elif not line.strip().startswith("k8s.io/"):
                raise ClusterError(f"go.mod has a replace directive pin does not own: {line}")
            continue
        if line.startswith("replace k8s.io/"):
            continue
        kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    block = [
        "",
        f"// Staging modules of {source}, mapped to their published versions by",
        "// `localcluster.py pin` (k8s.io/kubernetes requires them at v0.0.0).",
        "replace (",
        *(f"\t{name} => {name} {version}" for name in staging),
        ")",
    ]
    return "\n".join(kept + block) + "\n"


def pin_kubernetes(version: str) -> None:
    """Require k8s.io/kubernetes@version and map each staging module to its published v0.x.y.

    k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/client-go, ...) at v0.0.0
    and points them at ./staging with `replace`, which only applies inside its own repository.
    """
    match = re.fullmatch(r"v1\.(\d+)\.(\d+)", version)
    if not match:
        raise ClusterError(f"expected a release like v1.37.2, got {version!r}")
    staging_version = f"v0.{match.group(1)}.{match.group(2)}"
    info = json.loads(go_output(["mod", "download", "-json", f"k8s.io/kubernetes@{version}"]))
    upstream = Path(info["GoMod"]).read_text()
    staging = sorted(set(re.findall(r"^\s+(k8s\.io/[\w.-]+) v0\.0\.0$", upstream, re.MULTILINE)))
    if not staging:
        raise ClusterError(f"k8s.io/kubernetes@{version} lists no v0.0.0 staging modules")
    GO_MOD.write_text(
        replace_block(GO_MOD.read_text(), staging, staging_version, f"k8s.io/kubernetes@{version}")
    )
    go_output(["mod", "edit", f"-require=k8s.io/kubernetes@{version}"])
    go_output(["mod", "tidy"])
    # The replace block decides the versions; make the require lines say the same thing.
    required = module_versions(GO_MOD.read_text())
    align = [f"-require={name}@{staging_version}" for name in staging if name in required]
    go_output(["mod", "edit", *align])
    go_output(["mod", "tidy"])
    log(f"pinned k8s.io/kubernetes@{version} with {len(staging)} staging modules")


# --------------------------------------------------------------------------------------------
# Certificates and kubeconfigs


def openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"openssl {args[0]} failed:\n{result.stderr.strip()}")


EXTENSIONS = """\
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, IP:{host_ip}, IP:{service_ip}, DNS:localhost, DNS:kubernetes, \
DNS:kubernetes.default, DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local
authorityKeyIdentifier = keyid
[kubelet]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:{host_ip}, DNS:{kubelet_node}
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
"""

# Client identities: file stem -> subject. The API server's bootstrap RBAC already binds the
# controller-manager and scheduler users; `admin` and `kwok` are cluster admins.
CLIENTS = {
    "admin": "/O=system:masters/CN=iop-admin",
    "controller-manager": "/CN=system:kube-controller-manager",
    "scheduler": "/CN=system:kube-scheduler",
    "kwok": "/O=system:masters/CN=kwok",
    # The kubelet is a cluster admin (not limited by the Node authorizer; see kubelet/).
    "kubelet": f"/O=system:masters/CN=system:node:{KUBELET_NODE}",
    # The API server's client certificate towards kubelets (kubectl logs).
    "apiserver-kubelet-client": "/O=system:masters/CN=kube-apiserver-kubelet-client",
    # Bootstrap RBAC binds system:node-proxier to this user.
    "kube-proxy": "/CN=system:kube-proxy",
    "coredns": "/O=system:masters/CN=coredns",
}


def make_pki(pki: Path, net: Network) -> None:
    """A throwaway CA, serving certificates (API server, kubelet), client certificates, the SA
    key pair."""
    pki.mkdir(mode=0o700, parents=True, exist_ok=True)
    (pki / "extensions.cnf").write_text(
        EXTENSIONS.format(
            host_ip=net.host_ip,
            service_ip=net.kubernetes_service_ip,
            kubelet_node=KUBELET_NODE,
        )
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    days = ["-days", "3650"]
    openssl(
        "req", "-x509", *ec, *days, "-subj", "/CN=iop-cluster-ca", "-keyout", "ca.key",
        "-out", "ca.crt", "-config", "extensions.cnf", "-extensions", "ca", cwd=pki,
    )  # fmt: skip

    def leaf(stem: str, subject: str, extensions: str) -> None:
        openssl("req", "-new", *ec, "-subj", subject, "-keyout", f"{stem}.key",
                "-out", f"{stem}.csr", cwd=pki)  # fmt: skip
        openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", *days, "-extfile", "extensions.cnf", "-extensions",
                extensions, "-out", f"{stem}.crt", cwd=pki)  # fmt: skip

    leaf("serving", "/CN=iop-cluster-apiserver", "server")
    leaf("kubelet-serving", f"/CN={KUBELET_NODE}", "kubelet")
    for stem, subject in CLIENTS.items():
        leaf(stem, subject, "client")
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-out", "sa.key", cwd=pki)  # fmt: skip
    openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def kubeconfig(server: str, pki: Path, user: str) -> str:
    def data(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    # JSON is YAML: no YAML library needed.
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": PROGRAM,
                "cluster": {"server": server, "certificate-authority-data": data("ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": data(f"{user}.crt"),
                    "client-key-data": data(f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": PROGRAM, "context": {"cluster": PROGRAM, "user": user}}],
        "current-context": PROGRAM,
    }
    return json.dumps(config, indent=2) + "\n"


# --------------------------------------------------------------------------------------------
# Processes


def free_ports(count: int, address: str = LOOPBACK) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((address, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def process_start_time(pid: int) -> int | None:
    """Clock ticks since boot at which `pid` started (field 22 of /proc/PID/stat), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


@dataclass(frozen=True)
class Started:
    """What `up` recorded about one process: enough to recognise exactly that process later."""

    pid: int
    start_time: int
    exe: str

    def alive(self) -> bool:
        """True only for the very process we started: same PID, start time and executable."""
        if process_start_time(self.pid) != self.start_time:
            return False
        try:
            exe = os.readlink(f"/proc/{self.pid}/exe")
        except OSError:
            return False
        # A rebuilt binary leaves the running process's link as "PATH (deleted)".
        return exe == self.exe or exe == f"{self.exe} (deleted)"

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "exe": self.exe}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Started:
        return cls(pid=int(data["pid"]), start_time=int(data["start_time"]), exe=str(data["exe"]))


@dataclass
class State:
    """The state directory's cluster.json: ports, binaries and the processes `up` started."""

    root: Path
    bin_dir: Path
    ports: dict[str, int]
    processes: dict[str, Started]
    network: Network | None = None

    @property
    def file(self) -> Path:
        return self.root / "cluster.json"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    def log_file(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    @property
    def audit_log(self) -> Path:
        """The API server's audit log: every call of a pod's ServiceAccount (`AUDIT_POLICY`)."""
        return self.root / "logs" / "audit.log"

    def save(self) -> None:
        data = {
            "bin_dir": str(self.bin_dir),
            "ports": self.ports,
            "processes": {name: started.to_json() for name, started in self.processes.items()},
            "network": self.network.to_json() if self.network else None,
        }
        temporary = self.file.with_suffix(".tmp")
        temporary.write_text(json.dumps(data, indent=2) + "\n")
        temporary.replace(self.file)

    @classmethod
    def load(cls, root: Path) -> State | None:
        try:
            data = json.loads((root / "cluster.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(
            root=root,
            bin_dir=Path(data["bin_dir"]),
            ports={key: int(value) for key, value in data["ports"].items()},
            processes={name: Started.from_json(entry) for name, entry in data["processes"].items()},
            network=Network.from_json(data["network"]) if data.get("network") else None,
        )

    @property
    def net(self) -> Network:
        assert self.network is not None, "the network is made before anything starts"
        return self.network

    @property
    def apiserver(self) -> str:
        # A cluster.json without a network comes from an older `up` (API server on loopback).
        host = self.network.host_ip if self.network is not None else LOOPBACK
        return f"https://{host}:{self.ports['apiserver']}"


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


# The API server's audit policy: the calls of workloads' ServiceAccounts, as metadata (verb,
# resource, name, the answer's code), once each, when answered; nothing of the control plane's
# own controllers (kube-system) or of people.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    userGroups: ["system:serviceaccounts:kube-system"]
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""


def corefile(state: State) -> str:
    """CoreDNS: cluster names from the API server, on the host's end of the node link."""
    net = state.net
    return f"""\
.:53 {{
    bind {net.host_ip}
    errors
    health {net.host_ip}:{state.ports["coredns-health"]}
    ready {net.host_ip}:{state.ports["coredns-ready"]}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {state.root / "coredns.kubeconfig"} {PROGRAM}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    loadbalance
}}
"""


def kubelet_python() -> Path:
    """The Python the kubelet runs on (it needs aiohttp): the checkout's `.venv`, or
    IOP_KUBELET_VENV. Its pods run from the project's image, not from this virtualenv."""
    venv = Path(os.environ.get("IOP_KUBELET_VENV") or CHECKOUT / ".venv")
    python = venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise ClusterError(f"{venv} has no bin/python: run scripts/bootstrap first")
    return python


def ensure_image() -> imagebuild.Build:
    """The project's image, built from the Dockerfile unless its inputs are unchanged."""
    try:
        built = imagebuild.build()
        imagebuild.prepare(built)
        return built
    except imagebuild.ImageError as error:
        raise ClusterError(f"the project's image could not be built: {error}") from None


def command_lines(state: State, build_: Build) -> dict[str, list[str]]:
    ports, pki, root, net = state.ports, state.pki, state.root, state.net
    apiserver = state.apiserver
    etcd_client = f"http://{LOOPBACK}:{ports['etcd']}"
    etcd_peer = f"http://{LOOPBACK}:{ports['etcd-peer']}"
    serving = [
        f"--tls-cert-file={pki / 'serving.crt'}",
        f"--tls-private-key-file={pki / 'serving.key'}",
    ]

    def write_kubeconfig(user: str) -> Path:
        path = root / f"{user}.kubeconfig"
        path.write_text(kubeconfig(apiserver, pki, user))
        path.chmod(0o600)
        return path

    def component_kubeconfig(user: str) -> list[str]:
        path = write_kubeconfig(user)
        return [
            f"--kubeconfig={path}",
            f"--authentication-kubeconfig={path}",
            f"--authorization-kubeconfig={path}",
        ]

    (root / "Corefile").write_text(corefile(state))
    (root / "audit-policy.yaml").write_text(AUDIT_POLICY)
    write_kubeconfig("coredns")
    kube_proxy_config = write_kubeconfig("kube-proxy")
    kwok_kubeconfig = write_kubeconfig("kwok")

    return {
        "etcd": [
            str(build_.binary("etcd")),
            "--name=iop",
            f"--data-dir={root / 'etcd'}",
            f"--listen-client-urls={etcd_client}",
            f"--advertise-client-urls={etcd_client}",
            f"--listen-peer-urls={etcd_peer}",
            f"--initial-advertise-peer-urls={etcd_peer}",
            f"--initial-cluster=iop={etcd_peer}",
            # A throwaway test store: durability buys nothing, fsync costs seconds.
            "--unsafe-no-fsync",
            "--auto-compaction-retention=1",
            "--log-level=warn",
        ],
        "kube-apiserver": [
            str(build_.binary("kube-apiserver")),
            f"--etcd-servers={etcd_client}",
            # The host's end of the node link: reachable from the host and from every pod.
            f"--bind-address={net.host_ip}",
            f"--advertise-address={net.host_ip}",
            f"--secure-port={ports['apiserver']}",
            *serving,
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={net.service_cidr}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            # Webhooks and APIServices backed by a Service are called at its endpoints (pod
            # IPs), not its ClusterIP: they work even where kube-proxy does not.
            "--enable-aggregator-routing=true",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            "--profiling=false",
            f"--cert-dir={root / 'apiserver-certs'}",
            # What workloads' ServiceAccounts call (the tests compare a Role with it).
            f"--audit-policy-file={root / 'audit-policy.yaml'}",
            f"--audit-log-path={state.audit_log}",
            "--audit-log-format=json",
            "--audit-log-maxsize=200",
        ],
        "kube-controller-manager": [
            str(build_.binary("kube-controller-manager")),
            *component_kubeconfig("controller-manager"),
            f"--bind-address={LOOPBACK}",
            f"--secure-port={ports['controller-manager']}",
            *serving,
            f"--cert-dir={root / 'controller-manager-certs'}",
            "--leader-elect=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={net.service_cidr}",
            "--profiling=false",
        ],
        "kube-scheduler": [
            str(build_.binary("kube-scheduler")),
            *component_kubeconfig("scheduler"),
            f"--bind-address={LOOPBACK}",
            f"--secure-port={ports['scheduler']}",
            *serving,
            f"--cert-dir={root / 'scheduler-certs'}",
            "--leader-elect=false",
            "--profiling=false",
        ],
        # No --server-address/--node-port: kwok then opens no listener at all.
        "kwok": [
            str(build_.binary("kwok")),
            f"--kubeconfig={kwok_kubeconfig}",
            f"--config={build_.kwok_stages}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--node-ip={LOOPBACK}",
            f"--cidr={KWOK_POD_CIDR}",
            "--node-lease-duration-seconds=40",
        ],
        "coredns": [str(build_.binary("coredns")), "-conf", str(root / "Corefile")],
        # In the node namespace: its nftables table and conntrack entries stay there, and
        # every packet to a ClusterIP passes through it (from pods via the bridge, from the
        # host via the routes clusternet.py adds).
        "kube-proxy": [
            "nsenter",
            f"--net={clusternet.NETNS_DIR / net.node_netns}",
            "--",
            str(build_.binary("kube-proxy")),
            f"--kubeconfig={kube_proxy_config}",
            "--proxy-mode=nftables",
            f"--hostname-override={KUBELET_NODE}",
            f"--cluster-cidr={net.pod_cidr}",
            # Replies from a pod on the same bridge must come back through the translation.
            "--masquerade-all=true",
            # conntrack's table size is machine-wide: leave it alone.
            "--conntrack-max-per-core=0",
            f"--healthz-bind-address={net.node_ip}:{ports['kube-proxy-health']}",
            f"--metrics-bind-address={net.node_ip}:{ports['kube-proxy-metrics']}",
            "--nodeport-addresses=primary",
        ],
        "kubelet": [
            str(kubelet_python()),
            "-m",
            "kubelet",
            f"--node-name={KUBELET_NODE}",
            f"--node-ip={net.host_ip}",
            f"--pod-cidr={net.pod_cidr}",
            f"--node-netns={net.node_netns}",
            f"--netns-prefix={net.netns_prefix}",
            f"--cluster-dns={net.host_ip}",
            f"--cluster-domain={CLUSTER_DOMAIN}",
            f"--server={apiserver}",
            # What pods get as KUBERNETES_SERVICE_HOST/PORT: the `kubernetes` Service's
            # ClusterIP, which kube-proxy translates to the API server.
            f"--api-host={net.kubernetes_service_ip}",
            "--api-port=443",
            f"--ca={pki / 'ca.crt'}",
            f"--cert={pki / 'kubelet.crt'}",
            f"--key={pki / 'kubelet.key'}",
            f"--serving-cert={pki / 'kubelet-serving.crt'}",
            f"--serving-key={pki / 'kubelet-serving.key'}",
            f"--serving-port={ports['kubelet']}",
            f"--state={root / 'kubelet'}",
            f"--images={imagebuild.images_file(root)}",
            f"--image-cache={imagebuild.rootfs_dir()}",
        ],
    }


def child_env(state: State) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("KUBE")}
    # Nothing here goes through a proxy: every address is on this machine.
    net = state.net
    local = [LOOPBACK, "localhost", net.host_ip, str(net.pod_cidr), str(net.service_cidr)]
    no_proxy = ",".join(filter(None, [*local, os.environ.get("NO_PROXY", "")]))
    env["NO_PROXY"] = env["no_proxy"] = no_proxy
    env["KWOK_WORKDIR"] = str(state.root / "kwok")
    env["PYTHONPATH"] = str(HERE)
    return env


def spawn(name: str, argv: list[str], state: State, env: Mapping[str, str]) -> Started:
    log_file = state.log_file(name)
    with log_file.open("ab") as output:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=state.root,
            env=dict(env),
            # Its own session: a Ctrl-C in the shell or test run that started it must not reach
            # it; only `down` stops it.
            start_new_session=True,
        )
    # Popen returns once exec succeeded, so /proc now shows the component, not this Python
    # (or, for a component started through `nsenter ... --`, nsenter until it execs in turn).
    start_time = process_start_time(process.pid)
    expected = argv[argv.index("--") + 1] if argv[0] == "nsenter" else None
    deadline = time.monotonic() + 5
    while True:
        try:
            exe = os.readlink(f"/proc/{process.pid}/exe")
        except OSError:
            start_time = None
            break
        if expected is None or exe == expected or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    # Forget the Popen object without a ResourceWarning: the process outlives this launcher.
    process.returncode = 0
    if start_time is None:
        raise ClusterError(f"{name} exited at once:\n{tail(log_file)}")
    return Started(pid=process.pid, start_time=start_time, exe=exe)


# --------------------------------------------------------------------------------------------
# Talking to the components


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


# --------------------------------------------------------------------------------------------
# up / down / status


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


# --------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build the pinned binaries if needed")
    build_parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    up_parser = commands.add_parser("up", help="start the cluster; prints export lines")
    up_parser.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("IOP_CLUSTER_TIMEOUT", "90")),
        help="seconds to wait for every component to be healthy (default 90)",
    )
    commands.add_parser(
        "image", help="build the project's image if its inputs changed; load it if running"
    )
    commands.add_parser("down", help="stop what `up` started and remove its state")
    status_parser = commands.add_parser("status", help="say what runs")
    status_parser.add_argument("--json", action="store_true", help="machine-readable output")
    pin_parser = commands.add_parser("pin", help="re-pin k8s.io/kubernetes (rewrites go.mod)")
    pin_parser.add_argument("kubernetes_version", help="for example v1.37.2")
    args = parser.parse_args(argv)

    try:
        if args.command == "build":
            build(force=args.force)
        elif args.command == "up":
            state = up(args.timeout)
            sys.stdout.write(exports(state))
        elif args.command == "image":
            image = ensure_image()
            if State.load(state_dir()) is not None:
                imagebuild.load(state_dir(), image)
                log(f"loaded {image.reference}@{image.digest[:19]} into {state_dir()}")
        elif args.command == "down":
            stopped = down()
            log(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")
        elif args.command == "status":
            code, report = status_report()
            if args.json:
                print(json.dumps(report, indent=2))
            else:
                print(f"cluster: {report['status']} (state {report['state_dir']})")
                for name, entry in report["components"].items():
                    health = "healthy" if entry["healthy"] else "NOT healthy"
                    where = f"pid {entry['pid']}" if entry["running"] else "not running"
                    print(f"  {name:<24} {where:<12} {health}")
                net = report.get("network")
                if net:
                    pods = len(net["namespaces"]) - 1
                    print(f"  network: pods {net['pod_cidr']}, services {net['service_cidr']}, "
                          f"DNS {net['cluster_dns']}, host link {net['host_link']}, "
                          f"node netns {net['node_netns']} (+{pods} pod namespaces)")  # fmt: skip
                if report["status"] != "stopped":
                    print(f"export KUBECONFIG={report['kubeconfig']}")
                built = "built" if report["built"] else "not built yet"
                print(f"binaries: {report['bin_dir']} ({built})")
            return code
        elif args.command == "pin":
            pin_kubernetes(args.kubernetes_version)
    except ClusterError as error:
        log(f"error: {error}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except BrokenPipeError:  # `status | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
