"""The payload rule of a Node serving several Edge replicas (iop.node.arbitrating), on its own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from iop.edgeconfig import NodePayload, ProviderPayload
from iop.node import PayloadArbiter
from iop.providers import Runner


def payload(capacity: int) -> NodePayload:
    provider = ProviderPayload(
        id="p1",
        adapter={"type": "fake"},
        served_models=("served",),
        enabled=True,
        capacity=capacity,
        long_context_slots=None,
    )
    return NodePayload(node_id="node-1", alias=None, providers=(provider,))


@pytest.fixture
async def arbiter() -> AsyncIterator[PayloadArbiter]:
    runner = Runner(drain_timeout=1.0)
    yield PayloadArbiter(runner)
    await runner.aclose()


async def test_the_first_offer_applies_and_a_disagreeing_one_waits(arbiter) -> None:
    old, new = payload(4), payload(6)
    assert arbiter.offer("a", old, old.digest)
    assert not arbiter.offer("b", new, new.digest)
    assert arbiter.in_use == old.digest
    assert arbiter.offer("a", new, new.digest)  # now both agree
    assert arbiter.in_use == new.digest


async def test_flip_flopping_offers_never_flip_the_node(arbiter) -> None:
    old, new = payload(4), payload(6)
    arbiter.offer("a", old, old.digest)
    arbiter.offer("b", old, old.digest)
    for _ in range(5):
        arbiter.offer("a", new, new.digest)
        arbiter.offer("a", old, old.digest)
        arbiter.offer("b", new, new.digest)
        arbiter.offer("b", old, old.digest)
    assert arbiter.in_use == old.digest


async def test_a_payload_no_edge_offers_any_more_gives_way_to_the_most_common(arbiter) -> None:
    old, new, newer = payload(4), payload(6), payload(8)
    arbiter.offer("a", old, old.digest)
    arbiter.offer("b", new, new.digest)
    arbiter.offer("c", new, new.digest)
    assert arbiter.in_use == old.digest
    arbiter.withdraw("a")  # the replica with the payload in use went away
    assert arbiter.in_use == new.digest
    arbiter.offer("d", newer, newer.digest)
    assert arbiter.in_use == new.digest  # still offered by b and c


async def test_ties_go_to_the_payload_offered_last(arbiter) -> None:
    old, new, newer = payload(4), payload(6), payload(8)
    arbiter.offer("a", old, old.digest)
    arbiter.offer("b", new, new.digest)
    arbiter.offer("c", newer, newer.digest)
    arbiter.withdraw("a")
    assert arbiter.in_use == newer.digest
