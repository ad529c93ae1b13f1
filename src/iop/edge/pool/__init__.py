"""Where a request runs: the pool's snapshot, dispatch, and one request's trip.

- `snapshots`: the pool as one immutable value (models, candidates, limits), swapped whole;
- `dispatching`: the `Dispatcher` (candidates, capacity, the fair queue) and `choosing`
  (among equals: round robin, least load, prefix affinity, with `prefixes`);
- `relaying`: one request's run, its retries (`retrying`) and fallbacks; `metering`: usage and
  the pool's metrics.
"""

from .dispatching import Dispatcher
from .metering import CONTENT_TYPE, Metrics
from .relaying import Relay, RelayedRun
from .snapshots import PoolSnapshot

__all__ = ["CONTENT_TYPE", "Dispatcher", "Metrics", "PoolSnapshot", "Relay", "RelayedRun"]
