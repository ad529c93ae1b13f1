"""The operator's own metrics and readiness, served on a port of their own."""

from __future__ import annotations

import time

import httpx

from iop.operator.metrics import EdgeConfigHealth, MetricsServer, OperatorMetrics
from iop.processes import free_port


def sample(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
    return float(line.rsplit(" ", 1)[1])


async def test_metrics_and_readiness() -> None:
    leading = {"now": False}
    ready = {"watching": False, "webhook": True}
    health = [EdgeConfigHealth("ns", "edge", time.time() - 30, time.monotonic() - 4)]
    metrics = OperatorMetrics(
        queue_depth=lambda: 2, leading=lambda: leading["now"], health=lambda: health
    )
    metrics.passes.labels("ok").inc()
    metrics.admissions.labels("refused").inc()
    port = free_port()
    server = MetricsServer(f"127.0.0.1:{port}", metrics, lambda: ready)
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            not_yet = await http.get("/readyz")
            assert (not_yet.status_code, not_yet.text) == (503, "not ready: watching\n")
            ready["watching"] = True
            assert (await http.get("/readyz")).status_code == 200

            text = (await http.get("/metrics")).text
            assert sample(text, 'iop_operator_reconcile_total{result="ok"}') == 1
            assert sample(text, 'iop_operator_webhook_admissions_total{outcome="refused"}') == 1
            assert sample(text, "iop_operator_queue_depth") == 2
            assert sample(text, "iop_operator_leader") == 0
            age = sample(
                text, 'iop_operator_applied_config_age_seconds{edgeconfig="edge",namespace="ns"}'
            )
            assert 30 <= age < 60
            since = sample(
                text, 'iop_operator_seconds_since_last_success{edgeconfig="edge",namespace="ns"}'
            )
            assert 4 <= since < 60
            leading["now"] = True
            assert sample((await http.get("/metrics")).text, "iop_operator_leader") == 1
    finally:
        await server.stop()
