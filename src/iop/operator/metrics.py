"""The operator's own Prometheus metrics and its readiness, on a port of their own.

`GET /metrics` (docs/operator.md, "Metrics") says how the operator does: reconcile passes by
result and their duration, live applies on Edge replicas by outcome, workloads rolled, webhook
admissions by outcome, the passes queued, whether this replica leads, and per EdgeConfig the age
of the config in effect and the seconds since its last successful pass — the figure to alert on.
`GET /readyz` answers 200 once kopf watches and the webhook serves (a standby replica is ready
too: it serves the webhook and takes over when the leader goes).

Like the Edge's metrics, each `OperatorMetrics` owns its registry: no module globals.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp.web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from iop.aiokits import split_listener

logger = logging.getLogger(__name__)

_PASS_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class EdgeConfigHealth:
    """What one EdgeConfig's reconciler knows of its own health, for the gauges."""

    namespace: str
    name: str
    #: Unix time the config in effect was committed (0: none yet).
    applied_at: float
    #: Monotonic time of the last pass that ended without a failure (None: none yet).
    last_success: float | None


class OperatorMetrics:
    """Counters the operator's parts bump, and gauges read when scraped."""

    def __init__(
        self,
        *,
        queue_depth: Callable[[], int] = lambda: 0,
        leading: Callable[[], bool] = lambda: True,
        health: Callable[[], Iterable[EdgeConfigHealth]] = lambda: (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.passes = Counter(
            "iop_operator_reconcile_total",
            "Reconcile passes, by how they ended: ok, retry (something failed; backing off), "
            "invalid (the spec is refused), blocked (a token Secret is missing), api_error.",
            ["result"],
            registry=self.registry,
        )
        self.pass_seconds = Histogram(
            "iop_operator_reconcile_duration_seconds",
            "Wall time of a reconcile pass, API calls and live applies included.",
            buckets=_PASS_BUCKETS,
            registry=self.registry,
        )
        self.live_applies = Counter(
            "iop_operator_live_applies_total",
            "Live applies (POST /refresh) on Edge replicas, by outcome: Applied, Failed, "
            "Unreachable.",
            ["outcome"],
            registry=self.registry,
        )
        self.rollouts = Counter(
            "iop_operator_rollouts_total",
            "Workloads the operator stamped with a new config hash (which rolls them), by the "
            "restart scope: edge or node.",
            ["scope"],
            registry=self.registry,
        )
        self.admissions = Counter(
            "iop_operator_webhook_admissions_total",
            "Admission reviews of EdgeConfigs, by outcome: allowed, refused (an invalid spec), "
            "unowned (another EdgeConfig's, admitted with a warning).",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(_Gauges(queue_depth, leading, health))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges(Collector):
    """The gauges that are read, not bumped: computed at each scrape."""

    def __init__(
        self,
        queue_depth: Callable[[], int],
        leading: Callable[[], bool],
        health: Callable[[], Iterable[EdgeConfigHealth]],
    ) -> None:
        self._queue_depth = queue_depth
        self._leading = leading
        self._health = health

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "iop_operator_queue_depth",
            "EdgeConfigs whose next pass is due and waiting to run.",
            value=self._queue_depth(),
        )
        yield GaugeMetricFamily(
            "iop_operator_leader",
            "1 when this replica holds the leader Lease and reconciles; 0 on a standby.",
            value=1 if self._leading() else 0,
        )
        age = GaugeMetricFamily(
            "iop_operator_applied_config_age_seconds",
            "Seconds since the config in effect was committed (by the operator, live or with "
            "its restarts).",
            labels=["namespace", "edgeconfig"],
        )
        since = GaugeMetricFamily(
            "iop_operator_seconds_since_last_success",
            "Seconds since the EdgeConfig's last reconcile pass that ended without a failure "
            "(alert when it grows: the operator cannot do its job for it).",
            labels=["namespace", "edgeconfig"],
        )
        wall, monotonic = time.time(), time.monotonic()
        for item in self._health():
            if item.applied_at:
                age.add_metric([item.namespace, item.name], max(0.0, wall - item.applied_at))
            if item.last_success is not None:
                since.add_metric([item.namespace, item.name], monotonic - item.last_success)
        yield age
        yield since

    def describe(self) -> Iterable[Metric]:
        return []


class MetricsServer:
    """`GET /metrics` and `GET /readyz` on `listen` (plain HTTP, inside the cluster)."""

    def __init__(
        self, listen: str, metrics: OperatorMetrics, ready: Callable[[], Mapping[str, bool]]
    ) -> None:
        self._host, self._port = split_listener(listen)
        self._metrics = metrics
        self._ready = ready
        self._runner: aiohttp.web.AppRunner | None = None

    async def start(self) -> None:
        app = aiohttp.web.Application()
        app.add_routes(
            [
                aiohttp.web.get("/metrics", self._serve_metrics),
                aiohttp.web.get("/readyz", self._serve_ready),
            ]
        )
        self._runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, self._host, self._port).start()
        logger.info("metrics and readiness on %s:%d", self._host, self._port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _serve_metrics(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        response = aiohttp.web.Response(body=self._metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _serve_ready(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        parts = self._ready()
        waiting = sorted(name for name, ok in parts.items() if not ok)
        if waiting:
            return aiohttp.web.Response(status=503, text=f"not ready: {', '.join(waiting)}\n")
        return aiohttp.web.Response(text="ready\n")
