"""An in-process Edge with nodes placed on it (the `fake` adapter): what a continuation gets when
the provider that holds its previous response has left the config (410), or does not serve the
model it asks for (400), as a replica that learned the holder from the shared store would see."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from iop.edge import EdgeServer
from iop.edge.pool import PoolSnapshot, ResponseHome, Split
from testkit import CLIENT_TOKEN, provider

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


@pytest.fixture
async def edge(
    start_edge: Callable[..., Awaitable[EdgeServer]], document_of: Callable[..., dict[str, Any]]
) -> EdgeServer:
    document = document_of(
        [provider("p1", served="served"), provider("p2", served="other")],
        {"m": ["p1"], "m2": ["p2"]},
        placement="edge",
    )
    return await start_edge(document)


def client(edge: EdgeServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=CLIENT_TOKEN, max_retries=0)


async def test_a_holder_that_left_the_config_is_gone(edge: EdgeServer) -> None:
    edge.app.response_homes.record("resp_old", "p-removed", "m")
    async with client(edge) as openai_client:
        with pytest.raises(openai.APIStatusError) as gone:
            await openai_client.responses.create(
                model="m", input="x", previous_response_id="resp_old"
            )
        assert (gone.value.status_code, gone.value.code) == (410, "response_holder_gone")
        assert "'resp_old' is held by provider `p-removed`" in gone.value.message
        with pytest.raises(openai.APIStatusError) as lookup:
            await openai_client.responses.retrieve("resp_old")
        assert lookup.value.status_code == 410


async def test_a_holder_that_does_not_serve_the_model_is_named(edge: EdgeServer) -> None:
    async with client(edge) as openai_client:
        first = await openai_client.responses.create(model="m", input="x")
        with pytest.raises(openai.BadRequestError) as refused:
            await openai_client.responses.create(
                model="m2", input="x", previous_response_id=first.id
            )
        assert refused.value.code == "previous_response_model_mismatch"
        assert refused.value.param == "model"
        turn = await openai_client.responses.create(
            model="m", input="x", previous_response_id=first.id
        )
        assert turn.previous_response_id == first.id


async def test_on_trial_a_continuation_runs_on_the_revision_that_has_its_holder(
    start_edge: Callable[..., Awaitable[EdgeServer]],
    document_of: Callable[..., dict[str, Any]],
    config_of: Callable[..., Any],
) -> None:
    providers = [provider("p1"), provider("p2")]
    edge = await start_edge(document_of(providers, {"m": ["p1", "p2"]}, placement="edge"))
    stable = edge.dispatcher.snapshot
    async with client(edge) as openai_client:
        held: dict[str, str] = {}
        while len(held) < 2:
            response = await openai_client.responses.create(model="m", input="x")
            held[edge.app.response_homes.find(response.id).provider_id] = response.id  # type: ignore[union-attr]
        # A change on trial takes p1 out of `m` for every request of it (share 100%).
        candidate = PoolSnapshot.build(
            config_of(providers, {"m": ["p2"], "z": ["p1"]}, placement="edge")
        )
        edge.dispatcher.swap(candidate, Split(stable, frozenset({"m"}), frozenset({"m"}), 100))
        turn = await openai_client.responses.create(
            model="m", input="more", previous_response_id=held["p1"]
        )
        assert edge.app.response_homes.find(turn.id) == ResponseHome("p1", "m")
        fresh = await openai_client.responses.create(model="m", input="new")
        assert edge.app.response_homes.find(fresh.id) == ResponseHome("p2", "m")
