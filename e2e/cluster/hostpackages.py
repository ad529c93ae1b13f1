"""The Debian packages the local cluster and the image build need on the host, installed on demand.

The cluster's network and kubelet run `ip`, `nsenter` and `nft`; the image build runs `buildah`
and `mmdebstrap`. Each caller names the commands it needs; whatever is missing is installed with
apt-get (as root), waiting for another apt-get that holds dpkg's lock (another worktree's build).
Standard library only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping


class PackageError(Exception):
    """A package could not be installed: the message says which and why."""


def ensure_commands(packages: Mapping[str, str], log: Callable[[str], None] | None = None) -> None:
    """Install the Debian package of each command in `packages` (command -> package) that is
    not on PATH."""
    missing = sorted(
        {package for command, package in packages.items() if not shutil.which(command)}
    )
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PackageError(f"install the Debian packages {', '.join(missing)} (apt-get, as root)")
    if log is not None:
        log(f"installing Debian packages: {', '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", "DPkg::Lock::Timeout=300"]
    install = ["apt-get", *wait, "install", "-y", "--no-install-recommends", *missing]
    result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:  # the package lists may be missing or stale
        subprocess.run(["apt-get", *wait, "update"], env=env, capture_output=True, check=False)
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PackageError(f"apt-get install {' '.join(missing)} failed:\n{result.stderr[-2000:]}")
