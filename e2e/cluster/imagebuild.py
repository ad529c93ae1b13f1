"""Build the project's image from the Dockerfile, unchanged, and load it into a local cluster.

The image the chart names (`ghcr.io/iop-edge/iop-edge:<version>`) is what the local cluster's
process kubelet runs, so the tests prove the image itself. There is no container engine here:
`buildah bud --isolation chroot --layers` builds it, on a storage of its own under the cache
folder, from the official base when a registry answers, else from a stand-in made with
`mmdebstrap`. A build is cached by the hash of its inputs, exported to one OCI image layout
shared by all checkouts, and `load` writes the cluster's image list (`<state>/images.json`).
Standard library only (plus `buildah` and `mmdebstrap`, installed from Debian's packages when
missing). `scripts/build-image` is its command line; e2e/cluster/README.md, "The image", says
how and why.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from . import hostpackages
from .kubelet.images import ImageError as UnpackError
from .kubelet.images import NodeImages, file_lock, normalize, unpack

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent.parent
DOCKERFILE = CHECKOUT / "Dockerfile"
IGNORE_FILE = CHECKOUT / ".dockerignore"
REPOSITORY = "ghcr.io/iop-edge/iop-edge"
PROGRAM = "iop-image"
# Bump when the way images are built changes: it is part of every cache key.
RECIPE = "1"
DEBIAN_PACKAGES = {"buildah": "buildah", "mmdebstrap": "mmdebstrap"}
# buildah's storage under the cache folder (overlay driver; a storage keeps the driver it was
# made with, so a change of driver needs a folder of its own).
STORAGE = "storage-overlay"
# Where both bases keep the CA bundle that pip (Debian's) and uv (native-tls) read.
CA_IN_IMAGE = "/etc/ssl/certs/ca-certificates.crt"
# The build stage's layer of locked dependencies: tagged after a build so that pruning keeps
# it, and the next build whose uv.lock is unchanged starts from it.
DEPENDENCY_STEP = "--no-install-project"
DEPENDENCY_CACHE_TAG = "localhost/iop-edge-cache:dependencies"
# Builds kept in the shared layout: the newest few, and any used within this many hours.
KEEP_BUILDS = 3
KEEP_HOURS = 12.0
# Images (with their intermediate steps) the storage may hold before dangling ones are pruned.
PRUNE_OVER = 45


class ImageError(Exception):
    """A failure the user must see: the message says what failed and why."""


def log(message: str) -> None:
    print(f"{PROGRAM}: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    configured = os.environ.get("IOP_IMAGE_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "iop-edge" / "image"


def project_reference() -> str:
    """The reference the chart names by default: the repository at the package version."""
    with (CHECKOUT / "pyproject.toml").open("rb") as handle:
        version = tomllib.load(handle)["project"]["version"]
    return f"{REPOSITORY}:{version}"


def machine_ca() -> Path | None:
    bundle = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
    return bundle if bundle.is_file() else None


# --------------------------------------------------------------------------------------------
# What the build reads


def dockerfile_base(text: str) -> str:
    """The image every FROM of the Dockerfile starts from (stage names aside), normalized."""
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.MULTILINE))
    stages: set[str] = set()
    bases: set[str] = set()
    for match in re.finditer(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.MULTILINE | re.I):
        image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], match[1])
        if image not in stages:
            bases.add(normalize(image))
        if match[2]:
            stages.add(match[2])
    if len(bases) != 1:
        raise ImageError(f"expected one base image in {DOCKERFILE}, found {sorted(bases)}")
    return bases.pop()


def _ignore_patterns(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore lines as (excludes, regex), in order: the last match decides."""
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        path = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        index = 0
        while index < len(path):
            if path.startswith("**", index):
                regex += ".*"
                index += 2
            elif path[index] == "*":
                regex += "[^/]*"
                index += 1
            elif path[index] == "?":
                regex += "[^/]"
                index += 1
            else:
                regex += re.escape(path[index])
                index += 1
        patterns.append((not include, re.compile(regex + r"(/.*)?")))
    return patterns


def context_files(root: Path = CHECKOUT) -> list[str]:
    """The files of the build context, as the .dockerignore of `root` lets them in."""
    patterns = _ignore_patterns(IGNORE_FILE.read_text() if IGNORE_FILE.is_file() else "")

    def excluded(relative: str) -> bool:
        verdict = False
        for excludes, regex in patterns:
            if regex.fullmatch(relative):
                verdict = excludes
        return verdict

    may_reinclude = [regex for excludes, regex in patterns if not excludes]
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        relative_folder = os.path.relpath(folder, root)
        prefix = "" if relative_folder == "." else relative_folder + "/"
        kept = []
        for name in sorted(dirs):
            relative = prefix + name
            # An excluded folder is walked only if a `!` pattern could let something under it in.
            if not excluded(relative) or any(
                regex.pattern.startswith(re.escape(relative)) for regex in may_reinclude
            ):
                kept.append(name)
        dirs[:] = kept
        found += [prefix + name for name in sorted(files) if not excluded(prefix + name)]
    return sorted(found)


def inputs_hash(base_id: str) -> str:
    """The cache key of a build: recipe, base, Dockerfile, .dockerignore and the context."""
    digest = hashlib.sha256()
    for part in (RECIPE, base_id, DOCKERFILE.read_text()):
        digest.update(part.encode() + b"\0")
    for relative in ["Dockerfile", ".dockerignore", *context_files()]:
        path = CHECKOUT / relative
        if not path.is_file():
            continue
        mode = "x" if os.access(path, os.X_OK) else "-"
        digest.update(f"{relative}\0{mode}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# buildah


class Buildah:
    """`buildah` on the cache's own storage, with the overlay driver: a step's layer is what it
    changed (kernel overlayfs; fuse-overlayfs where the kernel refuses an overlay mount there).
    vfs, which copies the whole root file system at every step and diffs it at every commit,
    made a change under src/ cost minutes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        storage = root / STORAGE
        self.prefix = [
            "buildah",
            f"--root={storage}",
            f"--runroot={root / 'runroot'}",
            "--storage-driver=overlay",
            *overlay_options(storage),
        ]

    def output(self, *args: str) -> str:
        result = subprocess.run([*self.prefix, *args], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ImageError(f"buildah {args[0]} failed:\n{result.stderr.strip()[-2000:]}")
        return result.stdout

    def succeeds(self, *args: str) -> bool:
        result = subprocess.run([*self.prefix, *args], capture_output=True, check=False)
        return result.returncode == 0

    def stream(self, args: Sequence[str], log_file: Path, show: re.Pattern[str]) -> None:
        """Run a long buildah command: its lines go to `log_file`; those matching `show` are
        shown with the time so far; a failure shows the last lines."""
        began = time.monotonic()
        last: deque[str] = deque(maxlen=40)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with (
            log_file.open("w") as output,
            subprocess.Popen(
                [*self.prefix, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            ) as process,
        ):
            assert process.stdout is not None
            try:
                for line in process.stdout:
                    output.write(line)
                    last.append(line.rstrip())
                    if show.search(line):
                        log(f"  [{time.monotonic() - began:5.0f}s] {line.strip()[:140]}")
                code = process.wait()
            except BaseException:
                process.kill()
                process.wait()
                raise
        if code != 0:
            tail = "\n".join(last)
            raise ImageError(f"buildah {args[0]} exited with {code} (log {log_file}):\n{tail}")

    def image_id(self, reference: str) -> str | None:
        if not self.succeeds("inspect", "--type=image", reference):
            return None
        return str(self.inspect(reference)["FromImageID"])

    def inspect(self, reference: str) -> dict[str, object]:
        parsed: dict[str, object] = json.loads(self.output("inspect", "--type=image", reference))
        return parsed

    def labels(self, reference: str) -> dict[str, str]:
        oci = self.inspect(reference).get("OCIv1") or {}
        config = oci.get("config") or {} if isinstance(oci, dict) else {}
        return dict(config.get("Labels") or {})


def overlay_options(storage: Path) -> list[str]:
    """buildah's options for the overlay driver on `storage`: none where the kernel mounts an
    overlay there (a probe in the storage's folder: an overlayfs as the lower or upper of
    another, or a kernel without overlay, refuses), else fuse-overlayfs's mount program."""
    storage.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".overlay-probe-", dir=storage) as probe:
        parts = {name: Path(probe, name) for name in ("lower", "upper", "work", "merged")}
        for part in parts.values():
            part.mkdir()
        options = f"lowerdir={parts['lower']},upperdir={parts['upper']},workdir={parts['work']}"
        mounted = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(parts["merged"])],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if mounted.returncode == 0:
            subprocess.run(["umount", str(parts["merged"])], check=True)
            return []
    log(f"the kernel refuses an overlay mount in {storage}: using fuse-overlayfs")
    try:
        hostpackages.ensure_commands({"fuse-overlayfs": "fuse-overlayfs"}, log)
    except hostpackages.PackageError as error:
        raise ImageError(str(error)) from None
    return [f"--storage-opt=overlay.mount_program={shutil.which('fuse-overlayfs')}"]


# --------------------------------------------------------------------------------------------
# The base


STANDIN_LABEL = "dev.iop-edge.standin"


def standin_recipe(base: str) -> tuple[list[str], str]:
    """mmdebstrap's arguments for a stand-in of `base` (without the output), and its key."""
    match = re.fullmatch(r"docker\.io/library/python:(\d+\.\d+)-slim-(\w+)", base)
    if not match:
        raise ImageError(f"no stand-in is known for {base}: it must be python:X.Y-slim-SUITE")
    version, suite = match.groups()
    python = f"python{version}"
    uv_config = "native-tls = true\\n"
    args = [
        "--variant=minbase",
        f"--include={python},python3-venv,python3-pip,ca-certificates",
        "--aptopt=Apt::Install-Recommends false",
        # What Debian's own slim images leave out.
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/info/*",
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        f'--customize-hook=ln -s /usr/bin/{python} "$1/usr/local/bin/python"',
        f'--customize-hook=ln -s /usr/bin/{python} "$1/usr/local/bin/python3"',
        f'--customize-hook=rm -f "$1/usr/lib/{python}/EXTERNALLY-MANAGED"',
        f'--customize-hook=mkdir -p "$1/etc/uv" && printf "{uv_config}" > "$1/etc/uv/uv.toml"',
        suite,
    ]
    key = hashlib.sha256(json.dumps([RECIPE, args]).encode()).hexdigest()[:16]
    return args, key


STANDIN_CONTAINERFILE = """\
FROM scratch
ADD base.tar /
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
LABEL {label}={key}
CMD ["python3"]
"""


def ensure_base(buildah: Buildah, base: str) -> str:
    """The base's image ID in the storage: present, pulled, or a stand-in made and tagged."""
    present = buildah.image_id(base)
    if present is not None:
        standin = buildah.labels(base).get(STANDIN_LABEL)
        if standin is None or standin == standin_recipe(base)[1]:
            return present
        log(f"the stand-in for {base} is of an older recipe: making it again")
    elif buildah.succeeds("pull", "--quiet", base):
        log(f"pulled {base}")
        pulled = buildah.image_id(base)
        assert pulled is not None
        return pulled
    else:
        log(f"{base} cannot be pulled here: making a stand-in from Debian's packages")
    args, key = standin_recipe(base)
    root = cache_root()
    # The stand-in's build context: the file system as a tarball, and a Containerfile.
    context = root / "base" / key
    tarball = context / "base.tar"
    began = time.monotonic()
    if not tarball.is_file():
        context.mkdir(parents=True, exist_ok=True)
        for leftover in context.glob("partial-*"):  # a build that died (we hold the lock)
            leftover.unlink()
        partial = context / f"partial-{os.getpid()}.tar"
        log(f"mmdebstrap {' '.join(a for a in args if not a.startswith('--'))}: {tarball}")
        result = subprocess.run(
            ["mmdebstrap", "--quiet", "--format=tar", *args, str(partial)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise ImageError(f"mmdebstrap failed:\n{result.stderr.strip()[-2000:]}")
        partial.rename(tarball)
    import_standin(buildah, base, context, key)
    log(f"stand-in {base} made in {time.monotonic() - began:.0f}s")
    made = buildah.image_id(base)
    assert made is not None
    return made


def import_standin(buildah: Buildah, base: str, context: Path, key: str) -> None:
    """Import `context`/base.tar as the image `base`, labelled with the stand-in's `key`."""
    (context / "Containerfile").write_text(
        STANDIN_CONTAINERFILE.format(label=STANDIN_LABEL, key=key)
    )
    # --layers: buildah before 1.29 (bookworm's 1.28.2) refuses --force-rm without it (or
    # --no-cache); with it, a failed step's working container goes too, as in the main build.
    standin = ["bud", "--isolation=chroot", "--layers", "--force-rm", "--pull=never", "-t", base]
    buildah.stream(
        [*standin, str(context)],
        buildah.root / "logs" / f"standin-{key}.log",
        re.compile(r"^STEP|^COMMIT"),
    )


# --------------------------------------------------------------------------------------------
# The build


@dataclass(frozen=True)
class Build:
    """One image in the shared layout: what the cluster loads."""

    key: str
    reference: str
    digest: str  # the manifest's
    base: str
    base_digest: str
    layout: str
    seconds: float

    @staticmethod
    def record(key: str) -> Path:
        return cache_root() / "builds" / f"{key}.json"

    def save(self) -> None:
        path = self.record(self.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, key: str) -> Build | None:
        try:
            build = cls(**json.loads(cls.record(key).read_text()))
        except (OSError, ValueError, TypeError):
            return None
        layout = Path(build.layout)
        for digest in (build.digest, build.base_digest):
            if not (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).is_file():
                return None
        return build


def layout_dir() -> Path:
    return cache_root() / "oci"


def exported(name: str) -> str | None:
    """The manifest digest of `name` in the shared layout, if it is there."""
    try:
        index = json.loads((layout_dir() / "index.json").read_text())
    except FileNotFoundError:
        return None
    for entry in index["manifests"]:
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") == name:
            digest: str = entry["digest"]
            if _blob(layout_dir(), digest).is_file():
                return digest
    return None


def export(buildah: Buildah, reference: str, name: str, *, again: bool = True) -> str:
    """Push `reference` into the shared OCI layout as `name`; returns its manifest digest."""
    if not again and (digest := exported(name)) is not None:
        return digest
    buildah.output("push", "--quiet", reference, f"oci:{layout_dir()}:{name}")
    digest = exported(name)
    if digest is None:
        raise ImageError(f"{layout_dir()}/index.json has no {name} after the push")
    return digest


@contextlib.contextmanager
def staged_context(folder: Path) -> Iterator[Path]:
    """The build context: a copy of what .dockerignore lets in, every time stamp set to 0.

    buildah's layer cache keys a COPY on its files' contents *and* time stamps, so a fresh
    clone (CI) or a copy of the same lock file would miss the cached dependency layer; with
    the stamps fixed, only contents count, as with Docker's BuildKit."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        for relative in ["Dockerfile", ".dockerignore", *context_files()]:
            source = CHECKOUT / relative
            if source.is_file():
                (folder / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, folder / relative)
        for path in sorted(folder.rglob("*"), reverse=True):  # files, then their folders
            os.utime(path, (0, 0), follow_symlinks=False)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def build(*, force: bool = False) -> Build:
    """Build the image unless a build of the same inputs is in the cache; export it."""
    try:
        hostpackages.ensure_commands(DEBIAN_PACKAGES, log)
    except hostpackages.PackageError as error:
        raise ImageError(str(error)) from None
    root = cache_root()
    buildah = Buildah(root)
    reference = project_reference()
    base = dockerfile_base(DOCKERFILE.read_text())
    with file_lock(root / ".build.lock"):
        base_id = ensure_base(buildah, base)
        key = inputs_hash(base_id)
        cached = None if force else Build.load(key)
        if cached is not None:
            Build.record(key).touch()
            log(f"image up to date: {reference} ({cached.digest[:19]}, inputs {key})")
            return cached
        log(f"building {reference} from {DOCKERFILE} on {base} (inputs {key})")
        began = time.monotonic()
        # --force-rm: a failed step's working container goes too (it would stay mounted).
        args = [
            "bud", "--isolation=chroot", "--layers", "--force-rm", "--pull=never",
            "-f", str(DOCKERFILE), "-t", reference,
        ]  # fmt: skip
        ca = machine_ca()
        if ca is not None:
            args += ["-v", f"{ca}:{CA_IN_IMAGE}:ro"]
        with staged_context(root / "context") as context:
            buildah.stream(
                [*args, str(context)],
                root / "logs" / f"build-{key}.log",
                re.compile(r"^\[\d+/\d+\] STEP|^STEP|^COMMIT|Using cache"),
            )
        log(f"  [{time.monotonic() - began:5.0f}s] built; exporting to {layout_dir()}")
        built = Build(
            key=key,
            reference=reference,
            digest=export(buildah, reference, key),
            base=base,
            base_digest=export(buildah, base, f"base-{base_id[:16]}", again=False),
            layout=str(layout_dir()),
            seconds=round(time.monotonic() - began, 1),
        )
        built.save()
        log(f"built {reference} in {built.seconds:.0f}s: {built.digest[:19]}")
        keep_dependency_layer(buildah)
        collect_garbage(buildah, keep=key)
        return built


def keep_dependency_layer(buildah: Buildah) -> None:
    """Tag the newest layer of locked dependencies, so pruning keeps it for the next build."""
    listing = json.loads(buildah.output("images", "--all", "--json") or "[]")
    for image in sorted(listing, key=lambda i: i.get("created", 0), reverse=True):
        if image.get("names"):
            continue
        history = buildah.inspect(image["id"]).get("History") or []
        if isinstance(history, list) and history and DEPENDENCY_STEP in str(history[-1]):
            buildah.output("tag", image["id"], DEPENDENCY_CACHE_TAG)
            return


def collect_garbage(buildah: Buildah, keep: str) -> None:
    """Drop what no recent build uses: dangling images once the storage holds more than
    PRUNE_OVER (pruning at every build would throw away the cached steps of the final stage),
    and builds past the newest KEEP_BUILDS unused for KEEP_HOURS with their blobs and unpacked
    layers."""
    if len(json.loads(buildah.output("images", "--all", "--json") or "[]")) > PRUNE_OVER:
        buildah.succeeds("rmi", "--prune")
    records = sorted(
        (cache_root() / "builds").glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    stale = [
        record
        for position, record in enumerate(records)
        if record.stem != keep
        and position >= KEEP_BUILDS
        and time.time() - record.stat().st_mtime > KEEP_HOURS * 3600
    ]
    layout = layout_dir()
    index_file = layout / "index.json"
    index = json.loads(index_file.read_text())
    dropped = {record.stem for record in stale}
    index["manifests"] = [
        entry
        for entry in index["manifests"]
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") not in dropped
    ]
    used: set[str] = set()
    for entry in index["manifests"]:
        used.add(entry["digest"])
        manifest = json.loads(_blob(layout, entry["digest"]).read_text())
        used.add(manifest["config"]["digest"])
        used.update(layer["digest"] for layer in manifest["layers"])
    partial = index_file.with_suffix(".tmp")
    partial.write_text(json.dumps(index))
    partial.replace(index_file)
    for blob in (layout / "blobs" / "sha256").iterdir():
        if f"sha256:{blob.name}" not in used:
            blob.unlink()
    rootfs = rootfs_dir()
    if rootfs.is_dir():
        for unpacked in rootfs.iterdir():
            if f"sha256:{unpacked.name}" not in used and not unpacked.name.startswith("."):
                shutil.rmtree(unpacked, ignore_errors=True)
    for record in stale:
        record.unlink()
    if stale:
        log(f"removed {len(stale)} old build(s) from {cache_root()}")


def _blob(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


# --------------------------------------------------------------------------------------------
# Loading into a cluster, and what an image is made of


def images_file(state: Path) -> Path:
    return state / "images.json"


def load(state: Path, built: Build) -> Path:
    """Give the cluster whose state directory is `state` the project's image and its base:
    the node image list the kubelet reads (reference -> manifest digest in the layout)."""
    listing = {
        "layout": built.layout,
        "images": {built.reference: built.digest, built.base: built.base_digest},
    }
    target = images_file(state)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".tmp")
    partial.write_text(json.dumps(listing, indent=2) + "\n")
    partial.replace(target)
    Build.record(built.key).touch()
    return target


def prepare(built: Build) -> None:
    """Unpack the image's layers and its base's now, outside any test's time, rather than when
    the first pod starts (the kubelet would do the same, once per layer, under the same lock)."""
    listing = {"layout": built.layout, "images": {built.reference: built.digest,
                                                  built.base: built.base_digest}}  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        handle.write(json.dumps(listing))
        handle.flush()
        images = NodeImages(Path(handle.name), rootfs_dir())
        for reference in listing["images"]:
            image = images.find(reference)
            assert image is not None
            began = time.monotonic()
            if not all((rootfs_dir() / layer.name).is_dir() for layer in image.layers):
                try:
                    unpack(image, rootfs_dir())
                except UnpackError as error:
                    raise ImageError(f"unpacking {reference}: {error}") from None
                log(f"unpacked {reference} in {time.monotonic() - began:.0f}s")


def rootfs_dir() -> Path:
    """Where images are unpacked, one folder per layer digest (the kubelet's --image-cache)."""
    return cache_root() / "rootfs"


def layer_report(built: Build) -> str:
    """Each layer's size (compressed as a registry stores it, and unpacked), with the step
    that made it, and the largest folders of the project's own layers (those over the base)."""
    layout = Path(built.layout)
    manifest = json.loads(_blob(layout, built.digest).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    base_manifest = json.loads(_blob(layout, built.base_digest).read_text())
    base_layers = {layer["digest"] for layer in base_manifest["layers"]}
    steps = [h.get("created_by", "") for h in config["history"] if not h.get("empty_layer")]
    steps = [""] * (len(manifest["layers"]) - len(steps)) + steps  # aligned from the top layer
    lines = [f"{built.reference} {built.digest}"]
    total_packed = total_unpacked = 0
    folders: Counter[str] = Counter()
    for layer, step in zip(manifest["layers"], steps, strict=True):
        blob = _blob(layout, layer["digest"])
        ours = layer["digest"] not in base_layers
        unpacked = 0
        with tarfile.open(blob, "r:*") as tar:
            for member in tar:
                unpacked += member.size
                if ours and member.isfile():
                    parts = member.name.split("/")
                    folders["/".join(parts[: min(len(parts) - 1, 6)])] += member.size
        total_packed += layer["size"]
        total_unpacked += unpacked
        what = f"base {built.base}" if not ours else re.sub(r"^/bin/sh -c (#\(nop\) )?", "", step)
        sizes = f"{layer['size'] / 1e6:7.1f} MB packed {unpacked / 1e6:7.1f} MB"
        lines.append(f"  {sizes}  {what[:66]}")
    lines.append(f"  {total_packed / 1e6:7.1f} MB packed {total_unpacked / 1e6:7.1f} MB  in all")
    lines.append("  largest folders of the project's layers (unpacked):")
    lines += [f"    {size / 1e6:7.1f} MB  {name}" for name, size in folders.most_common(15)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="build-image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="build even if up to date")
    parser.add_argument(
        "--load",
        metavar="STATE",
        help="give the cluster of this state directory the image (its node image list)",
    )
    parser.add_argument("--report", action="store_true", help="print what the image is made of")
    args = parser.parse_args(argv)
    try:
        built = build(force=args.force)
        if args.load:
            prepare(built)
            log(f"loaded into {load(Path(args.load), built)}")
        if args.report:
            print(layer_report(built))
        else:
            print(f"{built.reference}@{built.digest}")
    except (ImageError, OSError) as error:
        log(f"error: {error}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
