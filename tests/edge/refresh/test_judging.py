"""The verdict on a watched change (`judging.judge`), on a canary's step (`judge_step`), and the
tally they read (`pool.outcomes`)."""

from __future__ import annotations

import pytest

from iop.edge.pool import CANDIDATE, Figures, OutcomeTally
from iop.edge.refresh.judging import Judgement, judge, judge_step
from iop.edgeconfig import RolloutSection

RULES = RolloutSection(min_requests=20, bake_ms=10_000, max_wait_ms=60_000)


def figures(
    requests: int, failed: int = 0, retries: int = 0, first_token_s: float = 0.05
) -> Figures:
    tally = OutcomeTally()
    for index in range(requests):
        tally.request("m", 502 if index < failed else 200)
        tally.first_token("m", first_token_s)
    for _ in range(retries):
        tally.retry("m")
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
    tally.retry("m")
    tally.first_token("m", 0.3)
    stretch = tally.reading().of(["m"]) - before.of(["m"])
    assert (stretch.requests, stretch.failed, stretch.retries) == (4, 2, 1)
    assert stretch.failure_rate == 0.75
    assert stretch.first_token_p95() == 0.35  # the bucket's upper bound
    assert before.of(["m", "other"]).failed == 1


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
        pytest.param(figures(20, retries=3), "errors", id="retried-tries"),
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
    tally.retry("m", side=CANDIDATE)
    reading = tally.reading()
    assert (reading.of(["m"]).requests, reading.of(["m"]).failed) == (1, 0)
    candidate = reading.of(["m"], CANDIDATE)
    assert (candidate.requests, candidate.failed, candidate.retries) == (1, 1, 1)
