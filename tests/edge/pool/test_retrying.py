"""The retry budget and which failures are retried before the first byte (docs/edge.md)."""

from __future__ import annotations

import pytest

from iop.edge.pool.retrying import RetryBudget, RetryBudgets, should_retry
from iop.edge.pool.snapshots import PoolSnapshot
from iop.edgeconfig import RetrySection
from iop.wire import RunFailed
from iop.wire import statuses as wire_statuses


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(**values: float) -> RetrySection:
    return RetrySection.model_validate(values)


def retries_granted(budget: RetryBudget, section: RetrySection, wanted: int) -> int:
    return sum(budget.try_retry(section) for _ in range(wanted))


def test_retries_stay_below_the_percent_of_requests() -> None:
    budget = RetryBudget(10_000, Clock())
    section = settings(budget_percent=20, budget_min_per_second=0)
    for _ in range(100):
        budget.count_request()
    assert retries_granted(budget, section, 50) == 20
    budget.count_request()
    budget.count_request()
    budget.count_request()
    budget.count_request()
    budget.count_request()  # 105 requests: room for one more
    assert retries_granted(budget, section, 5) == 1


def test_the_minimum_per_second_lets_a_quiet_model_retry() -> None:
    budget = RetryBudget(10_000, Clock())
    section = settings(budget_percent=20, budget_min_per_second=0.5)
    budget.count_request()
    # 0.5/s over a 10 s window: 5 retries, though 20% of one request is none.
    assert retries_granted(budget, section, 10) == 5


def test_the_larger_of_percent_and_minimum_applies_not_their_sum() -> None:
    budget = RetryBudget(10_000, Clock())
    section = settings(budget_percent=10, budget_min_per_second=1)
    for _ in range(200):
        budget.count_request()
    assert retries_granted(budget, section, 100) == 20  # 10% of 200 beats 1/s x 10 s


def test_the_window_slides_old_requests_and_retries_out() -> None:
    clock = Clock()
    budget = RetryBudget(10_000, clock)
    section = settings(budget_percent=50, budget_min_per_second=0)
    for _ in range(10):
        budget.count_request()
    assert retries_granted(budget, section, 10) == 5
    clock.now += 5.0
    for _ in range(10):
        budget.count_request()
    assert retries_granted(budget, section, 10) == 5  # 20 requests, 5 retries in the window
    clock.now += 5.5  # the first ten requests and their retries left the window
    assert (budget.requests, budget.retries) == (10, 5)
    assert retries_granted(budget, section, 10) == 0
    clock.now += 10.0
    assert (budget.requests, budget.retries) == (0, 0)


def test_no_budget_means_no_retry() -> None:
    budget = RetryBudget(10_000, Clock())
    section = settings(budget_percent=0, budget_min_per_second=0)
    for _ in range(1000):
        budget.count_request()
    assert not budget.try_retry(section)


def test_budgets_are_per_model_and_follow_the_snapshot(config_of, provider) -> None:
    clock = Clock()
    budgets = RetryBudgets(clock)
    config = config_of([provider("a"), provider("b")], {"m": ["a"], "n": ["b"]})
    snapshot = PoolSnapshot.build(config)
    m = budgets.of(snapshot, "m")
    assert budgets.of(snapshot, "n") is not m
    assert budgets.of(PoolSnapshot.build(config, 2), "m") is m  # same window: kept
    m.count_request()
    longer = config.model_copy(
        update={
            "openai": config.openai.model_copy(
                update={"retries": settings(budget_window_ms=20_000)}
            )
        }
    )
    fresh = budgets.of(PoolSnapshot.build(longer, 3), "m")
    assert fresh is not m and fresh.requests == 0  # a changed window counts afresh


@pytest.mark.parametrize(
    ("failed", "retried"),
    [
        pytest.param(
            wire_statuses.failure(wire_statuses.UPSTREAM_ERROR, "HTTP 500"), True, id="5xx"
        ),
        pytest.param(
            wire_statuses.failure(wire_statuses.UPSTREAM_UNAVAILABLE, "refused"), True, id="refused"
        ),
        pytest.param(
            wire_statuses.failure(wire_statuses.UPSTREAM_TIMEOUT, "no byte"), True, id="timeout"
        ),
        pytest.param(
            RunFailed(wire_statuses.NODE_DISCONNECTED, "gone", True, None), True, id="node-lost"
        ),
        pytest.param(
            wire_statuses.failure(wire_statuses.NOT_ACCEPTED, "never accepted"),
            True,
            id="unaccepted",
        ),
        pytest.param(
            wire_statuses.failure(wire_statuses.UPSTREAM_RATE_LIMITED, "429"), True, id="429"
        ),
        pytest.param(
            wire_statuses.failure(wire_statuses.BAD_REQUEST, "too long", status=400),
            False,
            id="4xx",
        ),
        pytest.param(
            wire_statuses.failure(wire_statuses.UPSTREAM_AUTH, "401", status=401), False, id="auth"
        ),
        pytest.param(
            wire_statuses.failure(wire_statuses.EDGE_STOPPING, "stopping"),
            False,
            id="edge-stopping",
        ),
        pytest.param(
            wire_statuses.failure(wire_statuses.INTERNAL_ERROR, "bug"), False, id="internal"
        ),
    ],
)
def test_which_failures_are_retried_before_the_first_byte(failed: RunFailed, retried: bool) -> None:
    assert should_retry(failed) is retried
