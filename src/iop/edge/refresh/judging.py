"""The verdict on a watched change: its requests against the last good revision's (pure).

`judge` compares the figures of the models a change touched since it was applied (`candidate`)
with theirs while the last good revision served (`baseline`), by the rules of `rollout` in the
config (docs/rollout.md, "The checks"):

- errors: the share of failed answers (5xx) and retried tries per request may exceed the
  baseline's by at most `max_error_rate_increase`;
- first token: the p95 may be at most `max_first_token_ratio` times the baseline's plus 100 ms
  (judged only when the baseline has `min_requests` of its own);
- a change with `min_requests` and no failed check is promoted once `bake_ms` has passed; one
  that never reaches `min_requests` is promoted unjudged after `max_wait_ms`.

A failed check rolls the change back as soon as the sample is big enough, before the bake ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from iop.edgeconfig import RolloutSection

from ..pool import Figures

#: wait: judge again later; promote: the change passed; unjudged: too little traffic by the
#: longest wait, promoted anyway; roll_back: a check failed.
Verdict = Literal["wait", "promote", "unjudged", "roll_back"]

#: Added to the baseline's first-token p95 before the ratio applies: a pool that answers in
#: 5 ms is no worse at 20 ms.
FIRST_TOKEN_SLACK_S: Final = 0.1


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

    def verdict(kind: Verdict, check: str, message: str) -> Judgement:
        return Judgement(kind, check, message, candidate, baseline)

    if candidate.requests >= rules.min_requests:
        allowed = baseline.failure_rate + rules.max_error_rate_increase
        if candidate.failure_rate > allowed:
            return verdict(
                "roll_back",
                "errors",
                f"{candidate.failure_rate:.1%} of requests failed or needed a retry "
                f"({candidate.failed} failed, {candidate.retries} retried of "
                f"{candidate.requests}); the last good revision had {baseline.failure_rate:.1%}, "
                f"the most allowed is {allowed:.1%}",
            )
        slow = _slower_first_token(rules, baseline, candidate)
        if slow:
            return verdict("roll_back", "first_token_p95", slow)
        if elapsed_s * 1000 >= rules.bake_ms:
            return verdict(
                "promote",
                "bake",
                f"{candidate.requests} requests in {elapsed_s:.0f}s passed every check",
            )
    elif elapsed_s * 1000 >= rules.max_wait_ms:
        return verdict(
            "unjudged",
            "traffic",
            f"too little traffic to judge: {candidate.requests} of {rules.min_requests} "
            f"requests in {elapsed_s:.0f}s; promoted unjudged",
        )
    return verdict("wait", "", f"{candidate.requests} of {rules.min_requests} requests so far")


def _slower_first_token(rules: RolloutSection, baseline: Figures, candidate: Figures) -> str:
    """Why the candidate's first tokens are too slow, or ""."""
    if baseline.requests < rules.min_requests:
        return ""
    now, before = candidate.first_token_p95(), baseline.first_token_p95()
    if now is None or before is None:
        return ""
    allowed = rules.max_first_token_ratio * before + FIRST_TOKEN_SLACK_S
    if now <= allowed:
        return ""
    return (
        f"p95 time to first token {now:.3f}s against {before:.3f}s on the last good revision; "
        f"the most allowed is {allowed:.3f}s"
    )
