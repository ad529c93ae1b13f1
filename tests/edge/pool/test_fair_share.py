"""Fair share between principals in a model's queue (`openai.principal_weights`).

Driven at the dispatcher on a real event loop: one provider of capacity 1, so every admission
after the first comes out of the queue, one at a time, in the order fair queuing decides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop.edge.pool.dispatching import Dispatcher
from iop.edge.pool.slots import Lease
from iop.edge.pool.snapshots import PoolSnapshot
from iop.edgeconfig import EdgeConfig
from testkit import Client

PRINCIPALS = ("p0", "p1", "p2")


class Pool:
    """One provider of capacity 1 and a queue long enough for any test; grants are recorded."""

    def __init__(self, config_of: Callable[..., EdgeConfig], provider: Any, weights: Any) -> None:
        principals = ("batch", "frontend", "gold", "silver", *PRINCIPALS)
        config = config_of(
            [provider("a", capacity=1, max_queue=10_000, queue_timeout_ms=600_000)],
            clients=[Client(f"app-{name}", f"sk-{name}", name) for name in principals],
            openai={"principal_weights": dict(weights)},
        )
        self.dispatcher = Dispatcher(PoolSnapshot.build(config))
        self.dispatcher.set_available({"a"})
        self.granted: list[tuple[str, int]] = []
        self.held: list[Lease] = []

    async def start(self, principal: str, number: int) -> asyncio.Task[None]:
        async def wait() -> None:
            lease = await self.dispatcher.acquire("m", False, principal=principal)
            self.granted.append((principal, number))
            self.held.append(lease)

        task = asyncio.create_task(wait(), name=f"request-{principal}-{number}")
        await asyncio.sleep(0)  # let it reach the queue (or the free slot)
        return task

    async def finish_one(self) -> None:
        """The run in flight ends; its slot goes to the next request in fair order."""
        lease = self.held.pop(0)
        self.dispatcher.release(lease)
        await asyncio.sleep(0)


async def test_a_flooding_principal_does_not_starve_a_quiet_one(config_of, provider) -> None:
    pool = Pool(config_of, provider, {})
    tasks = [await pool.start("batch", n) for n in range(50)]  # 1 runs, 49 wait
    await pool.finish_one()
    await pool.finish_one()
    tasks.append(await pool.start("frontend", 0))
    # The quiet principal goes next or right after the one batch request already tagged level
    # with it: never behind the rest of the flood.
    await pool.finish_one()
    await pool.finish_one()
    assert ("frontend", 0) in pool.granted[-2:]
    while pool.held:
        await pool.finish_one()
    await asyncio.gather(*tasks)
    batch = [number for principal, number in pool.granted if principal == "batch"]
    assert batch == sorted(batch), "a principal's own requests keep their order"


@pytest.mark.parametrize(("weight", "expected"), [(1, 6), (3, 9)], ids=["equal", "three-to-one"])
async def test_weights_share_the_slots(config_of, provider, weight, expected) -> None:
    pool = Pool(config_of, provider, {"gold": weight})
    tasks = [await pool.start("silver", n) for n in range(30)]
    tasks += [await pool.start("gold", n) for n in range(30)]
    for _ in range(13):  # the one admitted at once, then 12 out of the queue
        await pool.finish_one()
    served = [principal for principal, _ in pool.granted[1:13]]
    assert served.count("gold") == expected
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for lease in pool.held:
        pool.dispatcher.release(lease)


def bound(weights: dict[str, int], principal: str, principals: Sequence[str]) -> int:
    """Most grants that may go to others before a request of `principal` that finds none of its
    own waiting: per other principal q, floor(w_q / w_p) + 1."""
    own = weights.get(principal, 1)
    return sum(weights.get(q, 1) // own + 1 for q in principals if q != principal)


@settings(max_examples=60, deadline=None)
@given(
    weights=st.fixed_dictionaries({p: st.integers(1, 4) for p in PRINCIPALS}),
    # Bursts: a principal sends n requests in a row, or n runs in flight finish.
    steps=st.lists(
        st.tuples(st.sampled_from((*PRINCIPALS, "finish")), st.integers(1, 20)),
        min_size=1,
        max_size=12,
    ),
)
def test_no_principal_is_starved(config_of, provider, weights, steps) -> None:
    async def run() -> None:
        pool = Pool(config_of, provider, weights)
        tasks: list[asyncio.Task[None]] = []
        # For a request that found none of its principal's own requests waiting: the number of
        # grants made when it arrived.
        watched: dict[tuple[str, int], int] = {}
        counts = dict.fromkeys(PRINCIPALS, 0)
        for step, times in steps:
            for _ in range(times):
                if step == "finish":
                    if pool.held:
                        await pool.finish_one()
                    continue
                waiting = pool.dispatcher.queue_depths_by_principal().get(("m", step), 0)
                number = counts[step]
                counts[step] += 1
                if not waiting:
                    watched[(step, number)] = len(pool.granted)
                tasks.append(await pool.start(step, number))
        while pool.held:
            await pool.finish_one()
        await asyncio.gather(*tasks)
        order = {request: index for index, request in enumerate(pool.granted)}
        for (principal, number), arrived_after in watched.items():
            ahead = order[(principal, number)] - arrived_after
            assert ahead <= bound(weights, principal, PRINCIPALS) + 1, (principal, number)
        for principal in PRINCIPALS:
            mine = [number for p, number in pool.granted if p == principal]
            assert mine == sorted(mine)

    asyncio.run(run())


async def test_through_the_edge_a_quiet_principal_overtakes_a_flood(
    refresh_stack, document_of, provider, until
) -> None:
    """Real Edge and Node (gRPC, the fake adapter taking 40 ms a run), the official client."""
    fake = {"type": "fake", "completion_tokens": 2, "latency_ms": 40}
    keys = {"batch": "sk-batch-flood-key", "frontend": "sk-frontend-quiet-key"}
    document = document_of(
        [
            provider(
                "pa",
                adapter=fake,
                served_models=["served-a"],
                capacity=1,
                max_queue=100,
                queue_timeout_ms=60_000,
            )
        ],
        clients=[Client(f"{name}-app", key, name) for name, key in keys.items()],
        admin=True,
    )
    stack = await refresh_stack(document)
    finished: list[str] = []

    async def ask(name: str) -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{stack.edge.url}/v1", api_key=keys[name], max_retries=0, timeout=60
        ) as client:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            )
        finished.append(name)

    flood = [asyncio.create_task(ask("batch")) for _ in range(20)]
    depths = stack.edge.dispatcher.queue_depths_by_principal
    await until(lambda: depths().get(("m", "batch"), 0) >= 19)
    await ask("frontend")
    await asyncio.gather(*flood)
    # FIFO would have put it behind all 19 waiting batch requests; fair share lets it in next,
    # once it has arrived: a client that took up to 400 ms to reach the Edge on a loaded machine
    # (ten more runs of 40 ms) still finishes ahead of half of the flood.
    assert finished.index("frontend") <= 10, finished
    metrics = stack.edge.metrics.render().decode()  # the public listener serves no metrics
    assert 'iop_edge_queue_wait_seconds_count{model="m",principal_ref="frontend"} 1.0' in metrics
