"""The pod network of one local cluster: a node namespace with a bridge, linked to the host.

Several clusters run side by side on one machine (each worktree has its own state directory),
so everything host-wide is derived from the state directory (`<id>`, 8 hex digits of a hash of
its path) or allocated under a machine-wide lock (`N`, the slot of its 10.250-10.252.N ranges),
and `down` of one cluster touches only what carries its id. The bridge, kube-proxy's nftables
table and IP forwarding live in the node namespace `iop-<id>-node`, each pod in a namespace of
its own; the host's sysctls, firewall and other routes are never changed. Standard library only,
like localcluster.py. e2e/cluster/README.md, "The network", draws it and says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

NET_LOCK = Path("/tmp/iop-cluster-net.lock")
NETNS_DIR = Path("/run/netns")
SLOTS = 250


class NetworkError(Exception):
    pass


def ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def cluster_id(state_dir: Path) -> str:
    return hashlib.sha256(str(state_dir.absolute()).encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Network:
    """What one cluster's network is; stored in cluster.json so `down` finds exactly it."""

    id: str
    slot: int

    @property
    def node_netns(self) -> str:
        return f"iop-{self.id}-node"

    @property
    def netns_prefix(self) -> str:
        return f"iop-{self.id}-"

    @property
    def host_veth(self) -> str:
        return f"iop{self.id}"

    @property
    def pod_cidr(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.250.{self.slot}.0/24")

    @property
    def link(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.251.{self.slot}.0/30")

    @property
    def service_cidr(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.252.{self.slot}.0/24")

    @property
    def host_ip(self) -> str:
        """The host's end of the link: API server, CoreDNS and kubelet listen here."""
        return str(self.link.network_address + 1)

    @property
    def node_ip(self) -> str:
        return str(self.link.network_address + 2)

    @property
    def gateway(self) -> str:
        return str(self.pod_cidr.network_address + 1)

    @property
    def kubernetes_service_ip(self) -> str:
        return str(self.service_cidr.network_address + 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Network:
        return cls(id=str(data["id"]), slot=int(data["slot"]))

    # -- what exists

    def namespaces(self) -> list[str]:
        """Every namespace of this cluster: the node's and each pod's."""
        try:
            names = sorted(os.listdir(NETNS_DIR))
        except OSError:
            return []
        return [name for name in names if name.startswith(self.netns_prefix)]

    def exists(self) -> bool:
        return (NETNS_DIR / self.node_netns).exists()

    def leftovers(self) -> list[str]:
        """What of this network is still on the machine (empty after `down`)."""
        found = [f"netns {name}" for name in self.namespaces()]
        if Path(f"/sys/class/net/{self.host_veth}").exists():
            found.append(f"link {self.host_veth}")
        return found


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    with NET_LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _taken_slots() -> set[int]:
    """Slots whose ranges the host already has addresses or routes in."""
    taken = set()
    text = ip("-4", "-o", "addr", "show") + ip("-4", "route", "show", "table", "all")
    for word in text.split():
        address = word.split("/", 1)[0]
        parts = address.split(".")
        if len(parts) == 4 and parts[0] == "10" and parts[1] in ("250", "251", "252"):
            with contextlib.suppress(ValueError):
                taken.add(int(parts[2]))
    return taken


def create(state_dir: Path) -> Network:
    """Allocate a slot and build the node namespace, bridge, host link and routes."""
    ident = cluster_id(state_dir)
    with machine_lock():
        stale = Network(id=ident, slot=0)
        if stale.leftovers():  # a previous run of this very cluster died without `down`
            teardown(stale)
        taken = _taken_slots()
        start = int(ident, 16) % SLOTS
        slot = next(((start + step) % SLOTS for step in range(SLOTS)
                     if (start + step) % SLOTS not in taken), None)  # fmt: skip
        if slot is None:
            raise NetworkError("no free 10.250-252.N.0/24 slot on this machine")
        net = Network(id=ident, slot=slot)
        try:
            _build(net)
        except BaseException:
            teardown(net)
            raise
    return net


def _build(net: Network) -> None:
    node = net.node_netns
    prefix = net.link.prefixlen
    ip("netns", "add", node)
    ip("-n", node, "link", "set", "lo", "up")
    ip("-n", node, "link", "add", "br0", "type", "bridge")
    ip("-n", node, "addr", "add", f"{net.gateway}/{net.pod_cidr.prefixlen}", "dev", "br0")
    ip("-n", node, "link", "set", "br0", "up")
    ip("link", "add", net.host_veth, "type", "veth", "peer", "name", "eth0", "netns", node)
    ip("addr", "add", f"{net.host_ip}/{prefix}", "dev", net.host_veth)
    ip("link", "set", net.host_veth, "up")
    ip("-n", node, "addr", "add", f"{net.node_ip}/{prefix}", "dev", "eth0")
    ip("-n", node, "link", "set", "eth0", "up")
    ip("-n", node, "route", "add", "default", "via", net.host_ip)
    for cidr in (net.pod_cidr, net.service_cidr):
        ip("route", "add", str(cidr), "via", net.node_ip, "dev", net.host_veth)
    # Forwarding between the host link and the bridge, in the node namespace only.
    subprocess.run(
        ["ip", "netns", "exec", node, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
        check=True,
        capture_output=True,
    )


def teardown(net: Network, *, grace: float = 5.0) -> list[str]:
    """Kill every process in this cluster's namespaces, then delete them and the host link.

    Only namespaces named with this cluster's id are touched; a process counts as the
    cluster's because it lives in one of them (`ip netns pids`).
    """
    removed = []
    namespaces = net.namespaces()
    pids = {int(p) for name in namespaces for p in ip("netns", "pids", name, check=False).split()}
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)}
            if pids:
                time.sleep(0.05)
    # Pods first: their veths sit on the node's bridge.
    for name in sorted(namespaces, key=lambda n: n == net.node_netns):
        ip("netns", "delete", name, check=False)
        removed.append(f"netns {name}")
    if Path(f"/sys/class/net/{net.host_veth}").exists():
        ip("link", "delete", net.host_veth, check=False)
        removed.append(f"link {net.host_veth}")
    return removed


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"
