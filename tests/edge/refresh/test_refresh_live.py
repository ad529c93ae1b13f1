"""Every live field takes effect without a restart, observed through real requests.

An in-process Edge (real sockets: the OpenAI API, the admin API, the node hub) and an in-process
Node over real gRPC; each test applies a candidate through `POST /refresh` and watches requests
behave differently on the same Edge, the same Node and the same adapters.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from testkit import find_provider

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

LONG_CONTENT = "lorem ipsum " * 600  # ~7,000 bytes: long-context at a threshold of 1,000 tokens


def only_pa(document: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """Model m on pa alone, pa slow enough that two requests overlap."""
    document["models"][0]["providers"] = {"pa": "served-a"}
    find_provider(document, "pa").update(adapter={"type": "fake", "latency_ms": 400}, **settings)
    return document


def acked(report: dict[str, Any], *nodes: str) -> None:
    assert report["outcome"] == "applied", report
    assert [(p["node_id"], p["status"]) for p in report["pushes"]] == [
        (node, "acked") for node in nodes
    ], report["pushes"]


async def test_priority(refresh_stack, refresh_document) -> None:
    stack = await refresh_stack()
    assert stack.served(await stack.chat()) == "served-a"

    document = refresh_document()
    find_provider(document, "pa")["priority"] = 20
    report = await stack.refresh(document)

    assert report["live_paths"] == ["nodes[node-1].providers[pa].priority"]
    acked(report)  # priority is the Edge's alone: nothing to push
    assert report["nodes_to_push"] == []
    assert {stack.served(await stack.chat()) for _ in range(4)} == {"served-b"}


async def test_capacity_raised_admits_more_and_lowered_holds_admissions_without_cutting_runs(
    refresh_stack, refresh_document, until
) -> None:
    document = only_pa(refresh_document(), capacity=1, max_queue=0)
    stack = await refresh_stack(document)
    dispatcher = stack.edge.dispatcher
    first, second = await asyncio.gather(stack.chat(), stack.chat())
    assert sorted([first.status_code, second.status_code]) == [200, 429]

    find_provider(document, "pa").update(capacity=3)
    acked(await stack.refresh(document), "node-1")
    assert stack.node.runner.registry.provisions["pa"].payload.capacity == 3
    answers = await asyncio.gather(*(stack.chat() for _ in range(3)))
    assert [a.status_code for a in answers] == [200, 200, 200]

    # Lowered below the runs in flight: they all finish; a new request waits for room.
    runs = [asyncio.create_task(stack.chat()) for _ in range(3)]
    await until(lambda: dispatcher.in_flight("pa") == 3)
    find_provider(document, "pa").update(capacity=1, max_queue=4)
    acked(await stack.refresh(document), "node-1")
    late = asyncio.create_task(stack.chat())
    await until(lambda: dispatcher.queue_depth("m") == 1)
    assert dispatcher.in_flight("pa") == 3
    assert [r.status_code for r in await asyncio.gather(*runs)] == [200, 200, 200]
    assert (await late).status_code == 200
    assert dispatcher.in_flight_counts()["pa"] == (0, 0)


async def test_max_queue(refresh_stack, refresh_document) -> None:
    document = only_pa(refresh_document(), capacity=1, max_queue=0)
    stack = await refresh_stack(document)
    answers = await asyncio.gather(stack.chat(), stack.chat())
    assert sorted(a.status_code for a in answers) == [200, 429]

    find_provider(document, "pa")["max_queue"] = 1
    report = await stack.refresh(document)
    acked(report)
    assert report["live_paths"] == ["nodes[node-1].providers[pa].max_queue"]
    answers = await asyncio.gather(stack.chat(), stack.chat())
    assert [a.status_code for a in answers] == [200, 200]


async def test_queue_timeout(refresh_stack, refresh_document) -> None:
    document = only_pa(refresh_document(), capacity=1, max_queue=4, queue_timeout_ms=30_000)
    stack = await refresh_stack(document)
    answers = await asyncio.gather(stack.chat(), stack.chat())
    assert [a.status_code for a in answers] == [200, 200]  # the second waited its turn

    find_provider(document, "pa")["queue_timeout_ms"] = 100
    acked(await stack.refresh(document))
    answers = await asyncio.gather(stack.chat(), stack.chat())
    assert sorted(a.status_code for a in answers) == [200, 503]
    timed_out = next(a for a in answers if a.status_code == 503)
    assert timed_out.json()["error"]["code"] == "queue_timeout"


async def test_enabled_takes_a_provider_out_of_dispatch_without_restarting_its_adapter(
    refresh_stack, refresh_document
) -> None:
    stack = await refresh_stack()
    assert stack.served(await stack.chat()) == "served-a"
    adapter = stack.node.runner.registry.provisions["pa"].adapter

    document = refresh_document()
    find_provider(document, "pa")["enabled"] = False
    acked(await stack.refresh(document), "node-1")
    assert {stack.served(await stack.chat()) for _ in range(4)} == {"served-b"}
    assert stack.node.runner.registry.provisions["pa"].adapter is adapter
    assert not adapter.closed

    find_provider(document, "pa")["enabled"] = True
    acked(await stack.refresh(document), "node-1")
    assert stack.served(await stack.chat()) == "served-a"
    assert stack.node.runner.registry.provisions["pa"].adapter is adapter


async def test_models_added_and_removed(refresh_stack, refresh_document, refresh_client_token):
    stack = await refresh_stack()
    document = refresh_document()
    document["models"].append({"id": "m2", "providers": {"pb": "served-b"}})
    report = await stack.refresh(document)
    acked(report)
    assert (report["changed_models"], report["live_paths"]) == (["m2"], ["models[m2]"])

    async with openai.AsyncOpenAI(
        base_url=f"{stack.edge.url}/v1", api_key=refresh_client_token, max_retries=0
    ) as client:
        assert [m.id async for m in client.models.list()] == ["m", "m2"]
        reply = await client.chat.completions.create(
            model="m2", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.model == "served-b"

        document["models"].pop()
        acked(await stack.refresh(document))
        assert [m.id async for m in client.models.list()] == ["m"]
        with pytest.raises(openai.NotFoundError) as refused:
            await client.chat.completions.create(
                model="m2", messages=[{"role": "user", "content": "hi"}]
            )
        assert refused.value.code == "model_not_found"


async def test_fallbacks_and_the_retry_settings(refresh_stack, refresh_document) -> None:
    document = refresh_document()
    document["models"][0]["providers"] = {"pa": "served-a"}
    find_provider(document, "pa")["enabled"] = False  # m has no provider in dispatch
    document["models"].append({"id": "other", "providers": {"pb": "served-b"}})
    stack = await refresh_stack(document)
    refused = await stack.chat()
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "no_provider")

    document["models"][0]["fallbacks"] = ["other"]
    document["openai"]["retries"] = {"budget_percent": 10, "max_per_request": 1}
    report = await stack.refresh(document)
    acked(report)  # the Edge's alone: nothing to push
    assert report["live_paths"] == [
        "models[m].fallbacks",
        "openai.retries.budget_percent",
        "openai.retries.max_per_request",
    ]
    assert stack.served(await stack.chat()) == "served-b"
    assert stack.edge.dispatcher.snapshot.retries.max_per_request == 1

    # A fallback cycle is refused with its path, and nothing changes.
    cyclic = refresh_document()
    cyclic["models"] = [*document["models"][:1], {**document["models"][1], "fallbacks": ["m"]}]
    cyclic["nodes"] = document["nodes"]
    invalid = await stack.refresh(cyclic, status=422)
    assert [(p["path"], p["message"]) for p in invalid["problems"]] == [
        ("models[1].fallbacks[0]", "fallbacks must not form a cycle: m -> other -> m")
    ]
    assert stack.served(await stack.chat()) == "served-b"


async def test_first_byte_timeout(refresh_stack, refresh_document) -> None:
    document = only_pa(refresh_document(), capacity=4)  # pa's first byte comes after 400 ms
    document["openai"]["retries"] = {"max_per_request": 0}
    stack = await refresh_stack(document)
    assert (await stack.chat()).status_code == 200

    document["models"][0]["first_byte_timeout_ms"] = 100
    report = await stack.refresh(document)
    acked(report)  # the Edge's alone: nothing to push
    assert report["live_paths"] == ["models[m].first_byte_timeout_ms"]
    late = await stack.chat()
    assert (late.status_code, late.json()["error"]["code"]) == (504, "upstream_timeout")
    assert stack.edge.dispatcher.in_flight_counts()["pa"] == (0, 0)

    document["models"][0]["first_byte_timeout_ms"] = 2_000
    acked(await stack.refresh(document))
    assert (await stack.chat()).status_code == 200


async def test_generation_policy(refresh_stack, refresh_document) -> None:
    stack = await refresh_stack()
    assert (await stack.chat()).json()["usage"]["completion_tokens"] == 4

    document = refresh_document()
    document["models"][0]["generation"] = {"max_tokens": 2}
    report = await stack.refresh(document)
    acked(report)
    assert report["live_paths"] == ["models[m].generation.max_tokens"]
    answer = (await stack.chat()).json()
    assert answer["usage"]["completion_tokens"] == 2
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_long_context_slots_and_threshold(refresh_stack, refresh_document) -> None:
    # m on pa alone (capacity 2, one long slot, no queue): a second long request finds no room.
    document = only_pa(refresh_document(), capacity=2, long_context_slots=1, max_queue=0)
    stack = await refresh_stack(document)
    long = {"messages": [{"role": "user", "content": LONG_CONTENT}]}
    answers = await asyncio.gather(stack.chat(**long), stack.chat(**long))
    assert sorted(a.status_code for a in answers) == [200, 429]

    find_provider(document, "pa")["long_context_slots"] = 2
    acked(await stack.refresh(document), "node-1")
    assert stack.node.runner.registry.provisions["pa"].payload.long_context_slots == 2
    answers = await asyncio.gather(stack.chat(**long), stack.chat(**long))
    assert [a.status_code for a in answers] == [200, 200]

    find_provider(document, "pa")["long_context_slots"] = 1
    acked(await stack.refresh(document), "node-1")
    answers = await asyncio.gather(stack.chat(**long), stack.chat(**long))
    assert sorted(a.status_code for a in answers) == [200, 429]

    # A higher threshold: the same requests are no longer long-context.
    document["openai"]["long_context_threshold_tokens"] = 100_000
    report = await stack.refresh(document)
    acked(report)
    assert report["live_paths"] == ["openai.long_context_threshold_tokens"]
    answers = await asyncio.gather(stack.chat(**long), stack.chat(**long))
    assert [a.status_code for a in answers] == [200, 200]


async def test_served_models(refresh_stack, refresh_document) -> None:
    stack = await refresh_stack()
    document = refresh_document()
    find_provider(document, "pa")["served_models"] = ["served-a", "served-x"]
    document["models"][0]["providers"]["pa"] = "served-x"
    report = await stack.refresh(document)
    acked(report, "node-1")
    assert report["live_paths"] == [
        "models[m].providers.pa",
        "nodes[node-1].providers[pa].served_models",
    ]
    assert stack.node.runner.registry.provisions["pa"].payload.served_models == (
        "served-a",
        "served-x",
    )
    assert stack.served(await stack.chat()) == "served-x"


async def test_a_lora_adapter_added_is_served_at_once_and_gone_once_removed(
    refresh_stack, refresh_document
) -> None:
    stack = await refresh_stack()
    assert (await stack.chat("sql")).status_code == 404

    document = refresh_document()
    document["models"][0]["adapters"] = ["sql"]
    report = await stack.refresh(document)
    assert report["live_paths"] == ["models[m].adapters"]
    acked(report)  # the Edge's alone: nothing to push
    # Its model's providers serve it under its own name, as vLLM serves an adapter.
    assert {stack.served(await stack.chat("sql")) for _ in range(4)} == {"sql"}
    listed = {m["id"]: m for m in (await stack.http.get("/v1/models")).json()["data"]}
    assert listed["sql"]["parent"] == "m" and "parent" not in listed["m"]

    document["models"][0]["adapters"] = []
    acked(await stack.refresh(document))
    assert (await stack.chat("sql")).status_code == 404
