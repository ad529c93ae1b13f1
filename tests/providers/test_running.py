"""The runner: capacity and long slots across every Edge, and registry swaps with drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from iop.edgeconfig import node_payloads
from iop.processes import free_port
from iop.providers import Runner
from iop.wire import (
    ADAPTER_ERROR,
    PROBE_FAILED,
    RunDone,
    RunEvent,
    RunFailed,
    RunRequest,
    statuses,
)

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


async def test_a_stored_responses_lookup_takes_no_slot(runner: Runner, wire_config) -> None:
    runner.apply(payload(wire_config, capacity=1))
    assert not isinstance(runner.admit(request("a")), RunFailed)
    lookup = RunRequest("b", "p1", "", "response_retrieve", b"", False, response_id="resp_1")
    assert not isinstance(runner.admit(lookup), RunFailed)  # a busy server still answers it
    assert isinstance(runner.admit(request("c")), RunFailed)


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
    assert (health.healthy, health.reason, health.detail) == (False, ADAPTER_ERROR, UNKNOWN_TYPE)
    refused = runner.admit(request("b"))
    assert isinstance(refused, RunFailed) and refused.code == statuses.PROVIDER_UNHEALTHY
    assert refused.message == f"provider p1: {UNKNOWN_TYPE}"


#: What the runner says of a provider whose adapter `type` it does not know.
UNKNOWN_TYPE = (
    "invalid adapter settings: Input tag 'nope' found using 'type' does not match any of the "
    "expected tags: 'openai', 'fake'"
)


async def test_config_problems_are_what_this_node_cannot_run_not_a_server_that_is_down(
    runner: Runner, wire_config, until, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`config_problems` lists each provider that cannot run on this node (settings it cannot
    build, an API key variable unset or holding a line break in its environment), in the
    config's order; a provider whose server is down (a closed port) is not among them."""
    monkeypatch.delenv("IOP_TEST_UNSET_KEY", raising=False)
    monkeypatch.setenv("IOP_TEST_BROKEN_KEY", "sk-one\nsk-two")
    monkeypatch.setenv("IOP_TEST_GOOD_KEY", "sk-test")
    down = f"http://127.0.0.1:{free_port()}/v1"

    def openai(key: str | None = None) -> dict[str, Any]:
        return {"type": "openai", "base_url": down, "api_key_env": key}

    providers = [
        {"id": "p1", "adapter": {"type": "fake"}},
        {"id": "p2", "adapter": openai("IOP_TEST_UNSET_KEY")},
        {"id": "p3", "adapter": openai("IOP_TEST_BROKEN_KEY")},
        {"id": "p4", "adapter": openai()},
    ]
    config = node_payloads(wire_config(providers))["node-1"]
    unbuildable = config.providers[0].model_copy(update={"adapter": {"type": "nope"}})
    runner.apply(config.model_copy(update={"providers": (unbuildable, *config.providers[1:])}))
    assert runner.config_problems() == [
        ("p1", UNKNOWN_TYPE),
        ("p2", "environment variable IOP_TEST_UNSET_KEY is not set"),
        ("p3", "environment variable IOP_TEST_BROKEN_KEY holds a line break"),
    ]

    providers[1]["adapter"] = openai("IOP_TEST_GOOD_KEY")
    providers[2]["adapter"] = openai()
    runner.apply(node_payloads(wire_config(providers))["node-1"])
    assert runner.config_problems() == []
    # p4's server is down all along: its health says so, its config is fine.
    await until(lambda: runner.health(["p4"])[0].reason == PROBE_FAILED)
    assert runner.config_problems() == []


async def test_capacity_counts_runs_across_a_swap(runner: Runner, wire_config, until) -> None:
    runner.apply(payload(wire_config, capacity=1, adapter={"type": "fake", "latency_ms": 50}))
    admitted = runner.admit(request("a"))
    assert not isinstance(admitted, RunFailed)
    events: list[RunEvent] = []
    # The slot and the adapter are the run's from `admit`: the swap below finds them taken
    # whether or not the task has reached the adapter yet.
    running = asyncio.create_task(
        runner.execute(runner.run_events(request("a"), admitted), events.append)
    )
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
    running = asyncio.create_task(
        runner.execute(runner.run_events(request("a"), admitted), lambda e: None)
    )
    runner.apply(payload(wire_config, adapter={"type": "fake"}))
    await until(lambda: runner.drain_reports)
    assert runner.drain_reports[-1].cut_runs == 1
    running.cancel()
    await asyncio.wait([running])
    await runner.aclose()


async def test_a_run_cancelled_before_its_first_step_frees_its_slot(
    runner: Runner, wire_config
) -> None:
    """Seen: a Node's link ended just after a run came; its task, cancelled before it ran,
    never freed the slot `admit` took, and the Node's drain waited its whole timeout for it."""
    runner.apply(payload(wire_config, capacity=1, adapter={"type": "fake"}))
    admitted = runner.admit(request("a"))
    assert not isinstance(admitted, RunFailed)
    events = runner.run_events(request("a"), admitted)
    task = asyncio.create_task(runner.execute(events, lambda e: None))
    task.add_done_callback(lambda _: events.abandon())  # as the Node's link does
    task.cancel()  # before its first step: `execute` never runs
    await asyncio.wait([task])
    assert task.cancelled()
    assert runner.running == 0
    assert not isinstance(runner.admit(request("b")), RunFailed), "the slot is free again"


async def test_abandoning_a_run_that_ended_frees_nothing_twice(runner: Runner, wire_config) -> None:
    runner.apply(payload(wire_config, capacity=2, adapter={"type": "fake"}))
    admitted = runner.admit(request("a"))
    assert not isinstance(admitted, RunFailed)
    other = runner.admit(request("b"))
    assert not isinstance(other, RunFailed)
    events = runner.run_events(request("a"), admitted)
    await runner.execute(events, lambda e: None)
    events.abandon()
    assert runner.running == 1, "only the run that ended gave its slot back"
