"""Drain progress on the Node: a swap's drain and the shutdown drain report the runs each provider
has left when they start and whenever one of those runs ends, reaching zero exactly when the last
one does; the log says how far along they are."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from iop.edgeconfig import node_payloads
from iop.providers import Runner
from iop.wire import DrainProgress, RunDone, RunEvent, RunFailed, RunRequest

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

#: 20 tokens a second: a run of n tokens streams for about n / 20 s.
SLOW = {"type": "fake", "tokens_per_second": 20, "completion_tokens": 40}


def payload(wire_config: Any, adapter: dict[str, Any], pid: str = "p1") -> Any:
    return node_payloads(wire_config([{"id": pid, "adapter": adapter}]))["node-1"]


def request(run_id: str, tokens: int, pid: str = "p1") -> RunRequest:
    body: dict[str, Any] = {"model": "served", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"max_tokens": tokens, "stream": True}
    return RunRequest(run_id, pid, "served", "chat", orjson.dumps(body), True)


class Progress:
    """Every drain progress report, with what `count()` said when it came (by default the runs
    in flight on the node)."""

    def __init__(self, runner: Runner, count: Callable[[], int] | None = None) -> None:
        self.count = count or (lambda: runner.running)
        self.seen: list[tuple[DrainProgress, int]] = []
        runner.add_drain_listener(self._heard)

    def _heard(self, progress: DrainProgress) -> None:
        self.seen.append((progress, self.count()))

    def totals(self) -> list[int]:
        return [progress.total for progress, _ in self.seen]


def start(runner: Runner, *runs: RunRequest) -> list[asyncio.Task[None]]:
    tasks = []
    for run in runs:
        provision = runner.admit(run)
        assert not isinstance(provision, RunFailed)
        events: list[RunEvent] = []
        tasks.append(
            asyncio.create_task(runner.execute(runner.run_events(run, provision), events.append))
        )
    return tasks


async def test_a_swap_drain_counts_down_to_zero_as_its_last_run_ends(
    wire_config, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="iop.providers.running")
    runner = Runner(drain_timeout=30)
    runner.apply(payload(wire_config, SLOW))
    old = runner.registry.provisions["p1"]
    progress = Progress(runner, lambda: old.active)
    # Admitted, the runs are the old adapter's (their slots and adapter are taken at admit),
    # whether or not their tasks have reached it yet.
    runs = start(runner, request("a", 2), request("b", 6), request("c", 10))

    # New adapter settings: the old adapter drains its three runs; a new run uses the new one.
    runner.apply(payload(wire_config, {**SLOW, "completion_tokens": 50}))
    new_run = start(runner, request("d", 1))
    await asyncio.gather(*runs, *new_run)
    await runner.aclose()

    assert progress.totals() == [3, 2, 1, 0]
    for report, old_runs in progress.seen:
        assert not report.shutting_down
        assert dict(report.runs_left) == ({"p1": report.total} if report.total else {})
        # Each report counts exactly the old adapter's runs left when it went out: zero came
        # as its last run ended, not before and not a tick later.
        assert report.total == old_runs
    assert not progress.seen[-1][0].draining
    messages = [r.getMessage() for r in caplog.records if "drain" in r.getMessage()]
    assert messages[0] == "swap drain: 3 run(s) left (p1: 3)"
    assert messages[-1].startswith("swap drain: every run ended after ")


async def test_the_shutdown_drain_counts_every_run_and_only_reaches_zero_at_the_last(
    wire_config,
) -> None:
    runner = Runner(drain_timeout=30)
    runner.apply(payload(wire_config, SLOW))
    progress = Progress(runner)
    runs = start(runner, request("a", 2), request("b", 8))
    runner.drain()
    assert isinstance(runner.admit(request("late", 1)), RunFailed)  # refused while draining
    await asyncio.gather(*runs)
    await runner.aclose()

    assert progress.totals() == [2, 1, 0]
    assert all(report.shutting_down and report.draining for report, _ in progress.seen)
    # Each report counts exactly the runs still in flight when it went out.
    assert [running for _, running in progress.seen] == [2, 1, 0]


async def test_a_swap_that_retires_an_idle_adapter_reports_no_drain(wire_config) -> None:
    runner = Runner(drain_timeout=30)
    runner.apply(payload(wire_config, SLOW))
    progress = Progress(runner)
    runner.apply(payload(wire_config, {**SLOW, "completion_tokens": 50}))
    await runner.aclose()
    assert progress.seen == []
    assert not runner.drain_progress().draining


async def test_a_drained_node_returns_once_the_edge_has_read_its_last_run_and_closed(
    wire_config, start_hub, start_node, until, caplog: pytest.LogCaptureFixture
) -> None:
    """The Node says goodbye instead of cutting its stream: `drain` returns once the Edge has
    read the end of every run and closed the stream (cut, the stream would lose what the Edge
    had received but not yet read)."""
    caplog.set_level(logging.INFO, logger="iop.edge.hub.nodehub")
    hub = await start_hub(wire_config([{"id": "p1", "adapter": SLOW}]))
    agent = await start_node(hub)
    events: list[RunEvent] = []

    async def consume() -> None:
        async with hub.run(request("a", 10)) as stream:
            async for event in stream:
                events.append(event)

    consuming = asyncio.create_task(consume())
    await until(lambda: agent.runner.running == 1)

    assert await agent.drain(30) is True
    # Back from the drain: the Edge has the run's end and has closed the node's session.
    assert "node-1" not in hub.nodes()
    await consuming
    assert isinstance(events[-1], RunDone)
    (link,) = agent.connections.values()
    assert link.leaving and not link.connected.is_set()
    ends = [r.getMessage() for r in caplog.records if "node-1 disconnected" in r.getMessage()]
    assert ends == ["node node-1 disconnected: the node ended its stream"]
