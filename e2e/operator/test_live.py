"""Live changes through the operator: `kubectl apply` -> Applied, nothing restarted, the change
seen through real requests with the official `openai` client, and no request lost meanwhile.

The Edge and its Nodes run as processes on the host here (the operator is told their admin
API); the same classes run on pods in `test_pods.py`.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import openai
import pytest

from testkit import find_provider

if TYPE_CHECKING:
    from e2e.operator.conftest import HostStack

pytestmark = pytest.mark.e2e

LONG = "lorem ipsum " * 600  # about 1,800 tokens by the Edge's estimate: long at 1,000


async def served(stack: HostStack, model: str = "m", content: str = "hi") -> str:
    async with stack.client() as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}]
        )
    return reply.model


async def two_at_once(stack: HostStack) -> list[int]:
    async def one() -> int:
        async with stack.client() as client:
            try:
                await client.chat.completions.create(
                    model="solo", messages=[{"role": "user", "content": "hi"}]
                )
            except openai.APIStatusError as error:
                return error.status_code
            return 200

    return sorted(await asyncio.gather(one(), one()))


async def completion_tokens(stack: HostStack) -> int:
    async with stack.client() as client:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
    assert reply.usage is not None
    return reply.usage.completion_tokens


async def model_ids(stack: HostStack) -> list[str]:
    async with stack.client() as client:
        return sorted([model.id async for model in client.models.list()])


Spec = dict[str, Any]
Observe = Callable[["HostStack"], Awaitable[object]]


def edit_priority(spec: Spec) -> None:
    find_provider(spec, "pa")["priority"] = 20


def edit_capacity(spec: Spec) -> None:
    find_provider(spec, "pd")["capacity"] = 2


def edit_enabled(spec: Spec) -> None:
    find_provider(spec, "pa")["enabled"] = False


def edit_models(spec: Spec) -> None:
    spec["models"] = [m for m in spec["models"] if m["id"] != "solo"]
    spec["models"].append({"id": "extra", "providers": {"pc": "served-c"}})


def edit_generation(spec: Spec) -> None:
    spec["models"][0]["generation"] = {"maxTokens": 3}


def edit_threshold(spec: Spec) -> None:
    spec["openai"]["longContextThresholdTokens"] = 100000


LIVE_CLASSES = [
    pytest.param(
        edit_priority,
        ["nodes[node-1].providers[pa].priority"],
        lambda s: served(s),
        "served-a",
        "served-b",
        id="priority",
    ),
    pytest.param(
        edit_capacity,
        ["nodes[node-1].providers[pd].capacity"],
        two_at_once,
        [200, 429],
        [200, 200],
        id="capacity",
    ),
    pytest.param(
        edit_enabled,
        ["nodes[node-1].providers[pa].enabled"],
        lambda s: served(s),
        "served-a",
        "served-b",
        id="enabled",
    ),
    pytest.param(
        edit_models,
        ["models[extra]", "models[solo]"],
        model_ids,
        ["m", "n", "solo"],
        ["extra", "m", "n"],
        id="add-and-remove-a-model",
    ),
    pytest.param(
        edit_generation,
        ["models[m].generation.maxTokens"],
        completion_tokens,
        8,
        3,
        id="generation-policy",
    ),
    pytest.param(
        edit_threshold,
        ["openai.longContextThresholdTokens"],
        lambda s: served(s, content=LONG),
        "served-b",  # long: only pb has a long slot
        "served-a",  # no longer long: the lowest priority wins
        id="long-context-threshold",
    ),
]


async def test_create_becomes_ready_and_the_edge_serves_every_model(
    operated, edgeconfigs, host_spec
) -> None:
    spec = host_spec()
    stack = await operated(spec)

    ec = await asyncio.to_thread(edgeconfigs.get, "demo")
    status = ec["status"]
    assert status["pendingRestart"] == "none"
    assert status["nodesAcked"] == "2/2"
    assert [r["state"] for r in status["replicas"]] == ["Applied"]
    assert status["appliedConfigHash"] == status["desiredConfigHash"]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Reconciling": "False",
        "Stalled": "False",
        "Valid": "True",
        "Applied": "True",
        "Progressing": "False",
        "Degraded": "False",
        "Ready": "True",
    }
    for model, name in (("m", "served-a"), ("solo", "served-d"), ("n", "served-c")):
        assert await served(stack, model) == name
    reasons = [e["reason"] for e in await asyncio.to_thread(edgeconfigs.events, "demo")]
    assert {"Validated", "AppliedLive", "Ready"} <= set(reasons)


@pytest.mark.parametrize(("edit", "paths", "observe", "before", "after"), LIVE_CLASSES)
async def test_a_live_change_applies_without_restarting_anything(
    operated,
    edgeconfigs,
    host_spec,
    edit: Callable[[Spec], None],
    paths: list[str],
    observe: Observe,
    before: object,
    after: object,
) -> None:
    spec = host_spec()
    stack = await operated(spec)
    assert await observe(stack) == before
    pids = stack.pids()

    changed = copy.deepcopy(spec)
    edit(changed)
    await asyncio.to_thread(edgeconfigs.apply, "demo", changed)
    ec = await asyncio.to_thread(edgeconfigs.wait, "demo", generation=2)

    assert ec["status"]["lastChange"]["livePaths"] == paths
    assert ec["status"]["lastChange"]["restartPaths"] == []
    assert stack.pids() == pids
    assert await observe(stack) == after


async def test_a_load_runs_through_every_live_apply_without_a_failed_request(
    operated, edgeconfigs, host_spec
) -> None:
    spec = host_spec()
    stack = await operated(spec)
    pids = stack.pids()
    done = asyncio.Event()
    outcomes: list[str] = []

    async def load() -> None:
        async with stack.client() as client:
            while not done.is_set():
                try:
                    reply = await client.chat.completions.create(
                        model="n", messages=[{"role": "user", "content": "hi"}]
                    )
                    outcomes.append(reply.model)
                except openai.APIError as error:
                    outcomes.append(f"failed: {error!r}")

    workers = [asyncio.create_task(load(), name=f"load-{i}") for i in range(4)]
    try:
        generation = 1
        edits: list[Callable[[Spec], None]] = [
            edit_priority,
            edit_capacity,
            edit_enabled,
            edit_models,
            edit_generation,
            edit_threshold,
            lambda s: find_provider(s, "pc").update(capacity=6),  # pushed to node-2
            lambda s: find_provider(s, "pc").update(capacity=4, maxQueue=32),
        ]
        for edit in edits:
            edit(spec)
            generation += 1
            await asyncio.to_thread(edgeconfigs.apply, "demo", spec)
            await asyncio.to_thread(edgeconfigs.wait, "demo", generation=generation)
    finally:
        done.set()
        await asyncio.gather(*workers)

    failed = [o for o in outcomes if o.startswith("failed")]
    assert failed == []
    assert len(outcomes) > 50
    assert set(outcomes) == {"served-c"}
    assert stack.pids() == pids
