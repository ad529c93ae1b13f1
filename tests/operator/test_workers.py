"""One worker per EdgeConfig: passes never overlap, the newest generation wins, back-off."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from iop.operator.reconciling import PassResult
from iop.operator.workers import Workers

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


class FakeReconciler:
    """Records the generations it reconciles; each pass waits until the test lets it end."""

    def __init__(self) -> None:
        self.applied = None
        self.seen: list[int] = []
        self.running = 0
        self.most_at_once = 0
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.results: list[PassResult] = []

    async def reconcile(self, body: dict[str, Any], received_at: float) -> PassResult:
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        self.seen.append(body["metadata"]["generation"])
        self.entered.set()
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        return self.results.pop(0) if self.results else PassResult()


def body(generation: int, uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": "demo", "uid": uid, "generation": generation}}


async def test_a_newer_generation_supersedes_the_ones_that_arrive_mid_pass(until) -> None:
    fake = FakeReconciler()
    workers = Workers(lambda namespace, name: fake)  # type: ignore[arg-type, return-value]
    try:
        workers.notify(body(1))
        await asyncio.wait_for(fake.entered.wait(), 5)
        for generation in (2, 3, 4):  # while generation 1 is being applied
            workers.notify(body(generation))
        fake.gate.set()
        await until(lambda: fake.seen[-1:] == [4], timeout=5)
        assert fake.seen == [1, 4]
        assert fake.most_at_once == 1
    finally:
        await workers.stop()


async def test_a_status_write_of_its_own_runs_no_pass(until) -> None:
    fake = FakeReconciler()
    fake.gate.set()
    workers = Workers(lambda namespace, name: fake)  # type: ignore[arg-type, return-value]
    try:
        workers.notify(body(1))
        await until(lambda: fake.seen == [1], timeout=5)
        workers.notify(body(1))  # the same generation: a status or metadata change
        workers.notify(body(2))
        await until(lambda: fake.seen == [1, 2], timeout=5)
    finally:
        await workers.stop()


async def test_a_pin_set_or_removed_runs_a_pass_though_the_generation_is_the_same(until) -> None:
    fake = FakeReconciler()
    fake.gate.set()
    workers = Workers(lambda namespace, name: fake)  # type: ignore[arg-type, return-value]
    pinned = body(1)
    pinned["metadata"]["annotations"] = {"iop.dev/pin-revision": "stable"}
    try:
        workers.notify(body(1))
        await until(lambda: fake.seen == [1], timeout=5)
        workers.notify(pinned)
        await until(lambda: fake.seen == [1, 1], timeout=5)
        workers.notify(pinned)  # a status write while pinned: no pass
        workers.notify(body(1))  # unpinned
        await until(lambda: fake.seen == [1, 1, 1], timeout=5)
        workers.notify(body(1))
        workers.notify(body(2))
        await until(lambda: fake.seen == [1, 1, 1, 2], timeout=5)
    finally:
        await workers.stop()


async def test_a_pin_moved_to_another_revision_runs_a_pass(until) -> None:
    fake = FakeReconciler()
    fake.gate.set()
    workers = Workers(lambda namespace, name: fake)  # type: ignore[arg-type, return-value]
    bodies = []
    for value in ("stable", "3", "2"):
        pinned = body(1)
        pinned["metadata"]["annotations"] = {"iop.dev/pin-revision": value}
        bodies.append(pinned)
    try:
        for count, pinned in enumerate(bodies, start=1):
            workers.notify(pinned)
            await until(lambda count=count: fake.seen == [1] * count, timeout=5)
    finally:
        await workers.stop()


async def test_a_failed_pass_is_retried_and_a_new_generation_does_not_wait_for_the_backoff(
    until,
) -> None:
    fake = FakeReconciler()
    fake.gate.set()
    fake.results = [PassResult(retry=True), PassResult(retry=True)]
    workers = Workers(lambda namespace, name: fake)  # type: ignore[arg-type, return-value]
    try:
        workers.notify(body(1))
        await until(lambda: fake.seen == [1, 1], timeout=5)  # retried after about 1 s
        workers.notify(body(2))  # mid back-off (about 2 s now): at once
        await until(lambda: fake.seen == [1, 1, 2], timeout=1.5)
    finally:
        await workers.stop()


async def test_a_namesake_created_again_gets_a_fresh_worker(until) -> None:
    made: list[FakeReconciler] = []

    def make(namespace: str, name: str) -> FakeReconciler:
        made.append(FakeReconciler())
        made[-1].gate.set()
        return made[-1]

    workers = Workers(make)  # type: ignore[arg-type]
    try:
        workers.notify(body(1, uid="u1"))
        await until(lambda: made and made[0].seen == [1], timeout=5)
        workers.notify(body(1, uid="u2"))
        await until(lambda: len(made) == 2 and made[1].seen == [1], timeout=5)
    finally:
        await workers.stop()
