"""`rollout`: how a live change is watched once applied, canaried and judged, and rolled back."""

from __future__ import annotations

import itertools
from typing import Annotated, Literal

from pydantic import Field, field_validator

from .fields import Spec, live


class RolloutSection(Spec):
    """How a live change is watched once applied (docs/rollout.md): each change becomes a
    revision; one that touches what is served (models, providers) is judged on the requests of
    the models it touches, against the figures of the last good revision, and put back to that
    revision by the Edge itself when it hurts."""

    mode: Annotated[
        Literal["canary", "watch", "off"],
        live(
            "canary: a change to what serves a model (its providers, served names, policy, "
            "fallbacks) first serves a share of that model's requests, in `steps`, judged "
            "against the stable revision at each step; a change of limits only (capacity, "
            "priority, queues) applies to all at once and is watched. watch: every change "
            "applies to all at once and is watched. Both roll a change back automatically when "
            "it fails a check; off: apply and keep, as before revisions."
        ),
    ] = "canary"
    steps: Annotated[
        list[int],
        live(
            "The canary's shares, in percent of the changed models' requests, each served for "
            "step_ms and judged before the next; the change is promoted after the last.",
            min_length=1,
            max_length=10,
        ),
    ] = Field(default_factory=lambda: [5, 25, 100])
    step_ms: Annotated[
        int,
        live(
            "Milliseconds each canary step serves before the next (it waits longer while the "
            "change has fewer than min_requests judged, up to max_wait_ms in all).",
            ge=100,
            le=3_600_000,
        ),
    ] = 10_000
    bake_ms: Annotated[
        int,
        live(
            "Milliseconds a watched change serves before it can be promoted (with at least "
            "min_requests judged).",
            ge=0,
            le=3_600_000,
        ),
    ] = 15_000
    max_wait_ms: Annotated[
        int,
        live(
            "Longest a change is watched: with fewer than min_requests by then it is promoted "
            "unjudged (too little traffic to judge), and its revision says so.",
            ge=1000,
            le=3_600_000,
        ),
    ] = 60_000
    min_requests: Annotated[
        int,
        live(
            "Requests of the touched models a verdict needs, on the change (and, for the first "
            "token check, on the last good revision too).",
            ge=1,
            le=1_000_000,
        ),
    ] = 20
    max_error_rate_increase: Annotated[
        float,
        live(
            "Fails the change when its share of requests that failed (a 5xx answer) or needed "
            "a retry exceeds the last good revision's by more than this (0.05: five points).",
            ge=0,
            le=1,
        ),
    ] = 0.05
    max_first_token_ratio: Annotated[
        float,
        live(
            "Fails the change when its p95 time to first token exceeds this many times the last "
            "good revision's (plus 100 ms, so a fast pool's jitter is no failure).",
            ge=1,
            le=100,
        ),
    ] = 2.0
    max_duration_ratio: Annotated[
        float,
        live(
            "Fails the change when its p95 request duration exceeds this many times the last "
            "good revision's (plus 500 ms).",
            ge=1,
            le=100,
        ),
    ] = 2.0

    @field_validator("steps")
    @classmethod
    def _steps_rise(cls, steps: list[int]) -> list[int]:
        if any(not 1 <= step <= 100 for step in steps):
            raise ValueError("each step is a share in percent, from 1 to 100")
        if any(later <= earlier for earlier, later in itertools.pairwise(steps)):
            raise ValueError(f"the steps must rise: {steps}")
        return steps
