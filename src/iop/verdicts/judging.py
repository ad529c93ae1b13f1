"""The verdict on a watched change: its requests against the last good revision's (pure).

`judge` (a change applied to all at once) and `judge_step` (a canary's step) compare the
figures of the requests the change served on the models it touched (`candidate`) with theirs
served by the last good revision (`baseline`), by the rules of `rollout` in the config
(docs/rollout.md, "The checks"):

- errors: the share of requests that failed (5xx) or needed a retry may exceed the
  baseline's by at most `max_error_rate_increase`;
- first token and duration: each p95 may be at most `max_first_token_ratio` (and
  `max_duration_ratio`) times the baseline's plus a slack (judged only when the baseline has
  `min_requests` of its own);
- a change with `min_requests` and no failed check is promoted once `bake_ms` has passed (a
  canary: goes to its next step once the step's `step_ms` has, and is promoted after the last);
  one that never reaches `min_requests` is promoted unjudged after `max_wait_ms`.

A failed check rolls the change back as soon as the sample is big enough, before the bake ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from iop.edgeconfig import RolloutSection

from .figures import Figures

#: wait: judge again later; next: the canary's next step; promote: the change passed;
#: unjudged: too little traffic by the longest wait, promoted anyway; roll_back: a check failed.
Verdict = Literal["wait", "next", "promote", "unjudged", "roll_back"]

#: Added to the baseline's first-token p95 before the ratio applies: a pool that answers in
#: 5 ms is no worse at 20 ms.
FIRST_TOKEN_SLACK_S: Final = 0.1
#: The same for the duration: answers of a few hundred tokens vary by that much.
DURATION_SLACK_S: Final = 0.5


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    #: The check that decided (errors, first_token_p95, bake, traffic), or "" while waiting.
    check: str
    message: str
    candidate: Figures
    baseline: Figures

    def as_dict(self) -> dict[str, object]:
        return {
            "verdict": self.verdict,
            "check": self.check,
            "message": self.message,
            "candidate": self.candidate.as_dict(),
            "baseline": self.baseline.as_dict(),
        }


def judge(
    rules: RolloutSection, baseline: Figures, candidate: Figures, elapsed_s: float
) -> Judgement:
    """The verdict on `candidate` after `elapsed_s` seconds of watching (see the module)."""

    failed = _failed_check(rules, baseline, candidate)
    if failed is not None:
        return failed
    if candidate.requests >= rules.min_requests:
        if elapsed_s * 1000 >= rules.bake_ms:
            return Judgement(
                "promote",
                "bake",
                f"{candidate.requests} requests in {elapsed_s:.0f}s passed every check",
                candidate,
                baseline,
            )
    elif elapsed_s * 1000 >= rules.max_wait_ms:
        return _too_little(rules, baseline, candidate, elapsed_s)
    return _waiting(rules, baseline, candidate)


def judge_step(
    rules: RolloutSection,
    baseline: Figures,
    candidate: Figures,
    step: int,
    step_elapsed_s: float,
    elapsed_s: float,
) -> Judgement:
    """The verdict on a canary at step `step` (an index of `rules.steps`), `step_elapsed_s`
    into the step and `elapsed_s` into the canary; `candidate` counts from the canary's start."""
    failed = _failed_check(rules, baseline, candidate)
    if failed is not None:
        return failed
    if candidate.requests >= rules.min_requests:
        if step_elapsed_s * 1000 >= rules.step_ms:
            share = rules.steps[step]
            if step + 1 < len(rules.steps):
                return Judgement(
                    "next",
                    "step",
                    f"{candidate.requests} requests passed every check at {share}%",
                    candidate,
                    baseline,
                )
            return Judgement(
                "promote",
                "steps",
                f"{candidate.requests} requests in {elapsed_s:.0f}s passed every check, the "
                f"last step at {share}%",
                candidate,
                baseline,
            )
    elif elapsed_s * 1000 >= rules.max_wait_ms:
        return _too_little(rules, baseline, candidate, elapsed_s)
    return _waiting(rules, baseline, candidate)


def _failed_check(rules: RolloutSection, baseline: Figures, candidate: Figures) -> Judgement | None:
    """The failed check's verdict, once the candidate has `min_requests`; None when none."""
    if candidate.requests < rules.min_requests:
        return None
    allowed = baseline.failure_rate + rules.max_error_rate_increase
    if candidate.failure_rate > allowed:
        message = (
            f"{candidate.failure_rate:.1%} of requests failed or needed a retry "
            f"({candidate.failed} failed, {candidate.retried} retried of "
            f"{candidate.requests}); the last good revision had {baseline.failure_rate:.1%}, "
            f"the most allowed is {allowed:.1%}"
        )
        return Judgement("roll_back", "errors", message, candidate, baseline)
    if baseline.requests < rules.min_requests:
        return None
    for check, what, ratio, slack, now, before in (
        (
            "first_token_p95",
            "time to first token",
            rules.max_first_token_ratio,
            FIRST_TOKEN_SLACK_S,
            candidate.first_token_p95(),
            baseline.first_token_p95(),
        ),
        (
            "duration_p95",
            "duration",
            rules.max_duration_ratio,
            DURATION_SLACK_S,
            candidate.duration_p95(),
            baseline.duration_p95(),
        ),
    ):
        if now is None or before is None:
            continue
        limit = ratio * before + slack
        if now > limit:
            message = (
                f"p95 {what} {now:.3f}s against {before:.3f}s on the last good revision; "
                f"the most allowed is {limit:.3f}s"
            )
            return Judgement("roll_back", check, message, candidate, baseline)
    return None


def _too_little(
    rules: RolloutSection, baseline: Figures, candidate: Figures, elapsed_s: float
) -> Judgement:
    return Judgement(
        "unjudged",
        "traffic",
        f"too little traffic to judge: {candidate.requests} of {rules.min_requests} "
        f"requests in {elapsed_s:.0f}s; promoted unjudged",
        candidate,
        baseline,
    )


def _waiting(rules: RolloutSection, baseline: Figures, candidate: Figures) -> Judgement:
    message = f"{candidate.requests} of {rules.min_requests} requests so far"
    return Judgement("wait", "", message, candidate, baseline)
