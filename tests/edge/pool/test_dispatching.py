"""Dispatch rules (docs/edge.md), driven straight at the dispatcher on a real event loop."""

from __future__ import annotations

import asyncio
import random
import time
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from iop.edge.errors import ModelNotFound, NoProvider, QueueFull, QueueTimeout
from iop.edge.pool.dispatching import BUSY_COOLDOWN_S, Dispatcher
from iop.edge.pool.slots import Lease
from iop.edge.pool.snapshots import PoolSnapshot

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


@pytest.fixture
def pool(config_of) -> Callable[..., Dispatcher]:
    """`pool(*providers, models=..., up=True)`: a dispatcher over them, all available."""

    def build(
        *providers: dict[str, Any], models: dict[str, list[str]] | None = None, up: bool = True
    ) -> Dispatcher:
        dispatcher = Dispatcher(PoolSnapshot.build(config_of(list(providers), models)))
        if up:
            dispatcher.set_available(p["id"] for p in providers)
        return dispatcher

    return build


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_lowest_priority_wins_until_full(pool, provider) -> None:
    dispatcher = pool(
        provider("slow", priority=20, capacity=2), provider("fast", priority=10, capacity=2)
    )
    chosen = [(await dispatcher.acquire("m", False)).provider_id for _ in range(4)]
    assert chosen == ["fast", "fast", "slow", "slow"]


async def test_equal_priorities_take_turns_over_1000_requests(pool, provider) -> None:
    dispatcher = pool(
        provider("a", priority=5),
        provider("b", priority=5),
        provider("c", priority=5),
        provider("backup", priority=9),
    )
    counts: Counter[str] = Counter()
    for _ in range(1000):
        lease = await dispatcher.acquire("m", False)
        counts[lease.provider_id] += 1
        dispatcher.release(lease)
    assert counts["backup"] == 0
    assert max(counts.values()) - min(counts.values()) <= 1, counts


async def test_round_robin_stays_fair_while_leases_overlap(pool, provider) -> None:
    dispatcher = pool(*(provider(pid, priority=1, capacity=3) for pid in "abc"))
    rng = random.Random(7)
    held: list[Lease] = []
    counts: Counter[str] = Counter()
    for _ in range(1000):
        while len(held) >= 6 or (held and rng.random() < 0.5):
            dispatcher.release(held.pop(0))
        lease = await dispatcher.acquire("m", False)
        counts[lease.provider_id] += 1
        held.append(lease)
    # Each provider is chosen in turn; overlap only shifts a turn, never starves anyone.
    assert max(counts.values()) - min(counts.values()) <= 1, counts


async def test_capacity_and_long_slots_hold_under_500_concurrent_requests(pool, provider) -> None:
    dispatcher = pool(
        provider("a", capacity=8, long_context_slots=2, max_queue=500),
        provider("b", capacity=4, long_context_slots=0, priority=5, max_queue=500),
        provider("c", capacity=3, priority=20, max_queue=500),
    )
    limits = {"a": (8, 2), "b": (4, 0), "c": (3, None)}
    rng = random.Random(11)
    served: Counter[str] = Counter()
    violations: list[str] = []

    async def one(long: bool) -> None:
        lease = await dispatcher.acquire("m", long)
        served[lease.provider_id] += 1
        for pid, (capacity, long_slots) in limits.items():
            if dispatcher.in_flight(pid) > capacity:
                violations.append(f"{pid} capacity")
            if long_slots is not None and dispatcher.long_in_flight(pid) > long_slots:
                violations.append(f"{pid} long slots")
        for _ in range(rng.randint(0, 4)):
            await asyncio.sleep(0)
        dispatcher.release(lease)

    await asyncio.gather(*(one(rng.random() < 0.3) for _ in range(500)))
    assert not violations
    assert sum(served.values()) == 500
    assert dispatcher.in_flight_counts() == {"a": (0, 0), "b": (0, 0), "c": (0, 0)}
    assert dispatcher.waiting == 0


async def test_long_request_holds_a_long_slot_and_a_capacity_slot(pool, provider) -> None:
    dispatcher = pool(
        provider("limited", capacity=2, long_context_slots=1, priority=1),
        provider("never", capacity=2, long_context_slots=0, priority=0),
        provider("unlimited", capacity=1, priority=2),
    )
    first = await dispatcher.acquire("m", True)
    assert first.provider_id == "limited"
    assert (dispatcher.in_flight("limited"), dispatcher.long_in_flight("limited")) == (1, 1)
    second = await dispatcher.acquire("m", True)
    assert second.provider_id == "unlimited"  # limited's one long slot is taken
    short = await dispatcher.acquire("m", False)
    assert short.provider_id == "never"  # 0 long slots still takes short requests
    dispatcher.release(first)
    assert (dispatcher.in_flight("limited"), dispatcher.long_in_flight("limited")) == (0, 0)


async def test_full_queue_refuses_at_once(pool, provider) -> None:
    dispatcher = pool(provider("a", capacity=1, max_queue=2))
    held = await dispatcher.acquire("m", False)
    waiting = [asyncio.create_task(dispatcher.acquire("m", False)) for _ in range(2)]
    await settle()
    assert dispatcher.queue_depth("m") == 2
    with pytest.raises(QueueFull) as caught:
        await dispatcher.acquire("m", False)
    assert caught.value.retry_after_s > 0
    dispatcher.release(held)
    for task in waiting:
        dispatcher.release(await task)
    assert dispatcher.in_flight("a") == 0


async def test_queue_bound_is_the_sum_over_the_models_enabled_providers(pool, provider) -> None:
    dispatcher = pool(
        provider("a", capacity=1, max_queue=2),
        provider("b", capacity=1, max_queue=3),
        provider("off", capacity=1, max_queue=50, enabled=False),
    )
    assert dispatcher.snapshot.models["m"].queue_bound == 5


async def test_waiting_past_the_timeout_fails(pool, provider) -> None:
    dispatcher = pool(
        provider("a", capacity=1, queue_timeout_ms=30),
        provider("b", capacity=1, queue_timeout_ms=60, priority=99),
    )
    assert dispatcher.snapshot.models["m"].queue_timeout_s == 0.06  # the most patient one
    held = [await dispatcher.acquire("m", False) for _ in range(2)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(QueueTimeout):
        await dispatcher.acquire("m", False)
    assert loop.time() - started >= 0.05
    assert dispatcher.waiting == 0
    for lease in held:
        dispatcher.release(lease)


async def test_unknown_model_and_unservable_requests_fail_fast(pool, provider) -> None:
    dispatcher = pool(
        provider("a", long_context_slots=0),
        provider("off", enabled=False),
        provider("long-off", long_context_slots=1, enabled=False),
        models={"m": ["a", "long-off"], "dark": ["off"]},
    )
    with pytest.raises(ModelNotFound):
        await dispatcher.acquire("nope", False)
    with pytest.raises(NoProvider):
        await dispatcher.acquire("dark", False)
    with pytest.raises(NoProvider):  # the one provider with long slots is disabled
        await dispatcher.acquire("m", True)


async def test_a_freed_slot_serves_the_oldest_waiting_request_across_models(pool, provider) -> None:
    dispatcher = pool(
        provider("shared", capacity=1),
        provider("only-b", capacity=1),
        models={"a": ["shared"], "b": ["shared", "only-b"]},
    )
    first = await dispatcher.acquire("a", False)
    b_lease = await dispatcher.acquire("b", False)
    assert b_lease.provider_id == "only-b"
    order: list[str] = []

    async def wait(model: str):
        lease = await dispatcher.acquire(model, False)
        order.append(model)
        return lease

    older = asyncio.create_task(wait("b"))
    await settle()
    younger = asyncio.create_task(wait("a"))
    await settle()
    dispatcher.release(first)  # "shared" frees: the older request (for b) gets it
    await settle()
    assert order == ["b"]
    assert (await older).provider_id == "shared"
    dispatcher.release(b_lease)  # "only-b" frees, but the waiting request is for a: stays
    await settle()
    assert order == ["b"]
    dispatcher.release(await older)
    assert (await younger).provider_id == "shared"


async def test_a_short_request_is_not_stuck_behind_a_long_one(pool, provider) -> None:
    dispatcher = pool(provider("a", capacity=2, long_context_slots=1))
    long_held = await dispatcher.acquire("m", True)
    short_held = await dispatcher.acquire("m", False)
    long_waiting = asyncio.create_task(dispatcher.acquire("m", True))
    await settle()
    short_waiting = asyncio.create_task(dispatcher.acquire("m", False))
    await settle()
    dispatcher.release(short_held)  # a capacity slot, but no long slot: the short one gets it
    lease = await short_waiting
    assert not long_waiting.done()
    dispatcher.release(lease)
    dispatcher.release(long_held)
    dispatcher.release(await long_waiting)
    assert dispatcher.in_flight_counts()["a"] == (0, 0)


async def test_cancelled_waiter_leaves_nothing_behind(pool, provider) -> None:
    dispatcher = pool(provider("a", capacity=1))
    held = await dispatcher.acquire("m", False)
    waiting = asyncio.create_task(dispatcher.acquire("m", False))
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert dispatcher.waiting == 0
    dispatcher.release(held)
    assert dispatcher.in_flight("a") == 0


async def test_cancellation_landing_after_the_grant_gives_the_slot_back(pool, provider) -> None:
    dispatcher = pool(provider("a", capacity=1))
    held = await dispatcher.acquire("m", False)
    waiting = asyncio.create_task(dispatcher.acquire("m", False))
    await settle()
    dispatcher.release(held)  # granted to the waiter, whose task has not resumed yet
    assert dispatcher.in_flight("a") == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert dispatcher.in_flight("a") == 0


async def test_busy_refusal_tries_another_candidate(pool, provider) -> None:
    dispatcher = pool(provider("a", priority=1), provider("b", priority=2))
    lease = await dispatcher.acquire("m", False)
    assert lease.provider_id == "a"
    dispatcher.refuse(lease)
    retry = await dispatcher.acquire("m", False, deadline=lease.deadline)
    assert retry.provider_id == "b"  # "a" sits out its cool-down
    assert dispatcher.in_flight_counts() == {"a": (0, 0), "b": (1, 0)}
    dispatcher.release(retry)
    dispatcher.close()


async def test_busy_refusal_with_no_other_candidate_waits_for_the_cool_down(pool, provider) -> None:
    dispatcher = pool(provider("a", capacity=4, max_queue=0))
    lease = await dispatcher.acquire("m", False)
    dispatcher.refuse(lease)
    loop = asyncio.get_running_loop()
    started = loop.time()
    # max_queue 0, yet a retry waits: a busy refusal never fails the request by itself.
    retry = await dispatcher.acquire("m", False, deadline=lease.deadline)
    assert retry.provider_id == "a"
    assert loop.time() - started >= BUSY_COOLDOWN_S * 0.8
    dispatcher.release(retry)
    assert dispatcher.in_flight("a") == 0


async def test_the_cool_down_ends_when_its_timer_fires_even_if_the_clock_lags(
    pool, provider, monkeypatch
) -> None:
    """uvloop's timers run on a millisecond clock and may fire just before time.monotonic()
    reaches the end of a cool-down: a request waiting on it must get the slot all the same."""
    import iop.edge.pool.dispatching as dispatching

    dispatcher = pool(provider("a", capacity=4, max_queue=0))
    lease = await dispatcher.acquire("m", False)
    dispatcher.refuse(lease)
    # From here on the dispatcher's clock reads 2 ms behind the loop's timers.
    real = time.monotonic
    lagging = types.SimpleNamespace(
        monotonic=lambda: real() - 0.002, perf_counter=time.perf_counter
    )
    monkeypatch.setattr(dispatching, "time", lagging)
    retry = await asyncio.wait_for(dispatcher.acquire("m", False, deadline=lease.deadline), 5)
    assert retry.provider_id == "a"
    dispatcher.release(retry)


async def test_providers_of_disconnected_or_unhealthy_nodes_are_no_candidates(
    pool, provider
) -> None:
    dispatcher = pool(provider("a", priority=1), provider("b", priority=2), up=False)
    dispatcher.set_available({"b"})
    assert (await dispatcher.acquire("m", False)).provider_id == "b"
    dispatcher.set_available(set())
    waiting = asyncio.create_task(dispatcher.acquire("m", False))
    await settle()
    assert dispatcher.queue_depth("m") == 1
    dispatcher.set_available({"a"})  # a node connects: the waiting request runs at once
    assert (await waiting).provider_id == "a"


async def test_swap_raising_capacity_serves_waiting_requests_at_once(provider, config_of) -> None:
    config = config_of([provider("a", capacity=1)])
    dispatcher = Dispatcher(PoolSnapshot.build(config))
    dispatcher.set_available({"a"})
    held = await dispatcher.acquire("m", False)
    waiting = [asyncio.create_task(dispatcher.acquire("m", False)) for _ in range(2)]
    await settle()
    dispatcher.swap(PoolSnapshot.build(config_of([provider("a", capacity=3)]), 2))
    leases = [await task for task in waiting]
    assert dispatcher.in_flight("a") == 3
    for lease in [held, *leases]:
        assert lease.provider_id == "a"
        dispatcher.release(lease)
    assert held.snapshot.generation == 1 and leases[0].snapshot.generation == 2


async def test_swap_lowering_capacity_keeps_runs_and_holds_admissions(
    pool, provider, config_of
) -> None:
    dispatcher = pool(provider("a", capacity=3))
    held = [await dispatcher.acquire("m", False) for _ in range(3)]
    dispatcher.swap(PoolSnapshot.build(config_of([provider("a", capacity=1)]), 2))
    assert dispatcher.in_flight("a") == 3  # nothing was cut short
    waiting = asyncio.create_task(dispatcher.acquire("m", False))
    dispatcher.release(held[0])
    dispatcher.release(held[1])
    await settle()
    assert not waiting.done()  # 1 in flight, capacity 1: still no room
    dispatcher.release(held[2])
    dispatcher.release(await waiting)
    assert dispatcher.in_flight("a") == 0


async def test_swap_removing_a_model_fails_its_waiting_requests(pool, provider, config_of) -> None:
    dispatcher = pool(provider("a", capacity=1), models={"m": ["a"], "other": ["a"]})
    held = await dispatcher.acquire("m", False)
    waiting = asyncio.create_task(dispatcher.acquire("other", False))
    await settle()
    dispatcher.swap(PoolSnapshot.build(config_of([provider("a", capacity=1)]), 2))
    with pytest.raises(ModelNotFound):
        await waiting
    dispatcher.release(held)
    assert dispatcher.waiting == 0 and dispatcher.in_flight("a") == 0


async def test_swap_of_a_removed_provider_keeps_its_slots_until_its_runs_end(
    pool, provider, config_of
) -> None:
    dispatcher = pool(provider("a"), provider("b"))
    lease = await dispatcher.acquire("m", False)
    dispatcher.swap(PoolSnapshot.build(config_of([provider("z")]), 2))
    assert dispatcher.in_flight(lease.provider_id) == 1
    dispatcher.release(lease)
    assert lease.provider_id not in dispatcher.in_flight_counts() or (
        dispatcher.in_flight(lease.provider_id) == 0
    )


async def test_a_retry_avoids_the_providers_it_tried_while_another_is_available(
    pool, provider
) -> None:
    dispatcher = pool(
        provider("a", priority=1), provider("b", priority=2), provider("c", priority=2)
    )
    tried = frozenset({"a"})
    first = await dispatcher.acquire("m", False, avoid=tried)
    assert first.provider_id in ("b", "c")  # "a" has the lowest priority, but failed this request
    second = await dispatcher.acquire("m", False, avoid=tried | {first.provider_id})
    assert second.provider_id == ({"b", "c"} - {first.provider_id}).pop()
    # Every candidate tried: any of them again, the best first.
    third = await dispatcher.acquire("m", False, avoid=frozenset("abc"))
    assert third.provider_id == "a"
    for lease in (first, second, third):
        dispatcher.release(lease)


async def test_a_retry_waits_for_an_untried_provider_that_is_busy_not_gone(pool, provider) -> None:
    dispatcher = pool(provider("a", priority=1), provider("b", priority=2, capacity=1))
    held = await dispatcher.acquire("m", False, avoid=frozenset({"a"}))
    assert held.provider_id == "b"
    retry = asyncio.create_task(dispatcher.acquire("m", False, avoid=frozenset({"a"})))
    await settle()
    assert not retry.done() and dispatcher.queue_depth("m") == 1  # "a" is free, but tried
    dispatcher.release(held)
    assert (await retry).provider_id == "b"
    dispatcher.release(await retry)
    # "b" gone from dispatch: "a" is the one available candidate, tried or not.
    dispatcher.set_available({"a"})
    alone = await dispatcher.acquire("m", False, avoid=frozenset({"a"}))
    assert alone.provider_id == "a"
    dispatcher.release(alone)


async def test_availability_views_for_fallbacks(pool, provider) -> None:
    dispatcher = pool(
        provider("a", long_context_slots=0), provider("b"), models={"m": ["a", "b"], "n": ["b"]}
    )
    assert dispatcher.available_for("m", False, frozenset({"b"}))
    assert not dispatcher.available_for("m", True, frozenset({"b"}))  # "a" takes no long one
    assert not dispatcher.available_for("m", False, frozenset({"a", "b"}))
    assert not dispatcher.available_for("nope", False)
    dispatcher.set_available({"a"})
    assert not dispatcher.available_for("n", False)  # enabled, but not in dispatch
    assert dispatcher.serves("n", False) and dispatcher.serves("n", True)
    assert not dispatcher.serves("nope", False)
