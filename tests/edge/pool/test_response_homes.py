"""Affinity by response id: the bounded map of where each stored response lives, and a request
that must run on one provider (its `home`) waiting for that provider alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from iop.edge.pool.dispatching import Dispatcher
from iop.edge.pool.responsehomes import ResponseHome, ResponseHomes, answer_id, stream_id
from iop.edge.pool.snapshots import PoolSnapshot
from iop.fakes.responses import ResponseStore, parse_response_request

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


def test_the_least_recently_used_is_forgotten_past_the_limit() -> None:
    homes = ResponseHomes(limit=2)
    homes.record("a", "p1", "m")
    homes.record("b", "p2", "m")
    assert homes.find("a") == ResponseHome("p1", "m")  # now the most recently used
    homes.record("c", "p1", "m")
    assert homes.find("b") is None and homes.find("a") is not None and len(homes) == 2
    assert homes.forgotten == 1
    homes.forget("a")
    assert homes.find("a") is None
    homes.record("x" * 300, "p1", "m")  # no real server's id: not kept
    assert len(homes) == 1


def test_ids_are_read_from_an_answer_and_a_streams_first_event() -> None:
    answer = parse_response_request(
        b'{"model": "m", "input": "x"}', default_tokens=2, models=(), now=1, store=ResponseStore()
    )
    assert answer_id(answer.body()) == answer.id
    assert stream_id(b"".join(answer.opening_events())) == answer.id
    created = {"type": "response.created", "response": {"id": "resp_1"}}
    assert (
        stream_id(b"event: response.created\r\ndata: " + orjson.dumps(created) + b"\r\n\r\n")
        == "resp_1"
    )
    assert answer_id(b"not json") is None and stream_id(b"data: [1]\n\n") is None


@pytest.fixture
def pool(config_of) -> Callable[..., Dispatcher]:
    def build(*providers: dict[str, Any]) -> Dispatcher:
        dispatcher = Dispatcher(PoolSnapshot.build(config_of(list(providers))))
        dispatcher.set_available(p["id"] for p in providers)
        return dispatcher

    return build


async def test_a_request_with_a_home_runs_there_or_waits_for_it(pool, provider) -> None:
    dispatcher = pool(provider("a", capacity=1), provider("b", capacity=1))
    on_b = await dispatcher.acquire("m", False, home="b")
    assert on_b.provider_id == "b"
    assert dispatcher.try_acquire("m", False, home="b") is None  # b is full, a is free
    waiting = asyncio.ensure_future(dispatcher.acquire("m", False, home="b"))
    await asyncio.sleep(0)
    on_a = await dispatcher.acquire("m", False)  # a's free slot goes to whoever may use it...
    assert on_a.provider_id == "a"
    dispatcher.release(on_a)  # ...and a freed slot of a never serves the request for b
    await asyncio.sleep(0)
    assert not waiting.done()
    dispatcher.release(on_b)
    lease = await asyncio.wait_for(waiting, 1)
    assert lease.provider_id == "b"
    assert dispatcher.decisions()[("m", "round_robin", "response_home")] == 2
    dispatcher.release(lease)


async def test_a_home_out_of_dispatch_is_waited_for(pool, provider) -> None:
    dispatcher = pool(provider("a", capacity=1), provider("b", capacity=1))
    dispatcher.set_available(["a"])
    waiting = asyncio.ensure_future(dispatcher.acquire("m", False, home="b"))
    await asyncio.sleep(0)
    assert not waiting.done()
    dispatcher.set_available(["a", "b"])  # its node came back
    lease = await asyncio.wait_for(waiting, 1)
    assert lease.provider_id == "b"
    dispatcher.release(lease)
