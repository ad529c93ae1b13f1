"""Where a request runs: the pool's snapshot, dispatch, and one request's trip.

- `snapshots`: the pool as one immutable value (models, candidates, limits), swapped whole;
- `dispatching`: the `Dispatcher` (candidates, capacity, its queues: `queues`, fair by
  principal and strict by priority class) and `choosing` (among equals: round robin, least
  load, prefix affinity, with `prefixes`);
- `relaying`: one request's run, retries (`retrying`), fallbacks; `metering` (`counts`): usage and
  the pool's metrics; `outcomes`: what each model's requests came to, for judging a change;
  `splits`: which revision serves a request while a change is on trial; `priorities`: the
  priority class a request waits in, and what each class's requests came to; `traces`: a
  request's spans, when the Edge traces.
"""

from .dispatching import Dispatcher
from .metering import CONTENT_TYPE, Metrics
from .outcomes import OutcomeTally, Reading
from .priorities import CLASS_HEADER, MAX_WAIT_HEADER
from .relaying import Relay, RelayedRun
from .snapshots import PoolSnapshot
from .splits import CANDIDATE, STABLE, Side, Split
from .traces import RequestTrace

__all__ = [
    "CANDIDATE",
    "CLASS_HEADER",
    "CONTENT_TYPE",
    "MAX_WAIT_HEADER",
    "STABLE",
    "Dispatcher",
    "Metrics",
    "OutcomeTally",
    "PoolSnapshot",
    "Reading",
    "Relay",
    "RelayedRun",
    "RequestTrace",
    "Side",
    "Split",
]
