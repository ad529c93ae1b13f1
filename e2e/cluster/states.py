"""What `up` records about a running cluster (`State`: ports, network, the processes it
started as `Started`), saved in the state directory so that `down` and `status` find exactly
those processes again. Standard library only.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .clusternet import Network
from .layout import LOOPBACK


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
