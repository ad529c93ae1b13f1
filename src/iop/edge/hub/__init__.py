"""The Nodes, remote or placed on the Edge: the node hub and what the request path needs of it.

- `protocol`: the `Hub` Protocol and its values (links, loads, node status), all the rest of
  the Edge sees;
- `nodehub`: the gRPC server Nodes dial (`NodeHub`), `nodesessions`: one connected Node,
  `runstreams`: one run's stream (its events and their pace), `snapshots`: what the hub reads
  of the config in use and whom a swap pushes to, `changes`: what changed, told to the hub's
  listeners once per turn of the loop;
- `admission`: who may open a session, `caps`: what the hub refuses before a Node is
  authenticated; `keepalive`: the hub's liveness tick, `visits`: which sessions it looks at;
- `localnodes`: the nodes placed on the Edge, run in this process; `peering`: how many Edge
  replicas share their capacity;
- `nodewait`: the Edge is ready once the nodes that dial in have connected (bounded wait).
"""

from .caps import HubCaps
from .nodehub import NodeHub
from .nodewait import MAX_AWAITED_SHOWN, NodeWait, Readiness
from .peering import PeerCount
from .protocol import (
    ConfigPush,
    Hub,
    NodeRuns,
    NodeStatus,
    PreparedSwap,
    ProviderLink,
    ProviderLoad,
    RunEvents,
    available_providers,
    provider_health,
)

__all__ = [
    "MAX_AWAITED_SHOWN",
    "ConfigPush",
    "Hub",
    "HubCaps",
    "NodeHub",
    "NodeRuns",
    "NodeStatus",
    "NodeWait",
    "PeerCount",
    "PreparedSwap",
    "ProviderLink",
    "ProviderLoad",
    "Readiness",
    "RunEvents",
    "available_providers",
    "provider_health",
]
