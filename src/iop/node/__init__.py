"""The Node agent: dials Edges, runs requests through a runner, follows the Edge replicas.

`NodeAgent` is the whole agent (what `iop node run` starts): one `iop.providers.Runner` (the
adapter registry, capacity across every Edge, health) shared by an `EdgeConnection` per Edge,
which keeps that Edge's stream up.

- `agents`: `NodeAgent`; `connecting`: `EdgeConnection`, one link to one Edge;
- `arbitrating`: which payload runs when Edge replicas disagree; `resolving`: when to look up
  the Edge replicas a headless Service lists again;
- `healthserving`: the kubelet's probes (`/healthz`, `/readyz`), the Node's only HTTP.
"""

from .agents import NodeAgent
from .arbitrating import PayloadArbiter
from .connecting import Backoff, EdgeConnection, NodeIdentity
from .healthserving import HealthServer

__all__ = [
    "Backoff",
    "EdgeConnection",
    "HealthServer",
    "NodeAgent",
    "NodeIdentity",
    "PayloadArbiter",
]
