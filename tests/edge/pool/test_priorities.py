"""Priority classes at the dispatcher (`openai.priority`, docs/edge.md "Priority classes").

Driven on a real event loop: one provider of capacity 1, so every admission after the first
comes out of the queue, one at a time, in the order the classes and fair queuing decide.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from iop.edge.errors import BadRequest, Displaced, Forbidden, QueueDeadline, QueueFull, Shed
from iop.edge.hub import ProviderLoad
from iop.edge.pool.dispatching import PROMISE_GRACE_S, Dispatcher
from iop.edge.pool.priorities import DEFAULT_PRIORITY, Priority
from iop.edge.pool.slots import Lease
from iop.edge.pool.snapshots import PoolSnapshot
from iop.edgeconfig import EdgeConfig
from iop.wire import ServerLoad
from testkit import Client

CLASSES = [
    {"name": "interactive", "priority": 10, "max_queue_wait_ms": 60_000},
    {"name": "standard", "priority": 0, "max_queue_wait_ms": 60_000},
    {"name": "batch", "priority": -5, "max_queue_wait_ms": 60_000},
]
PRINCIPALS = ("chat", "web", "evals", "locked")


def priority_config(
    config_of: Callable[..., EdgeConfig], provider: Any, *, max_queue: int = 100, **section: Any
) -> EdgeConfig:
    priority = {
        "classes": CLASSES,
        "default_class": "standard",
        "saturation": {"queue_depth": 1},
        "principals": [
            {"principal_ref": "chat", "priority_class": "interactive"},
            {"principal_ref": "evals", "priority_class": "batch"},
            {"principal_ref": "locked", "priority_class": "standard", "lower_per_request": False},
        ],
        **section,
    }
    return config_of(
        [provider("a", capacity=1, max_queue=max_queue, queue_timeout_ms=600_000)],
        clients=[Client(f"app-{name}", f"sk-{name}", name) for name in PRINCIPALS],
        openai={"priority": priority},
    )


class Pool:
    """The dispatcher of one provider of capacity 1; grants are recorded in order."""

    def __init__(self, config: EdgeConfig) -> None:
        self.snapshot = PoolSnapshot.build(config)
        self.dispatcher = Dispatcher(self.snapshot)
        self.dispatcher.set_available({"a"})
        self.granted: list[str] = []
        self.held: list[Lease] = []

    def priority(self, name: str) -> Priority:
        return self.snapshot.priorities.classes[name]

    async def start(
        self, label: str, priority: Priority, principal: str = "anonymous"
    ) -> asyncio.Task[None]:
        async def wait() -> None:
            lease = await self.dispatcher.acquire(
                "m", False, principal=principal, priority=priority
            )
            self.granted.append(label)
            self.held.append(lease)

        task = asyncio.create_task(wait(), name=f"request-{label}")
        await asyncio.sleep(0)  # let it reach the queue (or the free slot)
        return task

    async def finish_one(self) -> None:
        """The run in flight ends; its slot goes to the next request in order."""
        self.dispatcher.release(self.held.pop(0))
        await asyncio.sleep(0)


async def test_a_higher_class_never_waits_behind_a_lower_one(config_of, provider) -> None:
    pool = Pool(priority_config(config_of, provider))
    tasks = [await pool.start("running", pool.priority("standard"))]
    tasks += [await pool.start(f"standard-{n}", pool.priority("standard")) for n in range(3)]
    tasks += [await pool.start(f"interactive-{n}", pool.priority("interactive")) for n in range(2)]
    tasks += [await pool.start("standard-3", pool.priority("standard"))]
    while len(pool.granted) < 7:
        await pool.finish_one()
    await asyncio.gather(*tasks)
    assert pool.granted == [
        "running",
        "interactive-0",
        "interactive-1",
        "standard-0",
        "standard-1",
        "standard-2",
        "standard-3",
    ]
    assert pool.dispatcher.classes.admitted == {"standard": 5, "interactive": 2}
    assert pool.dispatcher.classes.queued == {"standard": 4, "interactive": 2}


async def test_principals_share_fairly_within_one_class(config_of, provider) -> None:
    pool = Pool(priority_config(config_of, provider))
    standard = pool.priority("standard")
    tasks = [await pool.start("running", standard, "web")]
    tasks += [await pool.start(f"web-{n}", standard, "web") for n in range(4)]
    tasks += [await pool.start(f"locked-{n}", standard, "locked") for n in range(2)]
    while len(pool.granted) < 7:
        await pool.finish_one()
    await asyncio.gather(*tasks)
    # The second principal is not served after the first one's whole backlog: they alternate.
    assert pool.granted[1:5] == ["web-0", "locked-0", "web-1", "locked-1"]


async def test_a_full_queue_gives_the_latest_lowest_place_to_a_higher_class(
    config_of, provider
) -> None:
    pool = Pool(priority_config(config_of, provider, max_queue=2))
    standard, interactive = pool.priority("standard"), pool.priority("interactive")
    running = await pool.start("running", standard)
    first = await pool.start("standard-0", standard)
    latest = await pool.start("standard-1", standard)
    # Full: an equal class is refused, a higher one takes the latest lowest place.
    with pytest.raises(QueueFull):
        await pool.dispatcher.acquire("m", False, priority=standard)
    high = await pool.start("interactive-0", interactive)
    with pytest.raises(Displaced) as displaced:
        await latest
    assert "higher priority class" in displaced.value.message
    assert "standard" in displaced.value.message
    assert displaced.value.retry_after_s > 0
    assert not first.done()
    await pool.finish_one()
    await pool.finish_one()
    await pool.finish_one()
    await asyncio.gather(running, first, high)
    assert pool.granted == ["running", "interactive-0", "standard-0"]
    assert pool.dispatcher.classes.shed == {
        ("standard", "queue_full"): 1,
        ("standard", "displaced"): 1,
    }


async def test_a_sheddable_request_waits_only_while_the_model_is_not_saturated(
    config_of, provider
) -> None:
    pool = Pool(priority_config(config_of, provider))
    batch = pool.priority("batch")
    assert batch.sheddable
    running = await pool.start("batch-running", batch)  # a free slot: admitted
    await running
    # Busy, but nothing waits: demand has not passed capacity, and the batch request waits.
    assert not pool.dispatcher.saturated("m")
    queued = await pool.start("batch-queued", batch)
    assert pool.dispatcher.queue_depth("m") == 1
    # A request waits: the model is saturated, and the next batch request is shed at once.
    assert pool.dispatcher.saturated("m")
    with pytest.raises(Shed) as shed:
        await pool.dispatcher.acquire("m", False, priority=batch)
    assert "saturated" in shed.value.message and "batch" in shed.value.message
    assert pool.dispatcher.try_acquire("m", False, priority=batch) is None
    assert pool.dispatcher.queue_depth("m") == 1, "a shed request never takes a queue place"
    assert pool.dispatcher.classes.shed == {("batch", "saturated"): 1}
    # Not sheddable: it waits, and goes before the batch request queued before it.
    waiting = await pool.start("standard", pool.priority("standard"))
    assert pool.dispatcher.queue_depth("m") == 2
    await pool.finish_one()
    await waiting
    await pool.finish_one()
    await queued
    assert pool.granted == ["batch-running", "standard", "batch-queued"]


async def test_a_shed_request_is_queued_when_it_comes_back_as_told(config_of, provider) -> None:
    pool = Pool(priority_config(config_of, provider))
    tasks = [await pool.start("running", pool.priority("standard"))]
    tasks.append(await pool.start("waiting", pool.priority("standard")))
    batch = pool.priority("batch")
    dispatcher = pool.dispatcher

    async def again(promise: bytes) -> Shed:
        with pytest.raises(Shed) as shed:
            await dispatcher.acquire("m", False, priority=batch, promise=promise)
        return shed.value

    told = await again(b"one")
    told = await again(b"one")  # early: shed again, and told anew
    await asyncio.sleep(told.retry_after_s)
    back = asyncio.ensure_future(dispatcher.acquire("m", False, priority=batch, promise=b"one"))
    await asyncio.sleep(0)
    assert dispatcher.saturated("m") and dispatcher.queue_depth("m") == 2
    assert dispatcher.classes.came_back == {"batch": 1}
    await again(b"one")  # the promise is used up
    late = await again(b"two")
    await asyncio.sleep(late.retry_after_s + max(PROMISE_GRACE_S, late.retry_after_s) + 0.05)
    await again(b"two")  # past its window
    await again(b"")  # no identity, no promise
    await pool.finish_one()  # "waiting" (standard) goes first, then the batch request
    await asyncio.gather(*tasks)
    assert not back.done()
    await pool.finish_one()
    dispatcher.release(await back)
    assert pool.granted == ["running", "waiting"]
    assert dispatcher.classes.shed == {("batch", "saturated"): 6}
    assert dispatcher.classes.came_back == {"batch": 1}


async def test_servers_with_queues_of_their_own_saturate_the_model(config_of, provider) -> None:
    pool = Pool(priority_config(config_of, provider))
    loads = {"a": ProviderLoad(0, ServerLoad(running=16, waiting=3), time.monotonic())}
    pool.dispatcher.watch_loads(loads)
    assert pool.dispatcher.saturated("m")
    with pytest.raises(Shed):
        await pool.dispatcher.acquire("m", False, priority=pool.priority("batch"))
    lease = await pool.dispatcher.acquire("m", False, priority=pool.priority("standard"))
    pool.dispatcher.release(lease)
    off = priority_config(
        config_of, provider, saturation={"queue_depth": 1, "server_waiting": None}
    )
    pool.dispatcher.swap(PoolSnapshot.build(off))
    assert not pool.dispatcher.saturated("m")
    lease = await pool.dispatcher.acquire("m", False, priority=pool.priority("batch"))
    pool.dispatcher.release(lease)


async def test_shed_requests_are_told_to_come_back_one_after_the_other(config_of, provider) -> None:
    pool = Pool(priority_config(config_of, provider))
    batch, standard = pool.priority("batch"), pool.priority("standard")
    for _ in range(6):  # sheddable runs of 50 ms: their class is served at about 20 a second
        lease = await pool.dispatcher.acquire("m", False, priority=batch)
        await asyncio.sleep(0.05)
        pool.dispatcher.release(lease)
    await pool.start("running", standard)
    await pool.start("waiting", standard)
    waits = []
    for _ in range(3):
        with pytest.raises(Shed) as shed:
            await pool.dispatcher.acquire("m", False, priority=batch)
        waits.append(shed.value.retry_after_s)
    # Each is told a later time than the one shed before it (about one run later), not all
    # the same moment.
    assert waits == sorted(waits) and len(set(waits)) == 3
    assert waits[1] - waits[0] >= 0.045
    assert pool.dispatcher.retry_after("other") == 1.0, "no runs ended: the default"


@pytest.mark.parametrize(
    ("class_wait_ms", "own", "error", "reason", "says"),
    [
        pytest.param(20, None, QueueDeadline, "class_wait", "max_queue_wait_ms (20)", id="class"),
        pytest.param(
            60_000, 20, QueueDeadline, "request_wait", "x-iop-max-queue-wait-ms (20)", id="request"
        ),
    ],
)
async def test_a_wait_past_its_bound_leaves_the_queue_with_its_reason(
    config_of, provider, class_wait_ms, own, error, reason, says
) -> None:
    classes = [CLASSES[0], {**CLASSES[1], "max_queue_wait_ms": class_wait_ms}, CLASSES[2]]
    pool = Pool(priority_config(config_of, provider, classes=classes))
    standard = pool.snapshot.priorities.resolve(
        "web", "m", None, str(own).encode() if own is not None else None
    )
    await pool.start("running", standard)
    with pytest.raises(error) as ended:
        await pool.dispatcher.acquire("m", False, priority=standard)
    assert says in ended.value.message
    assert pool.dispatcher.classes.shed == {("standard", reason): 1}
    assert pool.dispatcher.queue_depth("m") == 0


def test_a_request_gets_its_principals_class_its_models_or_the_default(config_of, provider) -> None:
    config = config_of(
        [provider("a")],
        {"m": ["a"], "bulk": ["a"]},
        clients=[Client(f"app-{name}", f"sk-{name}", name) for name in PRINCIPALS],
        model_settings={"bulk": {"priority_class": "batch"}},
        openai={
            "priority": {
                "classes": CLASSES,
                "default_class": "standard",
                "principals": [{"principal_ref": "chat", "priority_class": "interactive"}],
            }
        },
    )
    table = PoolSnapshot.build(config).priorities
    assert table.resolve("chat", "bulk").class_name == "interactive"
    assert table.resolve("web", "bulk").class_name == "batch"
    assert table.resolve("web", "m").class_name == "standard"
    assert table.resolve("web", "m").max_wait_s == 60.0
    plain = PoolSnapshot.build(config_of([provider("a")])).priorities
    assert plain.resolve("anyone", "m") is DEFAULT_PRIORITY
    assert DEFAULT_PRIORITY.max_wait_s is None, "no class named: today's behaviour"


@pytest.mark.parametrize(
    ("principal", "asked", "max_wait", "error", "says"),
    [
        pytest.param("web", b"interactive", None, Forbidden, "may only lower", id="raise"),
        pytest.param("locked", b"batch", None, Forbidden, "lower_per_request", id="not-allowed"),
        pytest.param("web", b"urgent", None, BadRequest, "unknown priority class", id="unknown"),
        pytest.param("web", None, b"soon", BadRequest, "whole number", id="bad-wait"),
        pytest.param("web", None, b"0", BadRequest, "from 1 to", id="zero-wait"),
    ],
)
def test_a_header_that_asks_too_much_is_refused_and_named(
    config_of, provider, principal, asked, max_wait, error, says
) -> None:
    table = PoolSnapshot.build(priority_config(config_of, provider)).priorities
    with pytest.raises(error) as refused:
        table.resolve(principal, "m", asked, max_wait)
    assert says in refused.value.message
    assert refused.value.message.startswith("x-iop-")


def test_a_request_may_lower_its_class_and_shorten_its_wait(config_of, provider) -> None:
    table = PoolSnapshot.build(priority_config(config_of, provider)).priorities
    lowered = table.resolve("chat", "m", b"batch", b"1500")
    assert (lowered.class_name, lowered.level, lowered.max_wait_s) == ("batch", -5, 1.5)
    assert table.resolve("locked", "m", b"standard").class_name == "standard", "its own class"
    longer = table.resolve("web", "m", None, b"3600000")
    assert longer.max_wait_s == 60.0, "a request never waits longer than its class allows"
