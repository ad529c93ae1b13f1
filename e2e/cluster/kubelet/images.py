"""The images this node has, and their layers, each unpacked once per digest.

The node never pulls (no registry is reachable from these machines): `e2e/cluster/imagebuild.py`
writes the cluster's image list (`<state>/images.json`: an OCI image layout and, per reference, a
manifest digest in it), read again whenever it changed. An image's config comes from the
layout; its layers are unpacked as containerd's overlay snapshotter does, each into a folder
named by its digest, OCI whiteouts turned into overlayfs ones, written aside and renamed under a
file lock, never written to afterwards; a container's root is an overlay of them (podinit.py).
Standard library only (imagebuild.py imports it). e2e/cluster/README.md ("The process kubelet",
"The image") says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What a runtime gives a process whose image sets no PATH.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REF_NAME = "org.opencontainers.image.ref.name"


class ImageError(Exception):
    """The image cannot be read or unpacked: the message names the file and the fault."""


def normalize(reference: str) -> str:
    """A reference in full, as a runtime stores it: `nginx:1.27` is
    `docker.io/library/nginx:1.27`, a missing tag is `latest` (unless a digest is given)."""
    name, _, digest = reference.partition("@")
    first, slash, rest = name.partition("/")
    if not slash or ("." not in first and ":" not in first and first != "localhost"):
        first, rest = "docker.io", name if slash else f"library/{name}"
    last = rest.rsplit("/", 1)[-1]
    if ":" not in last and not digest:
        rest += ":latest"
    return f"{first}/{rest}" + (f"@{digest}" if digest else "")


def repository(reference: str) -> str:
    """A normalized reference without its tag and digest."""
    name = normalize(reference).partition("@")[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.partition(':')[0]}"


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image's config a runtime uses to start a container."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    working_dir: str = ""
    user: str = ""

    @classmethod
    def of(cls, config: dict[str, Any]) -> ImageConfig:
        env = []
        for entry in config.get("Env") or []:
            name, _, value = entry.partition("=")
            env.append((name, value))
        return cls(
            entrypoint=tuple(config.get("Entrypoint") or ()),
            cmd=tuple(config.get("Cmd") or ()),
            env=tuple(env),
            working_dir=config.get("WorkingDir") or "",
            user=config.get("User") or "",
        )


@dataclass(frozen=True)
class Image:
    reference: str  # normalized, as the pod named it
    digest: str  # the manifest's
    config: ImageConfig
    layers: tuple[Path, ...]

    @property
    def image_id(self) -> str:
        """What a kubelet reports as `imageID`: the repository at the manifest digest."""
        return f"{repository(self.reference)}@{self.digest}"


class NodeImages:
    """The node's image list (written by imagebuild.py's `load`) and the unpacked roots."""

    def __init__(self, listing: Path, unpacked: Path) -> None:
        self.listing = listing
        self.unpacked = unpacked
        self._read: tuple[float, dict[str, Any]] = (-1.0, {})
        self._locks: dict[str, asyncio.Lock] = {}

    def _current(self) -> dict[str, Any]:
        try:
            stamp = self.listing.stat().st_mtime
        except FileNotFoundError:
            return {}
        if stamp != self._read[0]:
            self._read = (stamp, json.loads(self.listing.read_text()))
        return self._read[1]

    def names(self) -> list[str]:
        return sorted(self._current().get("images", {}))

    def find(self, reference: str) -> Image | None:
        """The image a pod's reference names, if this node has it (by tag or by digest)."""
        listing = self._current()
        images: dict[str, str] = listing.get("images", {})
        wanted = normalize(reference)
        digest = images.get(wanted)
        if digest is None and "@" in wanted:
            name, _, by_digest = wanted.partition("@")
            if any(repository(ref) == repository(name) and d == by_digest
                   for ref, d in images.items()):  # fmt: skip
                digest = by_digest
        if digest is None:
            return None
        layout = Path(listing["layout"])
        manifest = _read_json(layout, digest)
        config = _read_json(layout, manifest["config"]["digest"])
        layers = tuple(_blob(layout, layer["digest"]) for layer in manifest["layers"])
        return Image(wanted, digest, ImageConfig.of(config.get("config") or {}), layers)

    async def layers(self, image: Image) -> list[Path]:
        """The image's unpacked layers, bottom first; unpacked the first time asked for."""
        lock = self._locks.setdefault(image.digest, asyncio.Lock())
        async with lock:
            return await asyncio.to_thread(unpack, image, self.unpacked)


def image_file(layers: list[Path], relative: str) -> Path | None:
    """A regular file of the image (as the overlay of `layers` shows it), or None."""
    for layer in reversed(layers):
        path = layer / relative
        if path.is_symlink() or path.exists():
            if path.is_char_device() and os.stat(path).st_rdev == 0:  # a whiteout
                return None
            return path if path.is_file() else None
    return None


def _blob(layout: Path, digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    return layout / "blobs" / algorithm / hexdigest


def _read_json(layout: Path, digest: str) -> dict[str, Any]:
    path = _blob(layout, digest)
    try:
        parsed: dict[str, Any] = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:
        raise ImageError(f"{path}: {error}") from None
    return parsed


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (made if missing) for every process of the machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def unpack(image: Image, folder: Path) -> list[Path]:
    """The image's layers unpacked under `folder`, bottom first: each made once, then reused."""
    return [unpack_layer(layer, folder) for layer in image.layers]


def unpack_layer(blob: Path, folder: Path) -> Path:
    """`folder/<digest>`: one layer, its whiteouts in overlayfs' form; made once."""
    target = folder / blob.name
    if target.is_dir():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / f".{target.name}.lock"):
        if target.is_dir():  # another kubelet made it while this one waited
            return target
        partial = folder / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(mode=0o755)
        try:
            apply_layer(blob, partial)
            partial.rename(target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return target


def _clean(name: str) -> str:
    """A member's path relative to the root; anything leaving it is refused."""
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if name.startswith("/") or ".." in parts:
        raise ImageError(f"layer entry {name!r} leaves the root")
    return "/".join(parts)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _no_symlink_above(root: Path, relative: str) -> None:
    """A layer writes real paths: a symlink among an entry's parents would lead it out of the
    root (or into another part of it), so it is refused."""
    current = root
    for part in relative.split("/") if relative else []:
        current = current / part
        if current.is_symlink():
            raise ImageError(f"layer entry under {relative!r} goes through a symlink")


_EXTRACT: dict[str, Any] = (
    {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
)


def apply_layer(archive: Path, root: Path) -> None:
    """Unpack one layer (a tar, compressed or not) into the empty folder `root`, turning its
    OCI whiteouts into overlayfs whiteouts."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                name = _clean(member.name)
                if not name:
                    continue
                parent, _, base = name.rpartition("/")
                _no_symlink_above(root, parent)
                folder = root / parent
                if base == ".wh..wh..opq":
                    folder.mkdir(parents=True, exist_ok=True)
                    os.setxattr(folder, "trusted.overlay.opaque", b"y")
                    continue
                if base.startswith(".wh."):
                    folder.mkdir(parents=True, exist_ok=True)
                    _remove(folder / base[4:])
                    os.mknod(folder / base[4:], stat.S_IFCHR, os.makedev(0, 0))
                    continue
                target = root / name
                if target.is_symlink() or target.exists():
                    if not (member.isdir() and target.is_dir() and not target.is_symlink()):
                        _remove(target)
                if member.islnk():
                    member.linkname = _clean(member.linkname)
                member.name = name
                tar.extract(member, root, set_attrs=True, numeric_owner=True, **_EXTRACT)
    except (tarfile.TarError, OSError, EOFError) as error:
        raise ImageError(f"layer {archive.name}: {error}") from None
