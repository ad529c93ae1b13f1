"""What some served requests came to, in numbers a judge compares (docs/rollout.md).

`Figures` holds counts: requests, how many failed or needed a retry, and the time to first token
and the duration in fixed buckets (`FIRST_TOKEN_BOUNDS`, `DURATION_BOUNDS`), so two of them
subtract (a stretch of time) and add (several models, several Edge pods) exactly, and rates and
p95s follow. The Edge counts its requests into them (`iop.edge.pool.outcomes`); `GET /status`
carries a pod's totals (`counts`), which the operator reads back (`of_counts`) to hold an Edge
restart's new pod to the old ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

#: Upper bounds (seconds) of the first-token buckets; the last bucket is everything above.
FIRST_TOKEN_BOUNDS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.175, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

#: Upper bounds (seconds) of the duration buckets; the last bucket is everything above.
DURATION_BOUNDS: Final = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


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

    def counts(self) -> dict[str, object]:
        """Every count, for a wire that carries figures whole (`of_counts` reads it back)."""
        return {
            "requests": self.requests,
            "failed": self.failed,
            "retried": self.retried,
            "retries": self.retries,
            "first_tokens": list(self.first_tokens),
            "durations": list(self.durations),
        }

    @classmethod
    def of_counts(cls, document: Mapping[str, Any]) -> Figures:
        """`counts()` back; ValueError when a count or a bucket list is not what it must be."""
        first_tokens = tuple(int(n) for n in document["first_tokens"])
        durations = tuple(int(n) for n in document["durations"])
        if (
            len(first_tokens) != len(FIRST_TOKEN_BOUNDS) + 1
            or len(durations) != len(DURATION_BOUNDS) + 1
        ):
            raise ValueError("the buckets are not this release's")
        return cls(
            int(document["requests"]),
            int(document["failed"]),
            int(document["retried"]),
            int(document["retries"]),
            first_tokens,
            durations,
        )
