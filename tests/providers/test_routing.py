"""The router: capacity and long slots across every Edge, and registry swaps with drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from iop.edgeconfig import node_payloads
from iop.providers import Router
from iop.wire import RunDone, RunEvent, RunFailed, RunRequest, statuses

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

BODY = b'{"model": "served", "messages": [{"role": "user", "content": "hi"}]}'


def request(run_id: str, *, long: bool = False) -> RunRequest:
    return RunRequest(run_id, "p1", "served", "chat", BODY, False, None, long)


@pytest.fixture
async def router():
    router = Router(drain_timeout=0.1)
    yield router
    await router.aclose()


def payload(wire_config, **provider):
    config = wire_config([{"id": "p1", "adapter": {"type": "fake"}, **provider}])
    return node_payloads(config)["node-1"]


async def test_capacity_refuses_with_provider_busy(router: Router, wire_config) -> None:
    router.apply(payload(wire_config, capacity=2))
    first, second = router.admit(request("a")), router.admit(request("b"))
    refused = router.admit(request("c"))
    assert isinstance(refused, RunFailed)
    assert (refused.code, refused.retryable) == (statuses.PROVIDER_BUSY, True)
    assert not isinstance(first, RunFailed)
    router.release(request("a"), first)
    assert not isinstance(router.admit(request("c")), RunFailed)
    assert router.in_flight() == {"p1": 2}
    assert not isinstance(second, RunFailed)


async def test_long_runs_also_need_a_long_slot(router: Router, wire_config) -> None:
    router.apply(payload(wire_config, capacity=4, long_context_slots=1))
    assert not isinstance(router.admit(request("a", long=True)), RunFailed)
    refused = router.admit(request("b", long=True))
    assert isinstance(refused, RunFailed) and "long-context slot" in refused.message
    assert not isinstance(router.admit(request("c")), RunFailed)


async def test_unknown_providers_and_bad_adapters_are_named(router: Router, wire_config) -> None:
    refused = router.admit(request("a"))
    assert isinstance(refused, RunFailed) and refused.code == statuses.UNKNOWN_PROVIDER
    bad = payload(wire_config)
    broken = bad.model_copy(
        update={"providers": (bad.providers[0].model_copy(update={"adapter": {"type": "nope"}}),)}
    )
    router.apply(broken)
    (health,) = router.health()
    assert not health.healthy and "provider p1: invalid adapter settings" in health.detail
    refused = router.admit(request("b"))
    assert isinstance(refused, RunFailed) and refused.code == statuses.PROVIDER_UNHEALTHY


async def test_capacity_counts_runs_across_a_swap(router: Router, wire_config, until) -> None:
    router.apply(payload(wire_config, capacity=1, adapter={"type": "fake", "latency_ms": 50}))
    admitted = router.admit(request("a"))
    assert not isinstance(admitted, RunFailed)
    events: list[RunEvent] = []
    # The slot and the adapter are the run's from `admit`: the swap below finds them taken
    # whether or not the task has reached the adapter yet.
    running = asyncio.create_task(router.execute(request("a"), admitted, events.append))
    router.apply(payload(wire_config, capacity=1, adapter={"type": "fake"}))
    assert isinstance(router.admit(request("b")), RunFailed)  # the old run still holds the slot
    old_adapter: Any = admitted.adapter
    assert not old_adapter.closed
    await running
    assert isinstance(events[-1], RunDone)
    await until(lambda: old_adapter.closed)
    await until(lambda: router.drain_reports)
    assert router.drain_reports[-1].cut_runs == 0


async def test_a_drain_that_times_out_is_reported(wire_config, until) -> None:
    router = Router(drain_timeout=0.05)
    router.apply(payload(wire_config, adapter={"type": "fake", "latency_ms": 5000}))
    admitted = router.admit(request("a"))
    assert not isinstance(admitted, RunFailed)
    running = asyncio.create_task(router.execute(request("a"), admitted, lambda e: None))
    router.apply(payload(wire_config, adapter={"type": "fake"}))
    await until(lambda: router.drain_reports)
    assert router.drain_reports[-1].cut_runs == 1
    running.cancel()
    await asyncio.wait([running])
    await router.aclose()
