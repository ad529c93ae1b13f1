"""Refresh on the Node: a payload that keeps the adapters (limits, enabled, served models) swaps
the registry without restarting them, and the runs in flight stay counted where they run."""

from __future__ import annotations

import asyncio

import pytest

from iop.edgeconfig import node_payloads
from iop.providers import Runner
from iop.wire import RunDone, RunEvent, RunFailed, RunRequest

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

BODY = b'{"model": "served", "messages": [{"role": "user", "content": "hi"}]}'
SLOW = {"type": "fake", "latency_ms": 100}


def request(run_id: str) -> RunRequest:
    return RunRequest(run_id, "p1", "served", "chat", BODY, False, None, False)


def payload(wire_config, **provider):
    config = wire_config([{"id": "p1", "adapter": SLOW, **provider}])
    return node_payloads(config)["node-1"]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"capacity": 1}, id="capacity-lowered-below-in-flight"),
        pytest.param({"capacity": 5}, id="capacity-raised"),
        pytest.param({"enabled": False}, id="disabled"),
        pytest.param({"served_models": ["served", "other"]}, id="served-models"),
        pytest.param({"long_context_slots": 1}, id="long-slots"),
    ],
)
async def test_a_swap_that_keeps_the_adapter_keeps_counting_its_runs(wire_config, change) -> None:
    runner = Runner(drain_timeout=30)
    runner.apply(payload(wire_config, capacity=2))
    adapter = runner.registry.provisions["p1"].adapter
    runs: list[asyncio.Task[None]] = []
    events: list[RunEvent] = []
    for run_id in ("a", "b"):
        admitted = runner.admit(request(run_id))
        assert not isinstance(admitted, RunFailed)
        runs.append(
            asyncio.create_task(
                runner.execute(runner.run_events(request(run_id), admitted), events.append)
            )
        )

    assert runner.apply(payload(wire_config, **{"capacity": 2, **change}))
    provision = runner.registry.provisions["p1"]
    assert provision.adapter is adapter  # not restarted
    assert provision.active == 2
    await asyncio.gather(*runs)
    assert [type(e) for e in events if isinstance(e, RunDone)] == [RunDone, RunDone]
    assert provision.active == 0 and runner.in_flight() == {}
    # Nothing is left to drain: closing does not wait out the drain timeout.
    await asyncio.wait_for(runner.aclose(), 5)
    assert runner.drain_reports[-1].cut_runs == 0


async def test_capacity_lowered_below_in_flight_refuses_new_runs_until_under(wire_config) -> None:
    runner = Runner(drain_timeout=1)
    runner.apply(payload(wire_config, capacity=2))
    held = [runner.admit(request(run_id)) for run_id in ("a", "b")]
    runner.apply(payload(wire_config, capacity=1))
    assert isinstance(runner.admit(request("c")), RunFailed)
    for run_id, provision in zip(("a", "b"), held, strict=True):
        assert not isinstance(provision, RunFailed)
        runner.release(request(run_id), provision)
        refused = runner.admit(request("c"))
        if run_id == "a":
            assert isinstance(refused, RunFailed)  # 1 in flight, capacity 1
        else:
            assert not isinstance(refused, RunFailed)
            runner.release(request("c"), refused)
    await runner.aclose()
