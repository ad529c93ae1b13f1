"""What each model's requests came to, counted for judging a config change (docs/rollout.md).

`OutcomeTally` keeps, per model and per side (the stable revision, or the candidate of a change
on trial: `splits.py`), running totals of requests, and the time to first token and the
duration in fixed buckets. Each request is counted once, when it ends, as served cleanly,
served after a retry, or failed (with the tries it had retried), so no figure of a reading
counts a request still in flight. A judge takes a `Reading` (a copy of the totals) now and
another later; their difference is what the requests of that stretch came to (`Figures`, in
`iop.verdicts` with the judge), from which rates and p95s follow. Counting is a dict lookup and
a few additions, on the hot path beside the Prometheus metrics; the totals are also metrics of
their own (`OutcomeCollector`: `revision="stable"|"candidate"`).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from iop.verdicts import DURATION_BOUNDS, FIRST_TOKEN_BOUNDS, Figures

from .splits import SIDE_NAMES, STABLE, Side

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

    def total(self) -> Figures:
        """Every request counted, of every model on both sides: what the process served."""
        total = Figures()
        for figures_of in self.sides:
            for figures in figures_of.values():
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

    def of(self, models: Iterable[str], side: Side = STABLE) -> Figures:
        """The totals of `models` on `side` now, summed: `reading().of(models, side)` without a
        copy of every model's totals first (a watch reads it twice a second, and a change may
        touch every model of thousands)."""
        totals_of = self._sides[side]
        requests = failed = retried = retries = 0
        first_tokens: list[int] | tuple[int, ...] = Figures().first_tokens
        durations: list[int] | tuple[int, ...] = Figures().durations
        for model in models:
            totals = totals_of.get(model)
            if totals is None:
                continue
            requests += totals.requests
            failed += totals.failed
            retried += totals.retried
            retries += totals.retries
            first_tokens = list(map(operator.add, first_tokens, totals.first_tokens))
            durations = list(map(operator.add, durations, totals.durations))
        return Figures(requests, failed, retried, retries, tuple(first_tokens), tuple(durations))

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
