"""A network namespace per pod, joined to the node's bridge by a veth pair.

The bridge lives in the cluster's node namespace (made by `up`, see e2e/cluster/clusternet.py),
so the interface names inside it (`br0`, one `v<uid>` per pod) can never collide with another
cluster's; only the pod namespace names are host-wide, and they carry the cluster's id.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("kubelet.net")

NETNS_DIR = Path("/run/netns")


class NetworkError(Exception):
    pass


async def ip(*args: str, check: bool = True) -> str:
    process = await asyncio.create_subprocess_exec(
        "ip", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    if check and process.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {err.decode().strip()}")
    return out.decode()


@dataclass
class PodNetwork:
    """Hands out pod addresses from the node's pod CIDR and wires namespaces to the bridge."""

    node_netns: str
    bridge: str
    pod_cidr: ipaddress.IPv4Network
    gateway: ipaddress.IPv4Address
    netns_prefix: str
    _used: set[ipaddress.IPv4Address] = field(default_factory=set)
    _cursor: int = 0

    def netns_name(self, uid: str) -> str:
        return f"{self.netns_prefix}{uid[:8]}"

    def netns_path(self, uid: str) -> str:
        return str(NETNS_DIR / self.netns_name(uid))

    def _allocate(self) -> ipaddress.IPv4Address:
        hosts = [h for h in self.pod_cidr.hosts() if h != self.gateway]
        # Round robin, so a deleted pod's address is not handed out again at once (its old
        # Endpoints may still be in flight).
        for step in range(len(hosts)):
            candidate = hosts[(self._cursor + step) % len(hosts)]
            if candidate not in self._used:
                self._cursor = (self._cursor + step + 1) % len(hosts)
                self._used.add(candidate)
                return candidate
        raise NetworkError(f"pod CIDR {self.pod_cidr} is full")

    async def create(self, uid: str) -> ipaddress.IPv4Address:
        name = self.netns_name(uid)
        veth = f"v{uid[:8]}"
        if (NETNS_DIR / name).exists():  # left by a kubelet that died: start clean
            await self.delete(uid, None)
        address = self._allocate()
        try:
            await ip("netns", "add", name)
            await ip("-n", name, "link", "set", "lo", "up")
            await ip("-n", self.node_netns, "link", "add", veth, "type", "veth",
                     "peer", "name", "eth0", "netns", name)  # fmt: skip
            await ip("-n", self.node_netns, "link", "set", veth, "master", self.bridge, "up")
            prefix = self.pod_cidr.prefixlen
            await ip("-n", name, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
            await ip("-n", name, "link", "set", "eth0", "up")
            await ip("-n", name, "route", "add", "default", "via", str(self.gateway))
        except BaseException:
            await self.delete(uid, address)
            raise
        return address

    async def delete(self, uid: str, address: ipaddress.IPv4Address | None) -> None:
        """Remove the namespace (its veth goes with it). The caller has ended its processes."""
        name = self.netns_name(uid)
        if (NETNS_DIR / name).exists():
            await ip("netns", "delete", name, check=False)
        await ip("-n", self.node_netns, "link", "delete", f"v{uid[:8]}", check=False)
        if address is not None:
            self._used.discard(address)

    async def pids(self, uid: str) -> list[int]:
        if not (NETNS_DIR / self.netns_name(uid)).exists():
            return []
        out = await ip("netns", "pids", self.netns_name(uid), check=False)
        return [int(word) for word in out.split()]
