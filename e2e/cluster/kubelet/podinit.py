"""The first program of every container: the runtime's part, then `exec` of the command.

There is no container runtime here, so a container is a process that starts as this program and
becomes the container's command by `exec` (same PID, which is what the kubelet tracks). Before
that it does, with plain system calls, what runc does for our purposes: the pod's network
namespace joined, mount and UTS namespaces of its own, an overlay root of the image's layers and
a writable layer, /proc, /sys, /dev, the pod's /etc files and volumes, `pivot_root`, then the
container's user, groups, capabilities and no_new_privs. Input: one JSON file (`Launch` in
containers.py). e2e/cluster/README.md ("The process kubelet": "A container's root and mounts",
"Security context") has each step and why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_KEEPCAPS = 8
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = 155  # x86_64
CAPABILITY_VERSION_3 = 0x20080522

# (name, major, minor) of the devices a runtime puts in every container's /dev.
DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8),
           ("urandom", 1, 9), ("tty", 5, 0))  # fmt: skip
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx", "core": "/proc/kcore"}  # fmt: skip

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
    """The container's root: the image's file system under this container's writable layer."""

    def __init__(self, path: Path, layers: list[str], layer: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (layer / "upper").mkdir(parents=True, exist_ok=True)
        (layer / "work").mkdir(parents=True, exist_ok=True)
        lower = ":".join(reversed(layers))  # overlayfs lists the top layer first
        options = f"lowerdir={lower},upperdir={layer / 'upper'},workdir={layer / 'work'}"
        mount("overlay", str(path), "overlay", 0, options)

    def inside(self, container_path: str, *, is_file: bool) -> Path:
        """The host path of `container_path` in this root (symlinks followed inside the root
        only), made, with its missing parents, if it does not exist."""
        parts = [part for part in container_path.split("/") if part]
        current = self.path
        hops = 0
        while parts:
            candidate = current / parts[0]
            if parts[0] == "..":
                current = current.parent if current != self.path else current
                parts.pop(0)
                continue
            if candidate.is_symlink():
                hops += 1
                if hops > 40:
                    raise InitError(f"too many symlinks resolving {container_path}")
                link = os.readlink(candidate)
                parts = [p for p in link.split("/") if p] + parts[1:]
                if link.startswith("/"):
                    current = self.path
                continue
            if not candidate.exists():
                if len(parts) == 1 and is_file:
                    candidate.touch()
                else:
                    candidate.mkdir()
            current = candidate
            parts.pop(0)
        return current

    def kernel_file_systems(self) -> None:
        """/proc, /sys (read-only), /dev with its devices, /dev/pts and /dev/shm."""
        proc = self.inside("/proc", is_file=False)
        mount("proc", str(proc), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        sys_dir = str(self.inside("/sys", is_file=False))
        try:
            mount("sysfs", sys_dir, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except InitError:  # where a fresh sysfs is refused, the host's, read-only
            mount("/sys", sys_dir, None, MS_BIND | MS_REC)
            mount(None, sys_dir, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        dev = self.inside("/dev", is_file=False)
        mount("tmpfs", str(dev), "tmpfs", MS_NOSUID, "mode=755,size=65536k")
        for name, major, minor in DEVICES:
            os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))
            os.chmod(dev / name, 0o666)
        for name, target in DEV_LINKS.items():
            os.symlink(target, dev / name)
        (dev / "pts").mkdir()
        mount("devpts", str(dev / "pts"), "devpts", MS_NOSUID | MS_NOEXEC,
              "newinstance,ptmxmode=0666,mode=0620,gid=5")  # fmt: skip
        (dev / "shm").mkdir()
        mount("shm", str(dev / "shm"), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              "mode=1777,size=65536k")  # fmt: skip

    def bind_all(self, binds: list[tuple[str, str, bool]]) -> None:
        """Bind (source, container path, read-only) entries, shallowest first, so a deeper
        mount point is made inside the volume above it."""
        for source, container_path, read_only in sorted(binds, key=lambda b: b[1].count("/")):
            target = str(self.inside(container_path, is_file=not os.path.isdir(source)))
            mount(source, target, None, MS_BIND | MS_REC)
            if read_only:
                mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)

    def read_only(self) -> None:
        mount(None, str(self.path), None, MS_REMOUNT | MS_BIND | MS_RDONLY)

    def pivot(self) -> None:
        """Make this root the mount namespace's root and detach the host's tree under it."""
        os.chdir(self.path)
        _check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
        _check(libc.umount2(b".", MNT_DETACH), "umount the host's root")
        os.chdir("/")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]  # fmt: skip


def become(user: dict[str, Any], keep: list[int], no_new_privs: bool, last_cap: int) -> None:
    """Groups, group, bounding set, no_new_privs, user; a root user keeps only `keep`."""
    os.setgroups(user["groups"])
    os.setgid(user["gid"])
    _check(libc.prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    for capability in range(last_cap + 1):
        if capability not in keep:
            _check(
                libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0), f"drop capability {capability}"
            )
    if no_new_privs:
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.setuid(user["uid"])  # a user other than root loses every capability here
    if user["uid"] == 0:
        mask = [0, 0]
        for capability in keep:
            mask[capability // 32] |= 1 << (capability % 32)
        header = _CapHeader(CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)(*(_CapData(m, m, 0) for m in mask))
        _check(libc.capset(ctypes.byref(header), data), "capset")


def run(spec: dict[str, Any]) -> None:
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    enter_namespaces(spec["netns"], spec["hostname"])
    root = Root(Path(spec["root"]), spec["layers"], Path(spec["layer"]))
    root.kernel_file_systems()
    binds = [(source, path, False) for path, source in spec["files"].items()]
    binds += [(m["source"], m["target"], m["read_only"]) for m in spec["mounts"]]
    root.bind_all(binds)
    workdir = spec.get("workdir") or "/"
    root.inside(workdir, is_file=False)
    if spec["read_only_root"]:
        root.read_only()
    root.pivot()
    become(spec["user"], spec["capabilities"], spec["no_new_privs"], last_cap)
    try:
        os.chdir(workdir)
    except OSError as error:
        raise InitError(f"workingDir {workdir}: {error.strerror}") from None
    argv: list[str] = spec["argv"]
    env: dict[str, str] = spec["env"]
    if "exec_fd" in spec:  # closed by the exec: the kubelet then reports the container running
        os.set_inheritable(spec["exec_fd"], False)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as error:
        raise InitError(f"exec {argv[0]}: {error.strerror} (PATH={env.get('PATH', '')})") from None


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        run(spec)
    except (InitError, OSError) as error:
        print(f"iop-kubelet: container start failed: {error}", file=sys.stderr, flush=True)
        sys.exit(spec.get("failure_exit_code", 128))


if __name__ == "__main__":
    main()
