"""Usage metering and the Edge's Prometheus metrics, in a registry owned by one app.

`Metrics` counts per request (outcomes, tokens by `principal_ref`, `token_ref`, `model` and
`provider`, retries, refused retries, fallbacks; queue waits and time to first token), the
per-request ones as plain numbers (`counts.py`), and reads the rest at scrape time from the
dispatcher and the node hub. Raw bearer tokens never reach a label: the principal is a
`Principal` already. The metrics name every principal and token ref, so `MetricsApp`
(`http/metricsapp.py`) serves them on a listener of their own (`edge.metrics.listen`), never on
the public one. docs/edge.md, "Auth and metering", lists every metric and says how they are kept.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from ..authenticating import Principal
from ..hub import Hub, provider_health
from .counts import Counts, CountsCollector, Latencies
from .dispatching import Dispatcher
from .outcomes import OutcomeCollector, OutcomeTally
from .priorities import WAIT_BUCKETS
from .splits import STABLE, Side

#: The Content-Type of the Prometheus text exposition served at /metrics.
CONTENT_TYPE: Final = CONTENT_TYPE_LATEST


class _PoolCollector(Collector):
    """Gauges read from the dispatcher when Prometheus scrapes."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "iop_edge_in_flight", "Runs in flight per provider, on this Edge.", labels=["provider"]
        )
        long_in_flight = GaugeMetricFamily(
            "iop_edge_long_in_flight",
            "Long-context runs in flight per provider, on this Edge.",
            labels=["provider"],
        )
        for provider_id, (runs, long_runs) in sorted(self._dispatcher.in_flight_counts().items()):
            in_flight.add_metric([provider_id], runs)
            long_in_flight.add_metric([provider_id], long_runs)
        depth = GaugeMetricFamily(
            "iop_edge_queue_depth", "Requests waiting for a free provider.", labels=["model"]
        )
        for model_id, waiting in sorted(self._dispatcher.queue_depths().items()):
            depth.add_metric([model_id], waiting)
        by_principal = GaugeMetricFamily(
            "iop_edge_queue_depth_by_principal",
            "Requests waiting for a free provider, per model and principal (fair share).",
            labels=["model", "principal_ref"],
        )
        for (model_id, principal), waiting in sorted(
            self._dispatcher.queue_depths_by_principal().items()
        ):
            by_principal.add_metric([model_id, principal], waiting)
        generation = GaugeMetricFamily(
            "iop_edge_config_generation", "Config snapshots swapped in since the Edge started."
        )
        generation.add_metric([], self._dispatcher.snapshot.generation)
        decisions = CounterMetricFamily(
            "iop_edge_dispatch",
            "Dispatch choices among a model's best free providers, by model, policy "
            "(models[].dispatch.policy) and reason: round_robin, least_load, affinity (the "
            "prompt's prefix went home), overflow (its home was past its bound or full), "
            "freed_slot (a waiting request took the slot that freed first), freed_slot_home "
            "(a waiting request took a freed slot where its prefix is cached, ahead of the "
            'queue\'s head), and others (docs/edge.md, "Dispatch").',
            labels=["model", "policy", "reason"],
        )
        for (model_id, policy, reason), count in sorted(self._dispatcher.decisions().items()):
            decisions.add_metric([model_id, policy, reason], count)
        load = GaugeMetricFamily(
            "iop_edge_provider_load",
            "A provider's load as least_load reads it: this Edge's runs on it, plus its Node's "
            "runs from other Edges, plus its server's requests from other clients.",
            labels=["provider"],
        )
        for provider_id in sorted(self._dispatcher.snapshot.providers):
            load.add_metric([provider_id], self._dispatcher.load(provider_id))
        snapshot = self._dispatcher.snapshot
        capacity = GaugeMetricFamily(
            "iop_edge_provider_capacity",
            "Most runs this Edge sends a provider at once: its capacity, or this replica's "
            "share of it for a node placed on the Edge.",
            labels=["provider"],
        )
        for provider_id, limits in sorted(snapshot.providers.items()):
            capacity.add_metric([provider_id], limits.capacity)
        replicas = GaugeMetricFamily(
            "iop_edge_replicas",
            "The Edge replicas this one counts (its peers Service) to share the capacity of "
            "the nodes placed on the Edge; 1 without a peers Service.",
        )
        replicas.add_metric([], snapshot.edge_replicas)
        yield from (in_flight, long_in_flight, depth, by_principal, generation, decisions, load)
        yield from (capacity, replicas)


class _NodeCollector(Collector):
    """Provider health and node drains, read from the hub when Prometheus scrapes."""

    def __init__(self, dispatcher: Dispatcher, hub: Hub) -> None:
        self._dispatcher = dispatcher
        self._hub = hub

    def collect(self) -> Iterator[Metric]:
        providers = self._dispatcher.snapshot.providers
        healthy = GaugeMetricFamily(
            "iop_edge_provider_healthy",
            "1 when the provider's node is connected and reports it healthy, else 0.",
            labels=["provider", "node"],
        )
        reasons = GaugeMetricFamily(
            "iop_edge_provider_unhealthy_reason",
            "1 for an unhealthy provider, labelled with why (probe_failed, request_failures, "
            "draining, adapter_error, not_probed, node_disconnected, ...); absent when healthy.",
            labels=["provider", "node", "reason"],
        )
        nodes_of = {pid: limits.node_id for pid, limits in providers.items()}
        for pid, link in provider_health(nodes_of, self._hub.connected_providers()).items():
            healthy.add_metric([pid, link.node_id], 1.0 if link.healthy else 0.0)
            if not link.healthy:
                reasons.add_metric([pid, link.node_id, link.reason], 1.0)
        draining = GaugeMetricFamily(
            "iop_edge_node_draining",
            "1 while a connected node drains (a swap's replaced adapters, its shutdown, or an "
            "older process of it finishing its runs), else 0.",
            labels=["node"],
        )
        runs_left = GaugeMetricFamily(
            "iop_edge_node_draining_runs",
            "Runs a draining node still has to finish, per provider (0 once they all ended).",
            labels=["node", "provider"],
        )
        for node_id, status in sorted(self._hub.nodes().items()):
            draining.add_metric([node_id], 1.0 if status.draining else 0.0)
            if status.draining:
                left = status.draining_runs()
                mine = {pid for pid, node in nodes_of.items() if node == node_id}
                for pid in sorted(mine | left.keys()):
                    runs_left.add_metric([node_id, pid], left.get(pid, 0))
        yield from (healthy, reasons, draining, runs_left)


class _ClassCollector(Collector):
    """What each priority class's requests came to (`priorities.py`), read from the dispatcher
    when Prometheus scrapes."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    def collect(self) -> Iterator[Metric]:
        tally = self._dispatcher.classes
        admitted = CounterMetricFamily(
            "iop_edge_class_admitted",
            "Requests given a slot, at once or after waiting, by priority class.",
            labels=["class"],
        )
        for name, count in sorted(tally.admitted.items()):
            admitted.add_metric([name], count)
        queued = CounterMetricFamily(
            "iop_edge_class_queued",
            "Requests that waited in a model's queue, by priority class.",
            labels=["class"],
        )
        for name, count in sorted(tally.queued.items()):
            queued.add_metric([name], count)
        came_back = CounterMetricFamily(
            "iop_edge_class_came_back",
            "Shed requests that came back when their 429's Retry-After said and were queued "
            "though the model was still saturated, by priority class.",
            labels=["class"],
        )
        for name, count in sorted(tally.came_back.items()):
            came_back.add_metric([name], count)
        shed = CounterMetricFamily(
            "iop_edge_class_shed",
            "Requests that got no slot, by priority class and reason: saturated (sheddable, "
            "refused at admission), displaced (gave its place in a full queue to a higher "
            "class), queue_full, class_wait and request_wait (the class's or the request's wait "
            "bound ran out), queue_timeout (the providers' queue_timeout_ms ran out).",
            labels=["class", "reason"],
        )
        for (name, reason), count in sorted(tally.shed.items()):
            shed.add_metric([name, reason], count)
        waits = HistogramMetricFamily(
            "iop_edge_class_queue_wait_seconds",
            "Time a request that waited spent in the queue before its slot, by priority class.",
            labels=["class"],
        )
        for name, histogram in sorted(tally.waits.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*WAIT_BUCKETS, math.inf), histogram.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
            waits.add_metric([name], buckets, histogram.total)
        depth = GaugeMetricFamily(
            "iop_edge_class_queue_depth",
            "Requests waiting for a free provider, per model and priority class.",
            labels=["model", "class"],
        )
        for (model_id, name), waiting in sorted(self._dispatcher.queue_depths_by_class().items()):
            depth.add_metric([model_id, name], waiting)
        saturated = GaugeMetricFamily(
            "iop_edge_model_saturated",
            "1 while a sheddable request for the model would be shed (no candidate with room, "
            "by openai.priority.saturation), else 0.",
            labels=["model"],
        )
        for model_id in sorted(self._dispatcher.snapshot.models):
            saturated.add_metric([model_id], 1.0 if self._dispatcher.saturated(model_id) else 0.0)
        yield from (admitted, queued, came_back, shed, waits, depth, saturated)


class Metrics:
    """The Edge's metrics; `render()` is the /metrics body. Without a `hub` (an app tested
    alone) there are no provider health or node drain metrics."""

    def __init__(self, dispatcher: Dispatcher, hub: Hub | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        #: The same requests, counted per model for judging a config change (`outcomes.py`).
        self.outcomes = OutcomeTally()
        self._counts = Counts()
        self.registry.register(CountsCollector(self._counts))
        self._refreshes = Counter(
            "iop_edge_refreshes",
            "Refreshes (admin API, SIGHUP) by mode and outcome: applied, valid, "
            "restart_required, invalid.",
            ["mode", "outcome"],
            registry=self.registry,
        )
        self._retries = Counter(
            "iop_edge_retries",
            "Tries after a failure before the first byte (or a provider_busy refusal), by the "
            "model the client asked for and the failure's code.",
            ["model", "reason"],
            registry=self.registry,
        )
        self._retries_refused = Counter(
            "iop_edge_retries_refused",
            "Retries the retry budget refused (the failure was the answer), by the model the "
            "client asked for and the failure's code.",
            ["model", "reason"],
            registry=self.registry,
        )
        self._fallbacks = Counter(
            "iop_edge_fallbacks",
            "Requests handed to a fallback model, by the model asked for, the fallback, and "
            "why: unavailable (no provider of the model in dispatch) or failed (its providers "
            "failed before the first byte).",
            ["model", "fallback", "reason"],
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(dispatcher))
        self.registry.register(_ClassCollector(dispatcher))
        self.registry.register(OutcomeCollector(self.outcomes))
        if hub is not None:
            self.registry.register(_NodeCollector(dispatcher, hub))

    def count_request(
        self,
        principal: Principal | None,
        model: str,
        provider: str,
        status: int,
        side: Side = STABLE,
        retries: int = 0,
    ) -> None:
        """One ended request; empty labels for what was not known (auth failed, no model).
        `side` and `retries` (its tries retried after a failure) are for the tally."""
        key = (
            principal.principal_ref if principal else "",
            principal.token_ref if principal else "",
            model,
            provider,
            str(status),
        )
        counted = self._counts.requests.get(key)
        if counted is None:
            self._counts.requests[key] = [1, time.time()]
        else:
            counted[0] += 1
        self.outcomes.request(model, status, bool(provider), side, retries)

    def count_usage(
        self,
        principal: Principal,
        model: str,
        provider: str,
        prompt_tokens: int,
        completion_tokens: int,
        total_tokens: int,
    ) -> None:
        key = (principal.principal_ref, principal.token_ref, model, provider)
        counted = self._counts.usage.get(key)
        if counted is None:
            self._counts.usage[key] = [prompt_tokens, completion_tokens, total_tokens, time.time()]
        else:
            counted[0] += prompt_tokens
            counted[1] += completion_tokens
            counted[2] += total_tokens

    def observe_queue_wait(self, model: str, principal_ref: str, seconds: float) -> None:
        key = (model, principal_ref)
        histogram = self._counts.queue_waits.get(key)
        if histogram is None:
            histogram = self._counts.queue_waits[key] = Latencies()
        histogram.observe(seconds)

    def observe_first_token(self, model: str, seconds: float, side: Side = STABLE) -> None:
        key = (model,)
        histogram = self._counts.first_tokens.get(key)
        if histogram is None:
            histogram = self._counts.first_tokens[key] = Latencies()
        histogram.observe(seconds)
        self.outcomes.first_token(model, seconds, side)

    def observe_duration(self, model: str, seconds: float, side: Side = STABLE) -> None:
        key = (model,)
        histogram = self._counts.durations.get(key)
        if histogram is None:
            histogram = self._counts.durations[key] = Latencies()
        histogram.observe(seconds)
        self.outcomes.duration(model, seconds, side)

    def count_refresh(self, mode: str, outcome: str) -> None:
        """One refresh report: the dashboard's view of what the operator's applies did here."""
        self._refreshes.labels(mode, outcome).inc()

    def count_retry(self, model: str, reason: str) -> None:
        """A try retried now (the tally counts it with its request, at its end)."""
        self._retries.labels(model, reason).inc()

    def count_retry_refused(self, model: str, reason: str) -> None:
        self._retries_refused.labels(model, reason).inc()

    def count_fallback(self, model: str, fallback: str, reason: str) -> None:
        self._fallbacks.labels(model, fallback, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
