"""What runs a request on a model server, wherever it runs: in a Node agent or in the Edge itself.

`Runner` (`running.py`) holds the adapter registry built from a node's payload, admits runs
against each provider's capacity, runs them (`Runner.execute` pushes a run's events to a
Node's stream; `Runner.run_events` yields them to a caller in the same process), swaps
registries with drain and judges each provider's health (`healthstates.py`) from its probes
(`probing.py`) and from how its real runs end. The adapters (`openai`, `fake`) are in
`iop.providers.adapters`.

A Node agent (`iop.node`) puts a `Runner` behind its gRPC links to every Edge; an Edge
(`iop.edge.hub.localnodes`) runs one in its own process for a node placed on the Edge
(`nodes[].placement: edge`), with no Node and no gRPC hop between them.
"""

from .adapters import AdapterError, FakeAdapter, OpenAIAdapter, build_adapter
from .running import FIRST_BYTE_TIMEOUT, Provision, RunGate, Runner

__all__ = [
    "FIRST_BYTE_TIMEOUT",
    "AdapterError",
    "FakeAdapter",
    "OpenAIAdapter",
    "Provision",
    "RunGate",
    "Runner",
    "build_adapter",
]
