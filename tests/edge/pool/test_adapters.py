"""LoRA adapters (`models[].adapters`, docs/edge.md "LoRA adapters"): the catalog entry of an
adapter, and the choice of a server for its requests (loaded, then room to load it, then a swap)
within capacity and priority, driven straight at the dispatcher on a real event loop."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from iop.edge.hub.protocol import ProviderLoad
from iop.edge.pool.choosing import ADAPTER_REPORT_TTL_S
from iop.edge.pool.dispatching import Dispatcher
from iop.edge.pool.slots import Lease
from iop.edge.pool.snapshots import PoolSnapshot
from iop.wire.nodestates import ServerLoad

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


@pytest.fixture
def pool(config_of, provider) -> Callable[..., Dispatcher]:
    """`pool(ids, policy=..., providers=...)`: a dispatcher over providers (capacity 4) of one
    model "m" with the adapters "sql" and "chat", all available."""

    def build(
        ids: str = "abcd",
        policy: str = "round_robin",
        providers: list[dict[str, Any]] | None = None,
        **model: Any,
    ) -> Dispatcher:
        entries = providers or [provider(pid) for pid in ids]
        settings = {"adapters": ["sql", "chat"], "dispatch": {"policy": policy}, **model}
        config = config_of(entries, model_settings={"m": settings})
        dispatcher = Dispatcher(PoolSnapshot.build(config))
        dispatcher.set_available(p["id"] for p in entries)
        return dispatcher

    return build


def lora(running: tuple[str, ...] = (), waiting: tuple[str, ...] = (), max_loras: int = 2) -> Any:
    """A provider's load report whose server holds `running` and `waiting` adapters now."""
    server = ServerLoad(len(running), len(waiting), 0.1, 0.0, 0, running, waiting, max_loras)
    return ProviderLoad(0, server, time.monotonic())


def test_an_adapter_is_a_catalog_entry_on_its_models_providers(config_of, provider) -> None:
    config = config_of(
        [provider("a"), provider("b")],
        model_settings={"m": {"adapters": ["sql"], "priority_class": None}},
    )
    snapshot = PoolSnapshot.build(config)
    assert list(snapshot.models) == ["m", "sql"]
    base, adapter = snapshot.models["m"], snapshot.models["sql"]
    assert base.adapter is None and base.base_model is None
    assert adapter.adapter == "sql" and adapter.base_model == "m"
    # The same providers, each serving the adapter under its name, as vLLM expects `model`.
    assert [(c.provider.id, c.served_model) for c in adapter.candidates] == [
        ("a", "sql"),
        ("b", "sql"),
    ]
    assert [c.served_model for c in base.candidates] == ["a-served", "b-served"]
    assert adapter.queue_bound == base.queue_bound and adapter.fallbacks == ()
    # A freed slot of either provider serves the adapter's waiting requests too.
    assert [m.id for m, _ in snapshot.models_by_provider["a"]] == ["m", "sql"]


async def hold_idle(dispatcher: Dispatcher, provider_id: str, *adapters: str) -> None:
    """Runs of `adapters` on `provider_id` alone, ended: idle adapters in its slots."""
    everyone = dispatcher.available
    dispatcher.set_available([provider_id])
    for adapter in adapters:
        dispatcher.release(await dispatcher.acquire(adapter, False))
    dispatcher.set_available(everyone)


async def test_loaded_then_room_then_room_by_eviction_then_wait_rather_than_swap(pool) -> None:
    dispatcher = pool(adapters=["sql", "chat", "law"])
    await hold_idle(dispatcher, "d", "chat", "law")  # d's two slots hold them, idle
    dispatcher.watch_loads(
        {
            "a": lora(running=("x", "y")),  # both slots serve other adapters' requests: a swap
            "b": lora(running=("sql",)),  # loaded
            "c": lora(running=("x",)),  # a free slot
            "d": lora(),  # room, by evicting one of this Edge's idle adapters
        }
    )
    leases: list[Lease] = []
    for _ in range(12):
        lease = await dispatcher.acquire("sql", False)
        assert lease.served_model == "sql"
        leases.append(lease)
    # b until its capacity (4) is taken, then c (loaded from its first run on), then d, each to
    # its capacity, never past it.
    assert [lease.provider_id for lease in leases] == ["b"] * 4 + ["c"] * 4 + ["d"] * 4
    # a is free but would swap, while b, c and d hold sql: the request waits for one of them.
    assert dispatcher.try_acquire("sql", False) is None
    waiting = asyncio.create_task(dispatcher.acquire("sql", False))
    await asyncio.sleep(0)
    assert dispatcher.queue_depth("sql") == 1
    # A base model request takes a's free slot meanwhile: only the adapter's requests wait.
    base = await dispatcher.acquire("m", False)
    assert base.provider_id == "a"
    dispatcher.release(leases.pop(5))  # one of c's
    lease = await waiting
    assert lease.provider_id == "c"
    leases += [lease, base]
    decisions = dispatcher.decisions()
    assert decisions[("sql", "round_robin", "adapter_loaded")] == 10
    assert decisions[("sql", "round_robin", "adapter_room")] == 2
    assert decisions[("sql", "round_robin", "freed_slot")] == 1
    assert ("sql", "round_robin", "adapter_swap") not in decisions
    for lease in leases:
        dispatcher.release(lease)


async def test_a_swap_when_no_server_holds_the_adapter_or_has_room(pool) -> None:
    dispatcher = pool(ids="ab")
    dispatcher.watch_loads({"a": lora(running=("x", "y")), "b": lora(running=("x", "z"))})
    lease = await dispatcher.acquire("sql", False)
    assert lease.provider_id in "ab"
    assert dispatcher.decisions()[("sql", "round_robin", "adapter_swap")] == 1
    dispatcher.release(lease)


async def test_a_free_slot_beats_evicting_an_idle_adapter(pool) -> None:
    dispatcher = pool(ids="cd", adapters=["sql", "chat", "law"])
    await hold_idle(dispatcher, "c", "chat", "law")
    await hold_idle(dispatcher, "d", "chat")  # d chosen last: round-robin alone would pick c
    dispatcher.watch_loads({"c": lora(), "d": lora()})
    lease = await dispatcher.acquire("sql", False)
    assert lease.provider_id == "d"  # one slot free there; c would evict chat or law
    dispatcher.release(lease)


async def test_without_reports_the_edge_follows_its_own_runs(pool) -> None:
    dispatcher = pool(ids="ab")
    first = await dispatcher.acquire("sql", False)
    second = await dispatcher.acquire("chat", False)
    assert {first.provider_id, second.provider_id} == {"a", "b"}  # each to a server of its own
    # While they run, and after they ended (the server's slots keep the last adapter), each
    # adapter's next request goes where it went.
    again = await dispatcher.acquire("sql", False)
    assert again.provider_id == first.provider_id
    for lease in (first, second, again):
        dispatcher.release(lease)
    for _ in range(5):
        lease = await dispatcher.acquire("chat", False)
        assert lease.provider_id == second.provider_id
        dispatcher.release(lease)
    # The base model's requests know nothing of adapters: they take turns.
    turns = []
    for _ in range(4):
        lease = await dispatcher.acquire("m", False)
        turns.append(lease.provider_id)
        dispatcher.release(lease)
    assert Counter(turns) == {"a": 2, "b": 2}


async def test_priority_comes_before_the_adapter(pool, provider) -> None:
    dispatcher = pool(providers=[provider("near", priority=5), provider("far", priority=10)])
    dispatcher.watch_loads({"near": lora(running=("x", "y")), "far": lora(running=("sql",))})
    # far has it loaded, but near is of a better priority and free: near, even for a swap.
    lease = await dispatcher.acquire("sql", False)
    assert lease.provider_id == "near"
    assert dispatcher.decisions()[("sql", "round_robin", "adapter_swap")] == 1


async def test_a_stale_report_counts_for_nothing(pool) -> None:
    dispatcher = pool(ids="ab")
    stale = time.monotonic() - ADAPTER_REPORT_TTL_S - 1
    report = lora(running=("sql",))
    dispatcher.watch_loads(
        {"a": ProviderLoad(0, report.server, stale), "b": lora(running=("x", "y"))}
    )
    # a's word is too old to trust: a is a server with room, b a swap.
    lease = await dispatcher.acquire("sql", False)
    assert lease.provider_id == "a"
    assert dispatcher.decisions()[("sql", "round_robin", "adapter_room")] == 1


@pytest.mark.parametrize("policy", ["least_load", "prefix_affinity"])
async def test_the_models_policy_chooses_within_the_best_tier(pool, policy: str) -> None:
    dispatcher = pool(policy=policy)
    dispatcher.watch_loads(
        {
            "a": lora(running=("sql",)),
            "b": lora(running=("sql",)),
            "c": lora(),
            "d": lora(),
        }
    )
    held = [await dispatcher.acquire("m", False) for _ in range(3)]
    counts = Counter(lease.provider_id for lease in held)
    lease = await dispatcher.acquire("sql", False)
    assert lease.provider_id in "ab"  # loaded beats the emptier c and d
    if policy == "least_load":
        assert dispatcher.load(lease.provider_id) - 1 <= min(counts.get(p, 0) for p in "ab")
    for each in (*held, lease):
        dispatcher.release(each)
