"""What runs a request on a model server, wherever the node runs: in a Node agent or in the Edge.

- `running`: `Runner`, the adapter registry built from a node's payload: capacity, runs
  (`Runner.execute` pushes a run's events to a Node's stream, `Runner.run_events` hands them to
  a caller in the same process), swaps with drain, each provider's health;
- `provisions`: the registry itself, a `Provision` per provider (its payload, adapter, runs and
  health verdict);
- `admittedruns`: an `AdmittedRun`, the events of one run the runner let in, pulled through its
  adapter;
- `runtraces`: a run's span, when the process traces;
- `healthstates`: a provider's verdict from its probes (`probing`) and how its real runs end;
- `adapters`: how a run reaches a provider (`openai`, `fake`).

A Node agent (`iop.node`) puts a `Runner` behind its gRPC links to every Edge; an Edge
(`iop.edge.hub.localnodes`) runs one in its own process for a node placed on the Edge
(`nodes[].placement: edge`), with no Node and no gRPC hop between them.
"""

from .adapters import AdapterError, FakeAdapter, OpenAIAdapter, build_adapter
from .admittedruns import AdmittedRun
from .provisions import Provision
from .running import FIRST_BYTE_TIMEOUT, RunGate, Runner

__all__ = [
    "FIRST_BYTE_TIMEOUT",
    "AdapterError",
    "AdmittedRun",
    "FakeAdapter",
    "OpenAIAdapter",
    "Provision",
    "RunGate",
    "Runner",
    "build_adapter",
]
