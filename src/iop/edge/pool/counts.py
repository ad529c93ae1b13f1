"""What every request counts for the Edge's metrics, kept as plain numbers until a scrape.

`Counts` holds, per label set, the requests by status, the tokens used and the latency
histograms that `Metrics` (`metering.py`) bumps once or a few times per request: a dict lookup
and an addition each, as `outcomes.py` keeps its tally. `CountsCollector` turns them into the
same families and samples the client library's `Counter` and `Histogram` would export, when
Prometheus scrapes; those take a lock and check their labels at every bump.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: The labels of usage and of requests (with `status`).
USAGE_LABELS: Final = ("principal_ref", "token_ref", "model", "provider")
#: Queue waits and first tokens: from well under a millisecond to a long queue timeout.
LATENCY_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Latencies:
    """One label set's observations: a count per bucket (not cumulative), their sum."""

    __slots__ = ("counts", "created", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds


#: The `le` label of each bucket, as Prometheus spells it.
_BUCKET_LABELS: Final = (*map(floatToGoString, LATENCY_BUCKETS), "+Inf")


class Counts:
    """What each request counts, as plain numbers keyed by their labels; the `created` time of
    each label set is kept beside its value, as the client library's own counters export it."""

    __slots__ = ("durations", "first_tokens", "queue_waits", "requests", "usage")

    def __init__(self) -> None:
        #: (principal_ref, token_ref, model, provider, status) -> [requests, created].
        self.requests: dict[tuple[str, str, str, str, str], list[float]] = {}
        #: (principal_ref, token_ref, model, provider) -> [prompt, completion, total, created].
        self.usage: dict[tuple[str, str, str, str], list[float]] = {}
        self.queue_waits: dict[tuple[str, str], Latencies] = {}
        self.first_tokens: dict[tuple[str], Latencies] = {}
        self.durations: dict[tuple[str], Latencies] = {}


class CountsCollector(Collector):
    """`Counts` as Prometheus families, made when Prometheus scrapes."""

    def __init__(self, counts: Counts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts
        requests = CounterMetricFamily(
            "iop_edge_requests",
            "Requests answered, by outcome (HTTP status).",
            labels=[*USAGE_LABELS, "status"],
        )
        for status_key, (value, created) in counts.requests.items():
            requests.add_metric(status_key, value, created=created)
        yield requests
        usage = [
            CounterMetricFamily(
                "iop_edge_prompt_tokens",
                "Prompt tokens, as the provider reported them (the Edge's estimate of the input "
                "for a stream whose client left before its usage came).",
                labels=USAGE_LABELS,
            ),
            CounterMetricFamily(
                "iop_edge_completion_tokens",
                "Completion tokens, as the provider reported them (the events delivered, one "
                "token each, for a stream whose client left before its usage came).",
                labels=USAGE_LABELS,
            ),
            CounterMetricFamily(
                "iop_edge_total_tokens",
                "Total tokens, as the provider reported them (or counted at the Edge, as above).",
                labels=USAGE_LABELS,
            ),
        ]
        for key, values in counts.usage.items():
            for family, value in zip(usage, values[:3], strict=True):
                family.add_metric(key, value, created=values[3])
        yield from usage
        yield _histogram(
            "iop_edge_queue_wait_seconds",
            "Time a dispatched request waited for a free provider.",
            ("model", "principal_ref"),
            counts.queue_waits,
        )
        yield _histogram(
            "iop_edge_time_to_first_token_seconds",
            "Time from a request's arrival to its first response bytes (first chunk or body).",
            ("model",),
            counts.first_tokens,
        )
        yield _histogram(
            "iop_edge_request_duration_seconds",
            "Time from a completion request's arrival to the end of its answer, any outcome.",
            ("model",),
            counts.durations,
        )


def _histogram(
    name: str,
    documentation: str,
    labels: tuple[str, ...],
    histograms: dict[tuple[str, str], Latencies] | dict[tuple[str], Latencies],
) -> Metric:
    """A histogram family with the samples the client library's `Histogram` exports."""
    family = Metric(name, documentation, "histogram")
    for key, histogram in histograms.items():
        values = dict(zip(labels, key, strict=True))
        running = 0
        for bound, count in zip(_BUCKET_LABELS, histogram.counts, strict=True):
            running += count
            family.add_sample(f"{name}_bucket", {**values, "le": bound}, running)
        family.add_sample(f"{name}_count", values, running)
        family.add_sample(f"{name}_sum", values, histogram.sum)
        family.add_sample(f"{name}_created", values, histogram.created)
    return family
