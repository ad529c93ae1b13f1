"""Starting `iop` commands as child processes: the one place `iop up`, tests and benchmarks use.

`iop fake-upstream` and `iop edge run` print one JSON line on stdout once they listen; this
package reads it, so callers can start them on port 0 and learn where they listen.

- `spawning`: the fake upstream, an Edge and a Node as child processes;
- `ports`: `free_port`, a port for a process that takes its port from a command line or a
  config instead; `share_ports`, disjoint shares of them for the workers of a parallel run.
"""

from .ports import free_port, share_ports
from .spawning import (
    UpstreamProcess,
    iop_command,
    owned,
    spawn_edge,
    spawn_fake_upstream,
    spawn_iop,
    spawn_node,
    terminate,
)

__all__ = [
    "UpstreamProcess",
    "free_port",
    "iop_command",
    "owned",
    "share_ports",
    "spawn_edge",
    "spawn_fake_upstream",
    "spawn_iop",
    "spawn_node",
    "terminate",
]
