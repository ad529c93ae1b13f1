"""The Go build and its pins: the binaries of the control plane, built from go.mod's pinned
modules (CoreDNS from coredns/go.mod) into the per-user cache, keyed by the pins and the recipe.

`build` builds what the pins say unless the cache already holds it; `pin_kubernetes` re-pins
k8s.io/kubernetes and rewrites the staging `replace` block in go.mod (`localcluster.py pin`).
Standard library only; `go` from PATH or the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import hostpackages
from .layout import GO_MOD, GO_SUM, HERE, ClusterError, cache_root, file_lock, log

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
