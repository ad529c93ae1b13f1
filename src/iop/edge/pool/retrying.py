"""Which failures the Edge retries before a request's first byte, and the budget that bounds it.

A failure is retried only while nothing of the answer reached the client: `relaying.py` sees it
as the run's first event. Retried (`should_retry`): the wire's retryable failures and, before
the first byte, an upstream's 5xx, a dropped connection and a timeout; not retried: 4xx,
credentials the provider refused, an Edge that is stopping. Retries are budgeted per requested
model on each Edge, as in Envoy's and Finagle's retry budgets, over a sliding window: a ring of
`_BUCKETS` counters, so each count and check is O(1); `provider_busy` escapes the budget.
docs/edge.md, "Retries and fallbacks", gives the rules and why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from iop.edgeconfig import RetrySection
from iop.wire import RunFailed
from iop.wire import statuses as wire_statuses

from .snapshots import PoolSnapshot

#: Failures retried before the first byte although the wire does not mark them retryable: another
#: provider may well answer what this one's upstream failed at (a 5xx, a dropped connection, no
#: answer in time).
_RETRIED_BEFORE_FIRST_BYTE: Final = frozenset(
    {wire_statuses.UPSTREAM_ERROR, wire_statuses.UPSTREAM_TIMEOUT}
)
#: Retryable on the wire, yet never retried by this Edge: it is stopping, so any try fails alike.
_NOT_HERE: Final = frozenset({wire_statuses.EDGE_STOPPING})
#: The ring's length: the window slides in tenths.
_BUCKETS: Final = 10


def should_retry(failed: RunFailed) -> bool:
    """True when `failed`, arriving before any byte reached the client, is worth another try."""
    if failed.code in _NOT_HERE:
        return False
    return failed.retryable or failed.code in _RETRIED_BEFORE_FIRST_BYTE


class RetryBudget:
    """Requests and retries of one model over a sliding window, and whether one more retry fits.

    `clock` is seconds on a monotonic clock (injectable for tests).
    """

    __slots__ = (
        "_clock",
        "_epoch",
        "_requests",
        "_retries",
        "_slide_at",
        "_slot",
        "_total_requests",
        "_total_retries",
        "_width",
        "window_ms",
    )

    def __init__(self, window_ms: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_ms = window_ms
        self._clock = clock
        self._width = window_ms / 1000 / _BUCKETS
        self._requests = [0] * _BUCKETS
        self._retries = [0] * _BUCKETS
        self._total_requests = 0
        self._total_retries = 0
        self._epoch = int(clock() / self._width)
        self._slot = self._epoch % _BUCKETS
        self._slide_at = (self._epoch + 1) * self._width  # when the current bucket ends

    def count_request(self) -> None:
        """A request began (its first try). On every request's path: one clock read."""
        if self._clock() >= self._slide_at:
            self._slide()
        self._requests[self._slot] += 1
        self._total_requests += 1

    def try_retry(self, settings: RetrySection) -> bool:
        """Count one retry and return True if the budget has room for it; else False."""
        self._slide()
        allowed = max(
            settings.budget_min_per_second * self.window_ms / 1000,
            settings.budget_percent / 100 * self._total_requests,
        )
        if self._total_retries + 1 > allowed:
            return False
        self._retries[self._slot] += 1
        self._total_retries += 1
        return True

    @property
    def requests(self) -> int:
        """Requests counted in the window now."""
        self._slide()
        return self._total_requests

    @property
    def retries(self) -> int:
        """Retries counted in the window now."""
        self._slide()
        return self._total_retries

    def _slide(self) -> None:
        """Forget the buckets that left the window, and move to the current one."""
        epoch = int(self._clock() / self._width)
        steps = epoch - self._epoch
        if steps <= 0:
            return
        if steps >= _BUCKETS:
            self._requests = [0] * _BUCKETS
            self._retries = [0] * _BUCKETS
            self._total_requests = self._total_retries = 0
        else:
            for passed in range(self._epoch + 1, epoch + 1):
                slot = passed % _BUCKETS
                self._total_requests -= self._requests[slot]
                self._total_retries -= self._retries[slot]
                self._requests[slot] = self._retries[slot] = 0
        self._epoch = epoch
        self._slot = epoch % _BUCKETS
        self._slide_at = (epoch + 1) * self._width


class RetryBudgets:
    """One `RetryBudget` per requested model, following the pool snapshot: a model that left
    the catalog loses its budget, and a changed window starts its count afresh."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._budgets: dict[str, RetryBudget] = {}
        self._snapshot: PoolSnapshot | None = None

    def count_request(self, snapshot: PoolSnapshot, model_id: str) -> RetryBudget:
        """Count a request for `model_id` (under `snapshot`'s settings); its model's budget."""
        budget = self._budgets.get(model_id)
        if budget is not None and snapshot is self._snapshot:
            budget.count_request()
            return budget
        budget = self.of(snapshot, model_id)
        budget.count_request()
        return budget

    def of(self, snapshot: PoolSnapshot, model_id: str) -> RetryBudget:
        """The budget of `model_id` under `snapshot`'s settings."""
        if snapshot is not self._snapshot:
            self._snapshot = snapshot
            window = snapshot.retries.budget_window_ms
            self._budgets = {
                model: budget
                for model, budget in self._budgets.items()
                if model in snapshot.models and budget.window_ms == window
            }
        budget = self._budgets.get(model_id)
        if budget is None:
            budget = self._budgets[model_id] = RetryBudget(
                snapshot.retries.budget_window_ms, self._clock
            )
        return budget
