"""The metrics of what the Edge turns away to protect itself, read at scrape time.

Failed authentications by listener and reason, attempts refused unheard because their address failed
too often, requests refused for holding too many in flight, hub connections refused for a cap (too
many nodes connected, or waiting for their hello), and streams stopped because their client read
too little. The counts live in the parts that count them (`http/clientguard.py`, `hub/nodehub.py`,
`hub/caps.py`, `authfailures.py`): nothing here runs on the request path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .http import ClientGuard
from .hub import Hub, NodeHub


class GuardCollector(Collector):
    """Counters of the guard of the OpenAI listener and of the node hub."""

    def __init__(self, guard: ClientGuard, hub: Hub) -> None:
        self._guard = guard
        self._hub = hub

    def collect(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "iop_edge_auth_failures",
            "Failed authentications, by listener (openai, nodes) and reason (missing, "
            "malformed, invalid; nodes: unknown_node, wrong_token, no_hello, hello_timeout).",
            labels=["listener", "reason"],
        )
        throttled = CounterMetricFamily(
            "iop_edge_auth_throttled",
            "Attempts turned away unheard because their address failed authentication too "
            "often, by listener.",
            labels=["listener"],
        )
        listeners = [("openai", self._guard.auth_failures)]
        hub = self._hub if isinstance(self._hub, NodeHub) else None
        if hub is not None:
            listeners.append(("nodes", hub.auth_failures))
        for listener, counts in listeners:
            for reason, count in sorted(counts.failures.items()):
                failures.add_metric([listener, reason], count)
            throttled.add_metric([listener], counts.throttled)
        in_flight = CounterMetricFamily(
            "iop_edge_client_requests_refused",
            "Requests refused with 429 because one client held openai.max_requests_per_client "
            "in flight, by what held them (address, principal).",
            labels=["bound"],
        )
        for bound, count in sorted(self._guard.refused.items()):
            in_flight.add_metric([bound], count)
        yield from (failures, throttled, in_flight)
        if hub is not None:
            crowded = CounterMetricFamily(
                "iop_edge_hub_hellos_refused",
                "Node hub connections refused at once because too many (overall or from their "
                "address) were waiting for their hello to be checked.",
            )
            crowded.add_metric([], hub.hellos_refused)
            capped = CounterMetricFamily(
                "iop_edge_hub_connections_refused",
                "Node hub connections refused for a cap, by reason: connections "
                "(edge.node_link.max_connections nodes were connected), unauthenticated "
                "(max_unauthenticated_connections waited for their hello), per_client "
                "(max_unauthenticated_per_client from their address waited).",
                labels=["reason"],
            )
            for reason, count in hub.cap_refusals.counts.items():
                capped.add_metric([reason], count)
            stalled = CounterMetricFamily(
                "iop_edge_streams_stalled",
                "Streams stopped (their runs cancelled, their slots freed) because their client "
                "read too little for openai.stream_stall_timeout_ms.",
            )
            stalled.add_metric([], hub.streams_stalled)
            paused = GaugeMetricFamily(
                "iop_edge_streams_paused",
                "Streams whose run waits now for its client to read (paused on its Node, or "
                "not pulled for a heartbeat interval on the Edge); each is stopped once it has "
                "waited openai.stream_stall_timeout_ms.",
            )
            paused.add_metric([], hub.streams_paused())
            yield from (crowded, capped, stalled, paused)
