"""Metrics: usage by principal, token_ref, model and provider; pool gauges; no raw tokens."""

from __future__ import annotations

import pytest

from iop.edge.authenticating import Principal
from iop.edge.pool.dispatching import Dispatcher
from iop.edge.pool.metering import Metrics
from iop.edge.pool.snapshots import PoolSnapshot

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


async def test_usage_and_pool_gauges_are_exposed(config_of, provider) -> None:
    dispatcher = Dispatcher(PoolSnapshot.build(config_of([provider("a"), provider("b")])))
    dispatcher.set_available({"a", "b"})
    metrics = Metrics(dispatcher)
    principal = Principal("team-search", "search-chat")
    lease = await dispatcher.acquire("m", True)
    metrics.count_usage(principal, "m", lease.provider_id, 5, 3, 8)
    metrics.count_usage(principal, "m", lease.provider_id, 1, 1, 2)
    metrics.count_request(principal, "m", lease.provider_id, 200)
    metrics.count_request(None, "", "", 401)
    metrics.observe_queue_wait("m", "team-search", 0.002)
    metrics.observe_first_token("m", 0.01)
    metrics.observe_duration("m", 0.05)
    metrics.count_refresh("apply", "applied")
    metrics.count_refresh("apply", "restart_required")
    text = metrics.render().decode()
    labels = f'principal_ref="team-search",provider="{lease.provider_id}",token_ref="search-chat"'
    assert f'iop_edge_prompt_tokens_total{{model="m",{labels}}} 6.0' in text
    assert f'iop_edge_completion_tokens_total{{model="m",{labels}}} 4.0' in text
    assert f'iop_edge_total_tokens_total{{model="m",{labels}}} 10.0' in text
    assert 'status="401"' in text
    assert f'iop_edge_in_flight{{provider="{lease.provider_id}"}} 1.0' in text
    assert f'iop_edge_long_in_flight{{provider="{lease.provider_id}"}} 1.0' in text
    assert 'iop_edge_queue_depth{model="m"} 0.0' in text
    assert 'iop_edge_queue_wait_seconds_count{model="m",principal_ref="team-search"} 1.0' in text
    assert 'iop_edge_time_to_first_token_seconds_count{model="m"} 1.0' in text
    assert 'iop_edge_request_duration_seconds_count{model="m"} 1.0' in text
    assert 'iop_edge_refreshes_total{mode="apply",outcome="applied"} 1.0' in text
    assert 'iop_edge_refreshes_total{mode="apply",outcome="restart_required"} 1.0' in text
    dispatcher.release(lease)
    assert f'iop_edge_in_flight{{provider="{lease.provider_id}"}} 0.0' in metrics.render().decode()


def test_each_app_has_its_own_registry(config_of, provider) -> None:
    snapshot = PoolSnapshot.build(config_of([provider("a")]))
    one, two = Metrics(Dispatcher(snapshot)), Metrics(Dispatcher(snapshot))
    one.count_request(None, "m", "a", 200)
    assert 'status="200"' in one.render().decode()
    assert 'status="200"' not in two.render().decode()


async def test_dispatch_choices_and_provider_loads_are_exposed(config_of, provider) -> None:
    config = config_of(
        [provider("a"), provider("b")],
        {"m": ["a", "b"], "n": ["a", "b"]},
        model_settings={"n": {"dispatch": {"policy": "least_load"}}},
    )
    dispatcher = Dispatcher(PoolSnapshot.build(config))
    dispatcher.set_available({"a", "b"})
    metrics = Metrics(dispatcher)
    leases = [await dispatcher.acquire("m", False) for _ in range(2)]
    leases.append(await dispatcher.acquire("n", False))
    text = metrics.render().decode()
    assert "# TYPE iop_edge_dispatch_total counter" in text
    assert (
        'iop_edge_dispatch_total{model="m",policy="round_robin",reason="round_robin"} 2.0' in text
    )
    assert 'iop_edge_dispatch_total{model="n",policy="least_load",reason="least_load"} 1.0' in text
    assert 'iop_edge_provider_load{provider="a"} ' in text
    loads = sorted(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("iop_edge_provider_load{")
    )
    assert loads == [1.0, 2.0]
    for lease in leases:
        dispatcher.release(lease)
