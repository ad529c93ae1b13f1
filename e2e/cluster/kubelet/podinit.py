"""The first program of every container: enter the pod's namespaces, lay out its files, exec.

There is no container runtime here, so a container is a process that starts as this program and
becomes the container's command by `exec` (same PID, which is what the kubelet tracks). Before
that it does what a runtime would do for our purposes:

- joins the pod's network namespace (made by the kubelet), and gets its own mount and UTS
  namespaces (the hostname is the pod's name);
- builds a root for the container on a private tmpfs: every top-level entry of the host's root
  is bind-mounted in (recursively: /proc, /dev, /sys, /usr, /tmp, the checkout, ...), so the
  project's virtualenv and the system Python are there as on the host;
- mounts each volume at its mountPath. A mountPath whose directories do not exist on the host
  gets them without touching the host: at the top level they are made in the tmpfs, deeper
  down the nearest existing directory is covered by an overlay whose upper layer is in the
  tmpfs (so `/var/run/secrets/kubernetes.io/serviceaccount` exists in the pod and nowhere else);
- binds the pod's own /etc/hosts, /etc/hostname and /etc/resolv.conf;
- chroots into that root and execs the command with exactly the container's environment.

Everything it mounts lives in the container's mount namespace and disappears with its last
process; the host's mount table never changes. Standard library only (ctypes for the syscalls
Python 3.11 lacks), so it starts fast. Input: one JSON file (see `PodInit` in containers.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
from pathlib import Path
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_UNBINDABLE = 1 << 17
MS_PRIVATE = 1 << 18

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class InitError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise InitError(f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        libc.mount(
            source.encode() if source is not None else None,
            target.encode(),
            fstype.encode() if fstype is not None else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def enter_namespaces(netns: str, hostname: str) -> None:
    fd = os.open(netns, os.O_RDONLY)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns {netns}")
    finally:
        os.close(fd)
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    # Nothing mounted from here on may propagate back to the host.
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    name = hostname.encode()
    _check(libc.sethostname(name, len(name)), "sethostname")


class Root:
    """The container's root: a tmpfs holding binds of the host's top-level entries."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.overlays = 0
        path.mkdir(parents=True, exist_ok=True)
        mount("tmpfs", str(path), "tmpfs", 0, "mode=755")
        # Unbindable: the recursive binds below (of /tmp, say, which holds this very folder)
        # then skip it instead of copying it into itself.
        mount(None, str(path), None, MS_UNBINDABLE)
        for entry in os.scandir("/"):
            target = path / entry.name
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
            elif entry.is_dir():
                target.mkdir()
                mount(entry.path, str(target), None, MS_BIND | MS_REC)
            else:
                target.touch()
                mount(entry.path, str(target), None, MS_BIND)
        # Overlays need upper layers on a bindable mount, so they get a tmpfs of their own.
        (path / ".iop-overlays").mkdir()
        mount("tmpfs", str(path / ".iop-overlays"), "tmpfs", 0, "mode=700")

    def resolve(self, container_path: str) -> tuple[Path, list[str]]:
        """The deepest existing directory for `container_path` (symlinks followed inside this
        root), and the components still missing below it."""
        parts = [part for part in container_path.split("/") if part]
        current = self.path
        hops = 0
        while parts:
            candidate = current / parts[0]
            if candidate.is_symlink():
                hops += 1
                if hops > 40:
                    raise InitError(f"too many symlinks resolving {container_path}")
                link = os.readlink(candidate)
                parts = [p for p in link.split("/") if p] + parts[1:]
                if link.startswith("/"):
                    current = self.path
                continue
            if parts[0] == "..":
                if current != self.path:
                    current = current.parent
                parts.pop(0)
                continue
            if not candidate.exists():
                return current, parts
            current = candidate
            parts.pop(0)
        return current, []

    def make_path(self, container_path: str, *, is_file: bool) -> Path:
        """A host path for `container_path` in this root, creating what is missing privately."""
        existing, missing = self.resolve(container_path)
        if not missing:
            return existing
        if existing != self.path:
            # Under a host directory: cover it with an overlay whose changes stay in the tmpfs.
            self.overlays += 1
            work = self.path / ".iop-overlays" / str(self.overlays)
            (work / "upper").mkdir(parents=True)
            (work / "work").mkdir()
            options = f"lowerdir={existing},upperdir={work / 'upper'},workdir={work / 'work'}"
            mount("overlay", str(existing), "overlay", 0, options)
        target = existing.joinpath(*missing)
        if is_file:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        else:
            target.mkdir(parents=True, exist_ok=True)
        return target

    def bind_all(self, binds: list[tuple[str, str, bool]]) -> None:
        """Bind (source, container path, read-only) entries. Every target is made first,
        shallowest first, so a later overlay can never hide an earlier bind."""
        targets = {}
        for source, container_path, _ in sorted(binds, key=lambda b: b[1].count("/")):
            is_file = not os.path.isdir(source)
            targets[container_path] = self.make_path(container_path, is_file=is_file)
        for source, container_path, read_only in binds:
            target = str(targets[container_path])
            mount(source, target, None, MS_BIND | MS_REC)
            if read_only:
                mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)

    def keep_visible(self, folders: list[str], volume_targets: list[str]) -> None:
        """Bind each of `folders` (the image's own: its virtualenv, the checkout, its Python)
        back at its path when a volume was mounted over one of its parents: a container's
        emptyDir at /tmp must not hide a checkout under /tmp. The folder is made inside the
        volume (a writable one: an emptyDir)."""
        for folder in folders:
            covering = [
                t for t in volume_targets if folder.startswith(t.rstrip("/") + "/") or folder == t
            ]
            if not covering:
                continue
            target = self.path / folder.lstrip("/")
            try:
                target.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise InitError(
                    f"volume at {covering[0]} hides {folder}, which the image needs, and "
                    f"{folder} cannot be made in it: {error.strerror}"
                ) from None
            mount(folder, str(target), None, MS_BIND | MS_REC)


def run(spec: dict[str, Any]) -> None:
    enter_namespaces(spec["netns"], spec["hostname"])
    root = Root(Path(spec["root"]))
    binds = [(source, path, False) for path, source in spec["files"].items()]
    binds += [(m["source"], m["target"], m["read_only"]) for m in spec["mounts"]]
    root.bind_all(binds)
    root.keep_visible(spec.get("keep", []), [m["target"] for m in spec["mounts"]])
    os.chroot(root.path)
    workdir = spec.get("workdir") or "/"
    try:
        os.chdir(workdir)
    except OSError as error:
        raise InitError(f"workingDir {workdir}: {error.strerror}") from None
    argv: list[str] = spec["argv"]
    env: dict[str, str] = spec["env"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as error:
        raise InitError(f"exec {argv[0]}: {error.strerror} (PATH={env.get('PATH', '')})") from None


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        run(spec)
    except InitError as error:
        print(f"iop-kubelet: container start failed: {error}", file=sys.stderr, flush=True)
        sys.exit(spec.get("failure_exit_code", 128))


if __name__ == "__main__":
    main()
