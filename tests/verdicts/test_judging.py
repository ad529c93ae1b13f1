"""The verdict on a watched change (`judging.judge`), on a canary's step (`judge_step`), and the
tally they read (`pool.outcomes`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop.edge.pool import CANDIDATE, OutcomeTally
from iop.edgeconfig import RolloutSection
from iop.verdicts import Figures, Judgement, judge, judge_step

RULES = RolloutSection(min_requests=20, bake_ms=10_000, max_wait_ms=60_000)


def figures(
    requests: int,
    failed: int = 0,
    retried: int = 0,
    first_token_s: float = 0.05,
    tries: int = 1,
) -> Figures:
    """`requests` of m: the first `failed` answered 502, the next `retried` served after `tries`
    retried tries each, the rest served at once."""
    tally = OutcomeTally()
    for index in range(requests):
        if index < failed:
            tally.request("m", 502)
        else:
            tally.request("m", 200, retries=tries if index < failed + retried else 0)
        tally.first_token("m", first_token_s)
    return tally.reading().of(["m"])


def test_the_tally_counts_per_model_and_a_difference_is_a_stretch() -> None:
    tally = OutcomeTally()
    tally.request("m", 200)
    tally.request("other", 503)
    before = tally.reading()
    tally.request("m", 504)
    tally.request("m", 429)  # a refusal of the limits is no failure of the change
    tally.request("m", 404, upstream=True)  # the server does not know the served name
    tally.request("m", 404)  # the Edge's own 404 (no such model in the catalog)
    tally.request("m", 200, upstream=True, retries=1)
    tally.first_token("m", 0.3)
    stretch = tally.reading().of(["m"]) - before.of(["m"])
    assert (stretch.requests, stretch.failed, stretch.retried, stretch.retries) == (5, 2, 1, 1)
    assert stretch.failure_rate == 0.6
    assert stretch.first_token_p95() == 0.35  # the bucket's upper bound
    assert before.of(["m", "other"]).failed == 1


def test_a_request_retried_twice_then_served_is_one_retried_request() -> None:
    tally = OutcomeTally()
    tally.request("m", 200, upstream=True, retries=2)
    once = tally.reading().of(["m"])
    assert (once.requests, once.failed, once.retried, once.retries) == (1, 0, 1, 2)
    assert once.failure_rate == 1.0  # 1 of 1, not 2 of 1
    tally.request("m", 200, upstream=True)
    assert tally.reading().of(["m"]).failure_rate == 0.5


def test_a_request_that_failed_after_a_retry_is_only_failed() -> None:
    tally = OutcomeTally()
    tally.request("m", 502, upstream=True, retries=1)
    tally.request("m", 404, upstream=True, retries=2)  # the stable revision's answer, too
    both = tally.reading().of(["m"])
    assert (both.requests, both.failed, both.retried, both.retries) == (2, 2, 0, 3)
    assert both.failure_rate == 1.0


@given(
    st.lists(
        st.tuples(
            st.sampled_from([200, 400, 404, 429, 499, 502, 504]), st.booleans(), st.integers(0, 3)
        ),
        max_size=40,
    ),
    st.integers(0, 40),
)
def test_failed_and_retried_requests_never_exceed_the_requests(
    ends: list[tuple[int, bool, int]], cut: int
) -> None:
    tally = OutcomeTally()
    before = tally.reading()
    for index, (status, upstream, retries) in enumerate(ends):
        if index == cut:
            before = tally.reading()
        tally.request("m", status, upstream=upstream, retries=retries)
    for seen in (tally.reading().of(["m"]), tally.reading().of(["m"]) - before.of(["m"])):
        assert seen.failed + seen.retried <= seen.requests
        assert 0.0 <= seen.failure_rate <= 1.0
        assert seen.retried <= seen.retries
    whole = tally.reading().of(["m"])
    failed = [status >= 500 or (upstream and status == 404) for status, upstream, _ in ends]
    assert whole.requests == len(ends)
    assert whole.failed == sum(failed)
    assert whole.retried == sum(1 for f, e in zip(failed, ends, strict=True) if not f and e[2])
    assert whole.retries == sum(retries for _, _, retries in ends)


def test_too_few_requests_wait_then_are_promoted_unjudged() -> None:
    assert judge_of(figures(19), 30).verdict == "wait"
    unjudged = judge_of(figures(19), 60)
    assert (unjudged.verdict, unjudged.check) == ("unjudged", "traffic")
    assert "19 of 20" in unjudged.message


def test_enough_good_requests_are_promoted_once_the_bake_is_over() -> None:
    assert judge_of(figures(50), 5).verdict == "wait"
    assert judge_of(figures(50), 10).verdict == "promote"


@pytest.mark.parametrize(
    ("candidate", "check"),
    [
        pytest.param(figures(20, failed=2), "errors", id="failed-answers"),
        pytest.param(figures(20, retried=3), "errors", id="retried-requests"),
        pytest.param(figures(40, first_token_s=0.9), "first_token_p95", id="slow-first-token"),
    ],
)
def test_a_failed_check_rolls_back_before_the_bake_is_over(candidate: Figures, check: str) -> None:
    verdict = judge_of(candidate, 1, baseline=figures(100, failed=1))
    assert (verdict.verdict, verdict.check) == ("roll_back", check)
    assert "last good revision" in verdict.message


def test_failures_the_baseline_had_too_are_no_fault_of_the_change() -> None:
    assert judge_of(figures(100, failed=10), 10, baseline=figures(100, failed=8)).verdict == (
        "promote"
    )


def test_the_errors_check_counts_retried_requests_not_their_tries() -> None:
    # One request of 20 retried three times is 5%: within five points of a clean baseline (its
    # three tries would have made it 15%).
    one = figures(20, retried=1, tries=3)
    assert (one.requests, one.retried, one.retries, one.failure_rate) == (20, 1, 3, 0.05)
    assert judge_of(one, 10, baseline=figures(100)).verdict == "promote"
    two = judge_of(figures(20, failed=1, retried=1, tries=2), 1, baseline=figures(100))
    assert (two.verdict, two.check) == ("roll_back", "errors")
    assert two.message.startswith(
        "10.0% of requests failed or needed a retry (1 failed, 1 retried of 20); "
        "the last good revision had 0.0%, the most allowed is 5.0%"
    )
    assert two.candidate.as_dict()["failure_rate"] == 0.1


def test_first_tokens_are_not_judged_without_a_baseline_of_their_own() -> None:
    assert judge_of(figures(40, first_token_s=5), 10, baseline=figures(5)).verdict == "promote"


def judge_of(candidate: Figures, elapsed: float, baseline: Figures | None = None) -> Judgement:
    return judge(RULES, baseline if baseline is not None else Figures(), candidate, elapsed)


STEPS = RolloutSection(min_requests=20, steps=[5, 25, 100], step_ms=10_000, max_wait_ms=60_000)


def step_of(candidate: Figures, step: int, in_step: float, elapsed: float) -> Judgement:
    return judge_step(STEPS, figures(100), candidate, step, in_step, elapsed)


def test_a_canary_step_ends_after_its_time_with_enough_requests_and_the_last_promotes() -> None:
    assert step_of(figures(50), 0, 5, 5).verdict == "wait"  # the step is not over
    assert step_of(figures(10), 0, 15, 15).verdict == "wait"  # too few requests yet
    moved = step_of(figures(50), 0, 10, 10)
    assert (moved.verdict, moved.check) == ("next", "step")
    assert "at 5%" in moved.message
    assert step_of(figures(50), 1, 10, 20).verdict == "next"
    promoted = step_of(figures(60), 2, 10, 30)
    assert (promoted.verdict, promoted.check) == ("promote", "steps")
    unjudged = step_of(figures(10), 0, 60, 60)
    assert (unjudged.verdict, unjudged.check) == ("unjudged", "traffic")


def test_a_canary_fails_at_any_step_and_on_a_slower_duration() -> None:
    failing = step_of(figures(20, failed=3), 0, 1, 1)
    assert (failing.verdict, failing.check) == ("roll_back", "errors")
    tally = OutcomeTally()
    for _ in range(40):
        tally.request("m", 200)
        tally.duration("m", 4.0)
    slow = judge_step(STEPS, baseline_of_durations(0.4), tally.reading().of(["m"]), 1, 1, 11)
    assert (slow.verdict, slow.check) == ("roll_back", "duration_p95")
    assert "p95 duration 5.000s against 0.500s" in slow.message


def baseline_of_durations(seconds: float) -> Figures:
    tally = OutcomeTally()
    for _ in range(40):
        tally.request("m", 200)
        tally.duration("m", seconds)
    return tally.reading().of(["m"])


def test_the_tally_keeps_the_two_revisions_apart() -> None:
    tally = OutcomeTally()
    tally.request("m", 200)
    tally.request("m", 502, side=CANDIDATE)
    tally.request("m", 200, upstream=True, side=CANDIDATE, retries=1)
    reading = tally.reading()
    assert (reading.of(["m"]).requests, reading.of(["m"]).failed) == (1, 0)
    candidate = reading.of(["m"], CANDIDATE)
    assert (candidate.requests, candidate.failed, candidate.retried, candidate.retries) == (
        2,
        1,
        1,
        1,
    )
