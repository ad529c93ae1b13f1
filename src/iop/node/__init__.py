"""The Node agent: dials Edges, runs requests through adapters, swaps registries with drain.

`NodeAgent` is the whole agent (what `iop node run` starts); `Router` holds the adapter registry
and enforces capacity across every Edge; `EdgeConnection` keeps one Edge's stream up; the
adapters (`openai`, `fake`) are in `iop.node.adapters`.
"""

from .adapters import Adapter, AdapterError, FakeAdapter, OpenAIAdapter, build_adapter
from .agents import NodeAgent
from .arbitrating import PayloadArbiter
from .connecting import Backoff, EdgeConnection, NodeIdentity
from .healthserving import HealthServer
from .routing import DrainReport, Provision, Registry, Router, RunGate

__all__ = [
    "Adapter",
    "AdapterError",
    "Backoff",
    "DrainReport",
    "EdgeConnection",
    "FakeAdapter",
    "HealthServer",
    "NodeAgent",
    "NodeIdentity",
    "OpenAIAdapter",
    "PayloadArbiter",
    "Provision",
    "Registry",
    "Router",
    "RunGate",
    "build_adapter",
]
