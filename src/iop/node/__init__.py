"""The Node agent: dials Edges, runs requests through adapters, swaps registries with drain.

`NodeAgent` is the whole agent (what `iop node run` starts): one `iop.providers.Runner` (the
adapter registry, capacity across every Edge, health) shared by an `EdgeConnection` per Edge,
which keeps that Edge's stream up.
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
