"""Choosing among equals (`models[].dispatch.policy`, docs/edge.md): least_load and
prefix_affinity, driven straight at the dispatcher on a real event loop."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from iop.edge.bodies import parse_request
from iop.edge.hub.protocol import ProviderLoad
from iop.edge.pool.choosing import LOAD_REPORT_TTL_S, PrefixKey, rendezvous_order
from iop.edge.pool.dispatching import MAX_PASSED, Dispatcher
from iop.edge.pool.prefixes import prefix_key
from iop.edge.pool.slots import Lease
from iop.edge.pool.snapshots import PoolSnapshot
from iop.wire.nodestates import ServerLoad

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

SYSTEM = "You are the support assistant of a bank. Be brief, be exact. " * 8


@pytest.fixture
def pool(config_of, provider) -> Callable[..., Dispatcher]:
    """`pool(policy, ids=..., load_factor=..., **provider settings)`: a dispatcher over providers
    of one model "m" (capacity 4, priority 10 unless said), all available."""

    def build(
        policy: str,
        ids: str = "abcd",
        load_factor: float | None = None,
        providers: list[dict[str, Any]] | None = None,
    ) -> Dispatcher:
        entries = providers or [provider(pid) for pid in ids]
        dispatch: dict[str, Any] = {"policy": policy}
        if load_factor is not None:
            dispatch["load_factor"] = load_factor
        config = config_of(entries, model_settings={"m": {"dispatch": dispatch}})
        dispatcher = Dispatcher(PoolSnapshot.build(config))
        dispatcher.set_available(p["id"] for p in entries)
        return dispatcher

    return build


def chat(*contents: str) -> PrefixKey:
    """The prefix key of a conversation: the system prompt, then user/assistant turns."""
    messages = [{"role": "system", "content": SYSTEM}]
    for index, content in enumerate(contents):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": content})
    body = orjson.dumps({"model": "m", "messages": messages})
    key = prefix_key(parse_request("chat", body))
    assert key is not None
    return key


def conversation_turns(name: str, turns: int) -> list[PrefixKey]:
    """The keys of a conversation's first `turns` turns (each repeats the ones before it)."""
    said: list[str] = []
    keys = []
    for turn in range(turns):
        said.append(f"{name}: question {turn}")
        keys.append(chat(*said))
        said.append(f"answer {turn} to {name}")
    return keys


# -- least_load ------------------------------------------------------------------------------


async def test_least_load_takes_the_emptiest_for_its_capacity(pool, provider) -> None:
    dispatcher = pool(
        "least_load", providers=[provider("big", capacity=8), provider("small", capacity=2)]
    )
    chosen = [(await dispatcher.acquire("m", False)).provider_id for _ in range(6)]
    # Half full is half full: the big one takes 4 while the small one takes 1, and so on.
    assert Counter(chosen) == {"big": 4, "small": 2}
    assert dispatcher.decisions() == {("m", "least_load", "least_load"): 6}


async def test_least_load_takes_equals_in_turn(pool) -> None:
    dispatcher = pool("least_load")
    counts: Counter[str] = Counter()
    for _ in range(400):
        lease = await dispatcher.acquire("m", False)
        counts[lease.provider_id] += 1
        dispatcher.release(lease)
    assert counts == {"a": 100, "b": 100, "c": 100, "d": 100}


async def test_least_load_counts_other_edges_and_other_clients(pool) -> None:
    dispatcher = pool("least_load", ids="abc")
    now = time.monotonic()
    dispatcher.watch_loads(
        {
            # Runs from other Edges, as the Node's heartbeat says.
            "a": ProviderLoad(node_in_flight=3, server=None, reported_at=now, elsewhere=3),
            # The server's own queue (its /metrics), less the Node's runs: other clients.
            "b": ProviderLoad(0, ServerLoad(running=2, waiting=1, not_ours=3), now),
            "c": ProviderLoad(1, ServerLoad(running=1, not_ours=0), now),
        }
    )
    assert [dispatcher.load(pid) for pid in "abc"] == [3, 3, 0]
    first = await dispatcher.acquire("m", False)
    assert first.provider_id == "c"
    # The Edge's own runs add up at once; a report that lags neither hides nor doubles them.
    assert dispatcher.load("c") == 1
    second = await dispatcher.acquire("m", False)
    assert second.provider_id == "c"  # 1 against 3 and 3
    assert [dispatcher.load(pid) for pid in "abc"] == [3, 3, 2]


async def test_stale_reports_count_for_nothing(pool) -> None:
    dispatcher = pool("least_load", ids="ab")
    old = time.monotonic() - LOAD_REPORT_TTL_S - 1
    dispatcher.watch_loads(
        {
            "a": ProviderLoad(4, ServerLoad(running=4, waiting=9, not_ours=9), old, elsewhere=4),
            "b": ProviderLoad(
                0,
                ServerLoad(running=3, waiting=0, age_s=LOAD_REPORT_TTL_S + 1, not_ours=3),
                time.monotonic(),
            ),
        }
    )
    assert dispatcher.load("a") == 0
    assert dispatcher.load("b") == 0


async def test_kv_cache_use_breaks_ties(pool) -> None:
    dispatcher = pool("least_load", ids="ab")
    now = time.monotonic()
    dispatcher.watch_loads(
        {
            "a": ProviderLoad(0, ServerLoad(kv_cache_usage=0.9), now),
            "b": ProviderLoad(0, ServerLoad(kv_cache_usage=0.2), now),
        }
    )
    assert (await dispatcher.acquire("m", False)).provider_id == "b"


# -- prefix_affinity ----------------------------------------------------------------------------


async def test_a_conversation_stays_on_one_provider(pool) -> None:
    dispatcher = pool("prefix_affinity")
    for name in ("ada", "bob", "cyd", "dee", "eve"):
        homes = set()
        for key in conversation_turns(name, 6):
            lease = await dispatcher.acquire("m", False, prefix=key)
            homes.add(lease.provider_id)
            dispatcher.release(lease)
        assert len(homes) == 1, (name, homes)
    assert dispatcher.decisions() == {("m", "prefix_affinity", "affinity"): 30}


async def test_conversations_spread_over_the_providers(pool) -> None:
    dispatcher = pool("prefix_affinity")
    counts: Counter[str] = Counter()
    for index in range(400):
        lease = await dispatcher.acquire("m", False, prefix=chat(f"conversation {index}"))
        counts[lease.provider_id] += 1
        dispatcher.release(lease)
    # One system prompt for all: it is no point of theirs, so they do not pile on one provider.
    assert set(counts) == set("abcd")
    assert min(counts.values()) >= 60, counts


async def test_past_its_bound_the_home_overflows_to_the_least_loaded(pool, provider) -> None:
    dispatcher = pool(
        "prefix_affinity",
        providers=[provider(pid, capacity=8) for pid in "abcd"],
        load_factor=1.0,
    )
    turns = conversation_turns("busy", 3)
    home = rendezvous_order(turns[0].anchor, dispatcher.snapshot.models["m"].candidates)[0]
    home_id = home.provider.id
    held: list[Lease] = []
    # Other conversations that live on the same home fill it up, one at a time.
    others = [
        key
        for key in (chat(f"other {i}") for i in range(200))
        if rendezvous_order(key.anchor, dispatcher.snapshot.models["m"].candidates)[0] == home
    ]
    for key in others[:4]:
        held.append(await dispatcher.acquire("m", False, prefix=key))
    assert {lease.provider_id for lease in held} == {home_id}
    # Load 4 on the home, 0 elsewhere: the group of 32 slots counts as half busy (16), and the
    # home's share of it, ceil(1.0 x 16 x 8 / 32) = 4, leaves no room for a fifth.
    lease = await dispatcher.acquire("m", False, prefix=turns[0])
    assert lease.provider_id != home_id
    moved = lease.provider_id
    dispatcher.release(lease)
    assert dispatcher.decisions()[("m", "prefix_affinity", "overflow")] == 1
    # The conversation's new home is where it overflowed to: its next turn goes there.
    for held_lease in held:
        dispatcher.release(held_lease)
    follow = await dispatcher.acquire("m", False, prefix=turns[1])
    assert follow.provider_id == moved
    dispatcher.release(follow)


async def test_a_full_home_overflows_at_once(pool, provider) -> None:
    dispatcher = pool(
        "prefix_affinity", providers=[provider(pid, capacity=1) for pid in "ab"], load_factor=10
    )
    key = chat("one")
    first = await dispatcher.acquire("m", False, prefix=key)
    second = await dispatcher.acquire("m", False, prefix=key)
    assert {first.provider_id, second.provider_id} == {"a", "b"}  # capacity is never exceeded


async def test_two_replicas_choose_alike_without_talking(pool) -> None:
    first, second = pool("prefix_affinity"), pool("prefix_affinity")
    conversations = [conversation_turns(f"user {i}", 4) for i in range(30)]
    # Each turn goes to one replica or the other, as a Service would spread them.
    chosen: dict[int, set[str]] = {}
    for turn in range(4):
        for index, turns in enumerate(conversations):
            replica = first if (index + turn) % 2 else second
            lease = await replica.acquire("m", False, prefix=turns[turn])
            chosen.setdefault(index, set()).add(lease.provider_id)
            replica.release(lease)
    assert all(len(homes) == 1 for homes in chosen.values()), chosen


async def test_a_provider_that_leaves_moves_only_its_own_conversations(pool) -> None:
    dispatcher = pool("prefix_affinity")
    keys = [chat(f"question {i}") for i in range(120)]

    async def homes() -> list[str]:
        found = []
        for key in keys:
            lease = await dispatcher.acquire("m", False, prefix=key)
            found.append(lease.provider_id)
            dispatcher.release(lease)
        return found

    before = await homes()
    fresh = pool("prefix_affinity")  # no memory: only the hashing decides
    fresh.set_available("abc")
    after = []
    for key in keys:
        lease = await fresh.acquire("m", False, prefix=key)
        after.append(lease.provider_id)
        fresh.release(lease)
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == "d" for b, _ in moved)


async def test_priority_and_capacity_hold_under_every_policy(pool, provider) -> None:
    for policy in ("round_robin", "least_load", "prefix_affinity"):
        dispatcher = pool(
            policy,
            providers=[
                provider("main-1", priority=1, capacity=2),
                provider("main-2", priority=1, capacity=2),
                provider("spare", priority=5, capacity=2),
            ],
        )
        key = chat("the same conversation, again and again")
        chosen = [(await dispatcher.acquire("m", False, prefix=key)).provider_id for _ in range(6)]
        assert sorted(chosen[:4]) == ["main-1", "main-1", "main-2", "main-2"], policy
        assert chosen[4:] == ["spare", "spare"], policy
        assert dispatcher.try_acquire("m", False, prefix=key) is None


async def test_a_waiting_request_takes_the_slot_that_frees_first(pool, provider, until) -> None:
    dispatcher = pool("prefix_affinity", providers=[provider(pid, capacity=1) for pid in "ab"])
    held = [await dispatcher.acquire("m", False) for _ in range(2)]
    key = chat("patient")
    waiting = asyncio.ensure_future(dispatcher.acquire("m", False, prefix=key))
    await until(lambda: dispatcher.waiting == 1)
    home = rendezvous_order(key.anchor, dispatcher.snapshot.models["m"].candidates)[0]
    other = next(lease for lease in held if lease.provider_id != home.provider.id)
    dispatcher.release(other)  # work conservation: not its home, but free first
    lease = await waiting
    assert lease.provider_id == other.provider_id
    assert dispatcher.decisions()[("m", "prefix_affinity", "freed_slot")] == 1
    for remaining in (*held, lease):
        dispatcher.release(remaining)
    # Where it went is its home now.
    again = await dispatcher.acquire("m", False, prefix=key)
    assert again.provider_id == other.provider_id


async def test_a_freed_slot_serves_first_a_waiting_turn_whose_conversation_lives_there(
    pool, provider, until
) -> None:
    dispatcher = pool("prefix_affinity", providers=[provider(pid, capacity=1) for pid in "ab"])
    talk = conversation_turns("x", MAX_PASSED + 2)
    first = await dispatcher.acquire("m", False, prefix=talk[0])
    other = await dispatcher.acquire("m", False, prefix=chat("y: question 0"))
    assert other.provider_id != first.provider_id
    newcomer = asyncio.ensure_future(dispatcher.acquire("m", False, prefix=chat("new")))
    await until(lambda: dispatcher.waiting == 1)
    # The newcomer waits first and is known nowhere; each next turn of "x" is known where "x"
    # lives: a slot freed there serves the turn, at most MAX_PASSED times ahead of the newcomer.
    lease = first
    for turn in talk[1 : MAX_PASSED + 1]:
        follow = asyncio.ensure_future(dispatcher.acquire("m", False, prefix=turn))
        await until(lambda: dispatcher.waiting == 2)
        dispatcher.release(lease)
        lease = await follow
        assert lease.provider_id == first.provider_id
        assert not newcomer.done()
    assert dispatcher.decisions()[("m", "prefix_affinity", "freed_slot_home")] == MAX_PASSED
    last = asyncio.ensure_future(dispatcher.acquire("m", False, prefix=talk[-1]))
    await until(lambda: dispatcher.waiting == 2)
    dispatcher.release(lease)  # passed MAX_PASSED times: the newcomer's turn now
    assert (await newcomer).provider_id == first.provider_id
    dispatcher.release(other)  # a slot where "x" is not known: the fair order alone
    assert (await last).provider_id == other.provider_id
    assert dispatcher.decisions()[("m", "prefix_affinity", "freed_slot")] == 2


async def test_a_policy_change_applies_live_and_forgets_prefix_homes(pool, config_of, provider):
    dispatcher = pool("prefix_affinity")
    lease = await dispatcher.acquire("m", False, prefix=chat("remember me"))
    assert dispatcher.prefix_homes("m") > 0
    config = config_of(
        [provider(p) for p in "abcd"], model_settings={"m": {"dispatch": {"policy": "least_load"}}}
    )
    dispatcher.swap(PoolSnapshot.build(config, 2))
    assert dispatcher.prefix_homes("m") == 0
    dispatcher.release(lease)  # a lease of the old snapshot gives its slot back as ever
    assert dispatcher.in_flight(lease.provider_id) == 0
    assert (await dispatcher.acquire("m", False)).provider_id in "abcd"
    assert ("m", "least_load", "least_load") in dispatcher.decisions()


# -- prefix points ------------------------------------------------------------------------------


def test_every_turn_of_a_conversation_keeps_its_anchor_and_adds_points() -> None:
    turns = conversation_turns("zoe", 3)
    assert len({key.anchor for key in turns}) == 1
    for before, after in itertools.pairwise(turns):
        assert after.points[: len(before.points)] == before.points
        assert len(after.points) == len(before.points) + 2  # an answer and a question


def test_a_shared_system_prompt_is_no_point() -> None:
    one, two = chat("first question"), chat("second question")
    assert not set(one.points) & set(two.points)


def test_text_prompts_are_cut_in_blocks_and_embeddings_have_no_key() -> None:
    long_prompt = "x" * 1000
    key = prefix_key(
        parse_request("completion", orjson.dumps({"model": "m", "prompt": long_prompt}))
    )
    assert key is not None and len(key.points) == 1000 // 256
    longer = prefix_key(
        parse_request("completion", orjson.dumps({"model": "m", "prompt": long_prompt + "y" * 300}))
    )
    assert longer is not None and longer.points[: len(key.points)] == key.points
    short = prefix_key(parse_request("completion", orjson.dumps({"model": "m", "prompt": [1, 2]})))
    assert short is not None and len(short.points) == 1
    embedding = parse_request("embedding", orjson.dumps({"model": "m", "input": "hi"}))
    assert prefix_key(embedding) is None


# -- prefill waiting at a home -------------------------------------------------------------------


def homed_at(dispatcher: Dispatcher, home: str, count: int, name: str) -> list[PrefixKey]:
    """`count` first turns of new conversations whose rendezvous home is `home`."""
    candidates = dispatcher.snapshot.models["m"].candidates
    keys = (chat(f"{name} {i}") for i in itertools.count())
    found = (key for key in keys if rendezvous_order(key.anchor, candidates)[0].provider.id == home)
    return list(itertools.islice(found, count))


async def test_a_home_with_prefill_waiting_passes_the_turn_to_a_free_provider(
    pool, provider
) -> None:
    dispatcher = pool("prefix_affinity", providers=[provider(pid, capacity=8) for pid in "abcd"])
    turns = conversation_turns("patient", 3)
    first = await dispatcher.acquire("m", False, prefix=turns[0])
    home = first.provider_id
    dispatcher.started(first)
    dispatcher.release(first)
    # Two new conversations start at the same home: their whole prompts wait for prefill there,
    # more bytes than the next turn's whole prompt on an idle provider.
    others = [
        await dispatcher.acquire("m", False, prefix=key)
        for key in homed_at(dispatcher, home, 2, "newcomer")
    ]
    assert {lease.provider_id for lease in others} == {home}
    waiting = sum(lease.prefill for lease in others)
    assert dispatcher.pending_prefill(home) == waiting > turns[1].size
    moved = await dispatcher.acquire("m", False, prefix=turns[1])
    assert moved.provider_id != home
    assert moved.prefill == turns[1].size  # the whole prompt: nothing of it is known there
    assert dispatcher.decisions()[("m", "prefix_affinity", "backlog")] == 1
    dispatcher.started(moved)
    dispatcher.release(moved)
    # Their prefill done (a first event each), the newcomers weigh nothing while they run on.
    for lease in others:
        dispatcher.started(lease)
    assert dispatcher.pending_prefill(home) == 0
    assert [dispatcher.in_flight(home), dispatcher.in_flight(moved.provider_id)] == [2, 0]
    # The conversation's new home keeps its next turn, with only what is new to prefill there.
    follow = await dispatcher.acquire("m", False, prefix=turns[2])
    assert follow.provider_id == moved.provider_id
    assert follow.prefill == turns[2].size - turns[1].size
    for lease in (*others, follow):
        dispatcher.release(lease)
    assert all(dispatcher.pending_prefill(pid) == 0 for pid in "abcd")


async def test_the_home_keeps_a_turn_while_its_waiting_prefill_is_the_cheaper(
    pool, provider
) -> None:
    dispatcher = pool("prefix_affinity", providers=[provider(pid, capacity=8) for pid in "abcd"])
    turns = conversation_turns("loyal", 2)
    first = await dispatcher.acquire("m", False, prefix=turns[0])
    home = first.provider_id
    dispatcher.release(first)  # given back before its first event: its prefill goes with it
    assert dispatcher.pending_prefill(home) == 0
    other = await dispatcher.acquire("m", False, prefix=homed_at(dispatcher, home, 1, "new")[0])
    # One newcomer's prompt waits there: less than the turn's whole prompt elsewhere.
    assert other.prefill + (turns[1].size - turns[0].size) < turns[1].size
    follow = await dispatcher.acquire("m", False, prefix=turns[1])
    assert follow.provider_id == home
    assert dispatcher.pending_prefill(home) == other.prefill + follow.prefill
    for lease in (other, follow):
        dispatcher.release(lease)
    assert dispatcher.pending_prefill(home) == 0


async def test_a_prompt_never_seen_goes_by_rendezvous_whatever_waits_there(pool, provider) -> None:
    # Another replica may have sent its conversation's earlier turns there.
    dispatcher = pool("prefix_affinity", providers=[provider(pid, capacity=8) for pid in "abcd"])
    held = [
        await dispatcher.acquire("m", False, prefix=key)
        for key in homed_at(dispatcher, "a", 3, "crowd")
    ]
    assert dispatcher.pending_prefill("a") > 3 * len(SYSTEM)
    newcomer = homed_at(dispatcher, "a", 4, "crowd")[3]
    lease = await dispatcher.acquire("m", False, prefix=newcomer)
    assert lease.provider_id == "a"
    for each in (*held, lease):
        dispatcher.release(each)


def test_each_point_carries_the_prompt_bytes_it_covers() -> None:
    turns = conversation_turns("sized", 3)
    for key in turns:
        assert len(key.sizes) == len(key.points)
        assert list(key.sizes) == sorted(set(key.sizes))  # each point covers more
        assert key.sizes[-1] == key.size  # the last point is the whole prompt
    # A turn's prompt begins with the turn before it: the sizes of its points carry over.
    assert turns[1].sizes[: len(turns[0].sizes)] == turns[0].sizes
    # The system prompt counts in every point's size, though it is no point itself.
    assert turns[0].size > len(SYSTEM) > 0
    text = prefix_key(
        parse_request("completion", orjson.dumps({"model": "m", "prompt": "x" * 600}))
    )
    assert text is not None
    assert (text.sizes, text.size) == ((256, 512), 600)
