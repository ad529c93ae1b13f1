"""What each model's requests came to, counted for judging a config change (docs/rollout.md).

`OutcomeTally` keeps, per model the clients asked for, running totals of requests, failed
answers (5xx), tries that needed a retry, and the time to first token in fixed buckets. A judge
takes a `Reading` (a copy of the totals) now and another later; their difference is what the
requests of that stretch came to (`Figures`), from which rates and a p95 follow. Counting is a
dict lookup and two additions, on the hot path beside the Prometheus metrics.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

#: Upper bounds (seconds) of the first-token buckets; the last bucket is everything above.
FIRST_TOKEN_BOUNDS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.175, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

#: What a provider's server answers when the config names the wrong model or key.
_CONFIG_FAULTS: Final = frozenset({401, 403, 404})


class _Totals:
    __slots__ = ("failed", "first_tokens", "requests", "retries")

    def __init__(self) -> None:
        self.requests = 0
        self.failed = 0
        self.retries = 0
        self.first_tokens = [0] * (len(FIRST_TOKEN_BOUNDS) + 1)


@dataclass(frozen=True, slots=True)
class Figures:
    """What some requests came to: the difference of two readings, or their sum over models."""

    requests: int = 0
    failed: int = 0
    retries: int = 0
    first_tokens: tuple[int, ...] = field(default=(0,) * (len(FIRST_TOKEN_BOUNDS) + 1))

    @property
    def failure_rate(self) -> float:
        """Failed answers and retried tries per request (0 with no request)."""
        return (self.failed + self.retries) / self.requests if self.requests else 0.0

    def first_token_p95(self) -> float | None:
        """The upper bound of the bucket holding the 95th percentile (None: no first token; the
        last bucket's lower bound when it holds it)."""
        seen = sum(self.first_tokens)
        if not seen:
            return None
        wanted, running = 0.95 * seen, 0
        for index, count in enumerate(self.first_tokens):
            running += count
            if running >= wanted:
                return FIRST_TOKEN_BOUNDS[min(index, len(FIRST_TOKEN_BOUNDS) - 1)]
        return FIRST_TOKEN_BOUNDS[-1]

    def __add__(self, other: Figures) -> Figures:
        return Figures(
            self.requests + other.requests,
            self.failed + other.failed,
            self.retries + other.retries,
            tuple(a + b for a, b in zip(self.first_tokens, other.first_tokens, strict=True)),
        )

    def __sub__(self, other: Figures) -> Figures:
        return Figures(
            self.requests - other.requests,
            self.failed - other.failed,
            self.retries - other.retries,
            tuple(a - b for a, b in zip(self.first_tokens, other.first_tokens, strict=True)),
        )

    def as_dict(self) -> dict[str, object]:
        p95 = self.first_token_p95()
        return {
            "requests": self.requests,
            "failed": self.failed,
            "retries": self.retries,
            "failure_rate": round(self.failure_rate, 4),
            "first_token_p95_s": p95,
        }


@dataclass(frozen=True, slots=True)
class Reading:
    """The tally's totals at one moment, per model."""

    models: Mapping[str, Figures] = field(default_factory=lambda: MappingProxyType({}))

    def of(self, models: Iterable[str]) -> Figures:
        """The totals of `models`, summed."""
        total = Figures()
        for model in models:
            figures = self.models.get(model)
            if figures is not None:
                total = total + figures
        return total


class OutcomeTally:
    """Running totals per model; see the module docstring."""

    def __init__(self) -> None:
        self._models: dict[str, _Totals] = {}

    def _totals(self, model: str) -> _Totals:
        totals = self._models.get(model)
        if totals is None:
            totals = self._models[model] = _Totals()
        return totals

    def request(self, model: str, status: int, upstream: bool = False) -> None:
        """An answered request of `model` (the model the client asked for); `upstream`: the
        answer came from a provider's server. Failed: a 5xx, or a provider's server that did not
        know the model or the key (404, 401, 403: what a wrong served name or API key gives);
        the Edge's own refusals (limits, auth) and the client's mistakes (400, 422) are not."""
        if not model:
            return
        totals = self._totals(model)
        totals.requests += 1
        if status >= 500 or (upstream and status in _CONFIG_FAULTS):
            totals.failed += 1

    def retry(self, model: str) -> None:
        """A try of `model`'s request that failed before its first byte and was retried."""
        self._totals(model).retries += 1

    def first_token(self, model: str, seconds: float) -> None:
        self._totals(model).first_tokens[bisect.bisect_left(FIRST_TOKEN_BOUNDS, seconds)] += 1

    def reading(self) -> Reading:
        return Reading(
            MappingProxyType(
                {
                    model: Figures(t.requests, t.failed, t.retries, tuple(t.first_tokens))
                    for model, t in self._models.items()
                }
            )
        )
