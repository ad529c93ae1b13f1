"""Where a request runs: the pool's snapshot, dispatch, and one request's trip.

- `snapshots`: the pool as one immutable value (models, candidates, limits), swapped whole;
- `dispatching`: the `Dispatcher` (a slot now or a place in the queue, shedding, displacement,
  which waiting request a freed slot serves) over `selecting` (the candidate that takes a request
  now: capacity, long slots, priority), `slots` (a provider's slot counters, a run's lease),
  `waiters` (the waiting requests in their queues: `queues`, fair by principal and strict by
  priority class) and `choosing` (among equals: round robin, least load, prefix affinity, with
  `prefixes`);
- `relaying`: one request's run, retries (`retrying`), fallbacks; `metering` (`counts`): usage and
  the pool's metrics; `outcomes`: what each model's requests came to, for judging a change;
  `splits`: which revision serves a request while a change is on trial; `priorities`: the
  priority class a request waits in, and what each class's requests came to; `traces`: a
  request's spans, when the Edge traces; `responsehomes`: which provider holds each stored
  response of the Responses API.
"""

from .dispatching import Dispatcher
from .metering import CONTENT_TYPE, Metrics
from .outcomes import OutcomeTally, Reading
from .priorities import CLASS_HEADER, MAX_WAIT_HEADER
from .relaying import Relay, RelayedRun
from .responsehomes import (
    ResponseHome,
    ResponseHomes,
    ResponseHomesCollector,
    answer_id,
    stream_id,
)
from .snapshots import PoolModel, PoolSnapshot
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
    "PoolModel",
    "PoolSnapshot",
    "Reading",
    "Relay",
    "RelayedRun",
    "RequestTrace",
    "ResponseHome",
    "ResponseHomes",
    "ResponseHomesCollector",
    "Side",
    "Split",
    "answer_id",
    "stream_id",
]
