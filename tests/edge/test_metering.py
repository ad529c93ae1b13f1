"""Metrics: usage by principal, token_ref, model and provider; pool gauges; no raw tokens."""

from __future__ import annotations

import pytest

from iop.edge.authenticating import Principal
from iop.edge.dispatching import Dispatcher
from iop.edge.metering import Metrics
from iop.edge.snapshots import PoolSnapshot

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
    dispatcher.release(lease)
    assert f'iop_edge_in_flight{{provider="{lease.provider_id}"}} 0.0' in metrics.render().decode()


def test_each_app_has_its_own_registry(config_of, provider) -> None:
    snapshot = PoolSnapshot.build(config_of([provider("a")]))
    one, two = Metrics(Dispatcher(snapshot)), Metrics(Dispatcher(snapshot))
    one.count_request(None, "m", "a", 200)
    assert 'status="200"' in one.render().decode()
    assert 'status="200"' not in two.render().decode()
