"""What the node hub refuses before a Node is authenticated, and how it bounds the rest.

The hub's port faces the network (Nodes may dial it from outside the cluster), so whoever can
reach it could spend the Edge's memory, descriptors and time before any token is checked.
`HubCaps` bounds that, in grpc-core where it offers a bound and in the hub's handler otherwise:
every message at `NODE_MESSAGE_BYTES` (the welcome tells Nodes, which split what is larger), the
handshake and the hello within `hello_timeout`, admitted Nodes and connections fitted to the
open-file limit, calls waiting for their hello overall and per address (`HelloGate` counts them),
streams per connection; an address that keeps failing authentication is throttled
(`AUTH_FAILURES_PER_MINUTE`, `authfailures.py`). `CapRefusals` counts and logs every connection
turned away for a cap. docs/reliability.md, "Hostile peers", says why each bound is so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

from iop.aiokits import LogThrottle, open_file_room
from iop.edgeconfig import NodeLinkSection
from iop.wire import Liveness, grpc_options

#: The largest message the hub takes from anyone, a Node included (its welcome says so).
NODE_MESSAGE_BYTES: Final = 1024 * 1024
#: Failed node authentications one address may make a minute before its tokens go unchecked.
AUTH_FAILURES_PER_MINUTE: Final = 30
#: Concurrent streams one connection may open (a Node opens one; a redial opens a connection).
_STREAMS_PER_CONNECTION: Final = 2

#: The caps a connection may be refused for (the `reason` label of
#: `iop_edge_hub_connections_refused_total`), each with the setting that holds it.
CAP_SETTINGS: Final = MappingProxyType(
    {
        "connections": "edge.node_link.max_connections",
        "unauthenticated": "edge.node_link.max_unauthenticated_connections",
        "per_client": "edge.node_link.max_unauthenticated_per_client",
    }
)


@dataclass(frozen=True, slots=True)
class HubCaps:
    """The hub's bounds; `HubCaps.of(config.edge.node_link).fitted()` for an Edge."""

    hello_timeout: float = 5.0
    max_connections: int = 1024
    max_unauthenticated: int = 64
    max_unauthenticated_per_client: int = 8

    @classmethod
    def of(cls, section: NodeLinkSection) -> HubCaps:
        return cls(
            hello_timeout=section.hello_timeout_ms / 1000,
            max_connections=section.max_connections,
            max_unauthenticated=section.max_unauthenticated_connections,
            max_unauthenticated_per_client=section.max_unauthenticated_per_client,
        )

    @property
    def connection_bound(self) -> int:
        """Connections grpc-core lets in at once: the admitted Nodes, and room beside them for
        those whose hello is being checked (the hub refuses, counts and logs them, with a status
        the Node reads); grpc-core closes one beyond this before any call, unseen."""
        return self.max_connections + self.max_unauthenticated

    def fitted(self, open_files: int | None = None) -> HubCaps:
        """These limits with `connection_bound` lowered to at most half the open files left for
        connections (the OpenAI listener leaves this many for the hub when it fits its own):
        `max_unauthenticated` to at most half of that room, `max_connections` to the rest."""
        room = max(16, open_file_room(open_files) // 2)
        if self.connection_bound <= room:
            return self
        unauthenticated = min(self.max_unauthenticated, room // 2)
        return replace(
            self,
            max_connections=min(self.max_connections, room - unauthenticated),
            max_unauthenticated=unauthenticated,
            max_unauthenticated_per_client=min(
                self.max_unauthenticated_per_client, unauthenticated
            ),
        )

    def server_options(self, liveness: Liveness | None = None) -> list[tuple[str, int]]:
        """grpc.aio server options enforcing what grpc-core can: message size, handshake time,
        connections, idle connections, streams per connection; keepalive after the links'
        `liveness` (see `iop.wire.grpc_options`)."""
        timeout_ms = round(self.hello_timeout * 1000)
        return [
            *grpc_options(max_receive_bytes=NODE_MESSAGE_BYTES, liveness=liveness),
            ("grpc.server_handshake_timeout_ms", timeout_ms),
            ("grpc.max_connection_idle_ms", timeout_ms),
            ("grpc.max_allowed_incoming_connections", self.connection_bound),
            ("grpc.max_concurrent_streams", _STREAMS_PER_CONNECTION),
        ]


def peer_address(peer: str) -> str:
    """The address of a grpc peer string (`ipv4:10.0.0.1:5000`, `ipv6:[::1]:5000`)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return peer


@dataclass(frozen=True, slots=True)
class CapRefusal:
    """A connection turned away for a cap: which (a key of `CAP_SETTINGS`), why, and the cap's
    value in force (the configured one, or lower once fitted to the open-file limit)."""

    reason: str
    why: str
    cap: int


class CapRefusals:
    """The connections turned away for a cap, counted by reason; each reason is logged at most
    once per `interval` with the cap and its value, and how many went unlogged since."""

    def __init__(self, logger: logging.Logger, *, interval: float = 60.0) -> None:
        #: reason -> connections refused since start.
        self.counts: dict[str, int] = dict.fromkeys(CAP_SETTINGS, 0)
        self._lines = {reason: LogThrottle(logger, interval=interval) for reason in CAP_SETTINGS}

    def refused(self, refusal: CapRefusal, peer: str) -> None:
        self.counts[refusal.reason] += 1
        self._lines[refusal.reason].warning(
            "node hub refused a connection from %s: %s (%s is %d)",
            peer,
            refusal.why,
            CAP_SETTINGS[refusal.reason],
            refusal.cap,
        )


class HelloGate:
    """The calls that have not had their hello checked yet, overall and per client address."""

    def __init__(self, limits: HubCaps) -> None:
        self._limits = limits
        self._by_source: dict[str, int] = {}
        self.pending = 0
        #: Calls refused because too many were waiting already.
        self.refused = 0

    def enter(self, source: str) -> CapRefusal | None:
        """Count a call from `source` in; None, or why it is refused (it is not counted then)."""
        limits = self._limits
        if self.pending >= limits.max_unauthenticated:
            self.refused += 1
            return CapRefusal(
                "unauthenticated",
                f"{self.pending} connections are waiting for their hello to be checked",
                limits.max_unauthenticated,
            )
        mine = self._by_source.get(source, 0)
        if mine >= limits.max_unauthenticated_per_client:
            self.refused += 1
            return CapRefusal(
                "per_client",
                f"{mine} connections from {source} are waiting for their hello to be checked",
                limits.max_unauthenticated_per_client,
            )
        self.pending += 1
        self._by_source[source] = mine + 1
        return None

    def leave(self, source: str) -> None:
        """The call from `source` had its hello checked (or ended)."""
        self.pending -= 1
        left = self._by_source[source] - 1
        if left:
            self._by_source[source] = left
        else:
            del self._by_source[source]
