"""Checking tools built from Go modules pinned in folders of their own beside this file.

Each tool's folder (`kubeconform/`, `kstatus/`) is a Go module: its go.mod and go.sum pin what is
built, so its dependency graph never moves one of the cluster's (`e2e/cluster/go.mod`), and any
Go source in it (a command of our own around a library) is built with it. The binary goes into
the cluster's binary cache (`e2e/cluster/layout.py`: `~/.cache/iop-edge/cluster/tools`,
or under `IOP_CLUSTER_CACHE`), keyed by a hash of the recipe and every file of the folder, and is
built under the cache's build lock, so two checkouts building at once build it once. Modules come
only through the Go module proxy. Standard library only, like the cluster's launcher.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The cluster's Go toolchain and pins; its cache, lock and errors.
from e2e.cluster import gobuilding, layout

HERE = Path(__file__).resolve().parent


class ToolError(Exception):
    """A tool that could not be built: the message says which and why."""


def log(message: str) -> None:
    print(f"gotools: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GoTool:
    """One binary built from the module folder `HERE / name`."""

    #: The binary's name and its folder's.
    name: str
    #: The package `go build` builds, from the folder ("." for a command of our own).
    package: str
    #: The module whose version is the tool's pin (for messages and `--version`).
    module: str
    #: Bump when the way the binary is built changes: it is part of the cache key.
    recipe: str = "1"

    @property
    def folder(self) -> Path:
        return HERE / self.name

    def version(self) -> str:
        """The pinned version of `module`, from the folder's go.mod."""
        versions = gobuilding.module_versions((self.folder / "go.mod").read_text())
        if self.module not in versions:
            raise ToolError(f"{self.folder / 'go.mod'} does not require {self.module}")
        return versions[self.module]

    def key(self) -> str:
        """A hash of the recipe, go.mod, go.sum and the folder's Go source, in that order."""
        sources = sorted(self.folder.glob("*.go"))
        digest = hashlib.sha256()
        for part in (
            self.recipe,
            (self.folder / "go.mod").read_text(),
            (self.folder / "go.sum").read_text(),
            *(f"{path.name}\0{path.read_text()}" for path in sources),
        ):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()[:16]

    def path(self) -> Path:
        root = layout.cache_root() / "tools" / f"{self.name}-{self.key()}"
        return root / "bin" / self.name

    def build(self) -> Path:
        """The binary for the pin, built first if the cache does not have it."""
        target = self.path()
        if os.access(target, os.X_OK):
            return target
        with layout.file_lock(layout.cache_root() / ".build.lock"):
            if os.access(target, os.X_OK):  # built by whoever held the lock before us
                return target
            log(f"building {self.name} ({self.module} {self.version()}) into {target.parent}")
            started = time.monotonic()
            work = target.parent.with_name(f"{target.parent.name}.tmp-{os.getpid()}")
            try:
                command = [
                    gobuilding.go_command(),
                    "build",
                    "-trimpath",
                    "-ldflags=-s -w",
                    "-o",
                    str(work / self.name),
                    self.package,
                ]
                result = subprocess.run(
                    command, cwd=self.folder, env=gobuilding.go_env(), check=False
                )
                if result.returncode != 0:
                    raise ToolError(f"go build {self.package} exited with {result.returncode}")
                target.parent.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(target.parent, ignore_errors=True)
                work.rename(target.parent)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            log(f"{self.name} built in {time.monotonic() - started:.0f}s")
            return target
