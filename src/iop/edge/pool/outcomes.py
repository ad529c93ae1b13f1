"""What each model's requests came to, counted for judging a config change (docs/rollout.md).

`OutcomeTally` keeps, per model and per side (the stable revision, or the candidate of a change
on trial: `splits.py`), running totals of requests, and the time to first token and the
duration in fixed buckets. Each request is counted once, when it ends, as served cleanly,
served after a retry, or failed (with the tries it had retried), so no figure of a reading
counts a request still in flight. A judge takes a `Reading` (a copy of the totals) now and
another later; their difference is what the requests of that stretch came to (`Figures`), from
which rates and p95s follow. Counting is a dict lookup and a few additions, on the hot path
beside the Prometheus metrics; the totals are also metrics of their own (`OutcomeCollector`:
`revision="stable"|"candidate"`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .splits import SIDE_NAMES, STABLE, Side

#: Upper bounds (seconds) of the first-token buckets; the last bucket is everything above.
FIRST_TOKEN_BOUNDS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.175, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

#: Upper bounds (seconds) of the duration buckets; the last bucket is everything above.
DURATION_BOUNDS: Final = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

#: What a provider's server answers when the config names the wrong model or key.
_CONFIG_FAULTS: Final = frozenset({401, 403, 404})


class _Totals:
    __slots__ = ("durations", "failed", "first_tokens", "requests", "retried", "retries")

    def __init__(self) -> None:
        self.requests = 0
        self.failed = 0
        self.retried = 0
        self.retries = 0
        self.first_tokens = [0] * (len(FIRST_TOKEN_BOUNDS) + 1)
        self.durations = [0] * (len(DURATION_BOUNDS) + 1)

    def figures(self) -> Figures:
        return Figures(
            self.requests,
            self.failed,
            self.retried,
            self.retries,
            tuple(self.first_tokens),
            tuple(self.durations),
        )


def _p95(counts: tuple[int, ...], bounds: tuple[float, ...]) -> float | None:
    """The upper bound of the bucket holding the 95th percentile (None: nothing counted; the
    last bucket's lower bound when it holds it)."""
    seen = sum(counts)
    if not seen:
        return None
    wanted, running = 0.95 * seen, 0
    for index, count in enumerate(counts):
        running += count
        if running >= wanted:
            return bounds[min(index, len(bounds) - 1)]
    return bounds[-1]


def _pairwise(a: tuple[int, ...], b: tuple[int, ...], sign: int) -> tuple[int, ...]:
    return tuple(x + sign * y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True, slots=True)
class Figures:
    """What some requests came to: the difference of two readings, or their sum over models.

    Every request that ended is one of `requests`, and at most one of `failed` and `retried`;
    `retries` counts the tries behind `retried` (and those of failed requests)."""

    requests: int = 0
    #: Requests whose answer failed (`OutcomeTally.request` says which answers do).
    failed: int = 0
    #: Requests answered without failing after one or more of their tries were retried.
    retried: int = 0
    #: The tries of these requests that failed before their first byte and were retried.
    retries: int = 0
    first_tokens: tuple[int, ...] = field(default=(0,) * (len(FIRST_TOKEN_BOUNDS) + 1))
    durations: tuple[int, ...] = field(default=(0,) * (len(DURATION_BOUNDS) + 1))

    @property
    def failure_rate(self) -> float:
        """The share of requests that failed or needed a retry (0 with no request)."""
        return (self.failed + self.retried) / self.requests if self.requests else 0.0

    def first_token_p95(self) -> float | None:
        """The p95 time to first token, as the upper bound of its bucket (None: none seen)."""
        return _p95(self.first_tokens, FIRST_TOKEN_BOUNDS)

    def duration_p95(self) -> float | None:
        """The p95 duration of the answered requests, as the upper bound of its bucket."""
        return _p95(self.durations, DURATION_BOUNDS)

    def __add__(self, other: Figures) -> Figures:
        return self._combined(other, 1)

    def __sub__(self, other: Figures) -> Figures:
        return self._combined(other, -1)

    def _combined(self, other: Figures, sign: int) -> Figures:
        return Figures(
            self.requests + sign * other.requests,
            self.failed + sign * other.failed,
            self.retried + sign * other.retried,
            self.retries + sign * other.retries,
            _pairwise(self.first_tokens, other.first_tokens, sign),
            _pairwise(self.durations, other.durations, sign),
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "failed": self.failed,
            "retried": self.retried,
            "retries": self.retries,
            "failure_rate": round(self.failure_rate, 4),
            "first_token_p95_s": self.first_token_p95(),
            "duration_p95_s": self.duration_p95(),
        }


_NOTHING: Final[Mapping[str, Figures]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Reading:
    """The tally's totals at one moment, per side (stable, candidate) and model."""

    sides: tuple[Mapping[str, Figures], Mapping[str, Figures]] = (_NOTHING, _NOTHING)

    def of(self, models: Iterable[str], side: Side = STABLE) -> Figures:
        """The totals of `models` on `side`, summed."""
        figures_of = self.sides[side]
        total = Figures()
        for model in models:
            figures = figures_of.get(model)
            if figures is not None:
                total = total + figures
        return total


class OutcomeTally:
    """Running totals per side and model; see the module docstring."""

    def __init__(self) -> None:
        self._sides: tuple[dict[str, _Totals], dict[str, _Totals]] = ({}, {})

    def _totals(self, model: str, side: Side) -> _Totals:
        totals = self._sides[side].get(model)
        if totals is None:
            totals = self._sides[side][model] = _Totals()
        return totals

    def request(
        self,
        model: str,
        status: int,
        upstream: bool = False,
        side: Side = STABLE,
        retries: int = 0,
    ) -> None:
        """An ended request of `model` (the one the client asked for, or the fallback that took
        over); `upstream`: the answer came from a provider's server; `retries`: its tries that
        failed before their first byte and were tried again (a busy provider's refusal is none).
        Failed: a 5xx, or a provider's server that did not know the model or the key (404, 401,
        403: what a wrong served name or API key gives); the Edge's own refusals (limits, auth)
        and the client's mistakes (400, 422) are not. Retried: not failed, after a retry."""
        if not model:
            return
        totals = self._totals(model, side)
        totals.requests += 1
        totals.retries += retries
        if status >= 500 or (upstream and status in _CONFIG_FAULTS):
            totals.failed += 1
        elif retries:
            totals.retried += 1

    def first_token(self, model: str, seconds: float, side: Side = STABLE) -> None:
        totals = self._totals(model, side)
        totals.first_tokens[bisect.bisect_left(FIRST_TOKEN_BOUNDS, seconds)] += 1

    def duration(self, model: str, seconds: float, side: Side = STABLE) -> None:
        """How long an answered request of `model` took, from its arrival to its end."""
        if model:
            totals = self._totals(model, side)
            totals.durations[bisect.bisect_left(DURATION_BOUNDS, seconds)] += 1

    def reading(self) -> Reading:
        stable, candidate = (
            MappingProxyType({model: t.figures() for model, t in totals.items()})
            for totals in self._sides
        )
        return Reading((stable, candidate))


class OutcomeCollector(Collector):
    """The tally as metrics by revision (`stable`, `candidate`), read when Prometheus scrapes."""

    def __init__(self, tally: OutcomeTally) -> None:
        self._tally = tally

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "revision"]
        requests = CounterMetricFamily(
            "iop_edge_revision_requests",
            "Answered requests by the revision that served them (the candidate of a change on "
            "trial, or the stable one).",
            labels=labels,
        )
        failed = CounterMetricFamily(
            "iop_edge_revision_failed_requests",
            "Of those, the failed ones (5xx, and a provider's 401, 403 or 404).",
            labels=labels,
        )
        retried = CounterMetricFamily(
            "iop_edge_revision_retried_requests",
            "Of those, the ones not failed that needed a retry (a try that failed before its "
            "first byte and was tried again).",
            labels=labels,
        )
        retries = CounterMetricFamily(
            "iop_edge_revision_retries",
            "Tries of those requests that failed before their first byte and were tried again "
            "(counted when their request ends; a busy provider's refusal is none).",
            labels=labels,
        )
        first = HistogramMetricFamily(
            "iop_edge_revision_first_token_seconds",
            "Time to first token by revision.",
            labels=labels,
        )
        duration = HistogramMetricFamily(
            "iop_edge_revision_duration_seconds",
            "Request duration by revision.",
            labels=labels,
        )
        for side, name in enumerate(SIDE_NAMES):
            for model, figures in sorted(self._tally.reading().sides[side].items()):
                values = [model, name]
                requests.add_metric(values, figures.requests)
                failed.add_metric(values, figures.failed)
                retried.add_metric(values, figures.retried)
                retries.add_metric(values, figures.retries)
                first.add_metric(values, *_buckets(figures.first_tokens, FIRST_TOKEN_BOUNDS))
                duration.add_metric(values, *_buckets(figures.durations, DURATION_BOUNDS))
        yield from (requests, failed, retried, retries, first, duration)


def _buckets(
    counts: tuple[int, ...], bounds: tuple[float, ...]
) -> tuple[list[tuple[str, float]], None]:
    """Cumulative Prometheus buckets of a tally's counts (no sum is kept: None)."""
    cumulative, running = [], 0
    for bound, count in zip((*map(str, bounds), "+Inf"), counts, strict=True):
        running += count
        cumulative.append((bound, float(running)))
    return cumulative, None
