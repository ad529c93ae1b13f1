"""What a long-running `iop` process does once it has started: keep the collector off its start-up.

An Edge or a Node imports grpc, aiohttp, pydantic, uvicorn and the config before it serves its
first request: a great many objects that live as long as the process. CPython's cyclic
collector scans every one of them again at each full (generation-2) collection, which under load
stops the event loop long enough to put whoever is in flight into the latency tail: the largest
avoidable source of the tail that docs/benchmarks.md found ("Where the tail comes from").
`gc.freeze()` moves everything alive at that moment out of the collector's reach for good, so
later collections scan only what serving allocates. It is the standard library's own remedy
(CPython's documentation of `gc.freeze`); nothing is leaked, the frozen objects are simply never
scanned for cycles again.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect what start-up left behind, then freeze everything still alive."""
    gc.collect()
    gc.freeze()
