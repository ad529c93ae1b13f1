"""The runner: capacity and long slots across every Edge, and registry swaps with drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from iop.edgeconfig import node_payloads
from iop.providers import Runner
from iop.wire import RunDone, RunEvent, RunFailed, RunRequest, statuses

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

BODY = b'{"model": "served", "messages": [{"role": "user", "content": "hi"}]}'


def request(run_id: str, *, long: bool = False) -> RunRequest:
    return RunRequest(run_id, "p1", "served", "chat", BODY, False, None, long)


@pytest.fixture
async def runner():
    runner = Runner(drain_timeout=0.1)
    yield runner
    await runner.aclose()


def payload(wire_config, **provider):
    config = wire_config([{"id": "p1", "adapter": {"type": "fake"}, **provider}])
    return node_payloads(config)["node-1"]


async def test_capacity_refuses_with_provider_busy(runner: Runner, wire_config) -> None:
    runner.apply(payload(wire_config, capacity=2))
    first, second = runner.admit(request("a")), runner.admit(request("b"))
    refused = runner.admit(request("c"))
    assert isinstance(refused, RunFailed)
    assert (refused.code, refused.retryable) == (statuses.PROVIDER_BUSY, True)
    assert not isinstance(first, RunFailed)
    runner.release(request("a"), first)
    assert not isinstance(runner.admit(request("c")), RunFailed)
    assert runner.in_flight() == {"p1": 2}
    assert not isinstance(second, RunFailed)


async def test_long_runs_also_need_a_long_slot(runner: Runner, wire_config) -> None:
    runner.apply(payload(wire_config, capacity=4, long_context_slots=1))
    assert not isinstance(runner.admit(request("a", long=True)), RunFailed)
    refused = runner.admit(request("b", long=True))
    assert isinstance(refused, RunFailed) and "long-context slot" in refused.message
    assert not isinstance(runner.admit(request("c")), RunFailed)


async def test_unknown_providers_and_bad_adapters_are_named(runner: Runner, wire_config) -> None:
    refused = runner.admit(request("a"))
    assert isinstance(refused, RunFailed) and refused.code == statuses.UNKNOWN_PROVIDER
    bad = payload(wire_config)
    broken = bad.model_copy(
        update={"providers": (bad.providers[0].model_copy(update={"adapter": {"type": "nope"}}),)}
    )
    runner.apply(broken)
    (health,) = runner.health()
    assert not health.healthy and "provider p1: invalid adapter settings" in health.detail
    refused = runner.admit(request("b"))
    assert isinstance(refused, RunFailed) and refused.code == statuses.PROVIDER_UNHEALTHY


async def test_capacity_counts_runs_across_a_swap(runner: Runner, wire_config, until) -> None:
    runner.apply(payload(wire_config, capacity=1, adapter={"type": "fake", "latency_ms": 50}))
    admitted = runner.admit(request("a"))
    assert not isinstance(admitted, RunFailed)
    events: list[RunEvent] = []
    # The slot and the adapter are the run's from `admit`: the swap below finds them taken
    # whether or not the task has reached the adapter yet.
    running = asyncio.create_task(runner.execute(request("a"), admitted, events.append))
    runner.apply(payload(wire_config, capacity=1, adapter={"type": "fake"}))
    assert isinstance(runner.admit(request("b")), RunFailed)  # the old run still holds the slot
    old_adapter: Any = admitted.adapter
    assert not old_adapter.closed
    await running
    assert isinstance(events[-1], RunDone)
    await until(lambda: old_adapter.closed)
    await until(lambda: runner.drain_reports)
    assert runner.drain_reports[-1].cut_runs == 0


async def test_a_drain_that_times_out_is_reported(wire_config, until) -> None:
    runner = Runner(drain_timeout=0.05)
    runner.apply(payload(wire_config, adapter={"type": "fake", "latency_ms": 5000}))
    admitted = runner.admit(request("a"))
    assert not isinstance(admitted, RunFailed)
    running = asyncio.create_task(runner.execute(request("a"), admitted, lambda e: None))
    runner.apply(payload(wire_config, adapter={"type": "fake"}))
    await until(lambda: runner.drain_reports)
    assert runner.drain_reports[-1].cut_runs == 1
    running.cancel()
    await asyncio.wait([running])
    await runner.aclose()
