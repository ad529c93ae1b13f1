"""A node placed on the Edge (`placement: edge`): an in-process Edge runs its provider against a
real `iop fake-upstream`, with no Node. Its capacity holds at the upstream, is shared among the
Edge replicas the peers Service lists (and follows a scale-up and a scale-down), changes live
with a refresh, and the admin API lists the node as the Edge's own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from iop.edge.hub import peering
from iop.processes import spawn_fake_upstream

pytestmark = pytest.mark.timeout(120)

#: Seconds between two lookups of the Edge replicas in these tests.
LOOKUP_S = 0.05


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[Any]:
    async with spawn_fake_upstream() as upstream:
        yield upstream


class Peers:
    """The peers Service's answer, as the test sets it: `count` Edge addresses."""

    def __init__(self) -> None:
        self.count = 1

    async def resolve(self, host: str, port: int) -> list[str]:
        assert (host, port) == ("edges.test", 7443)
        return [f"10.0.0.{i + 1}:{port}" for i in range(self.count)]


def placed_document(document_of: Any, upstream: Any, capacity: int) -> dict[str, Any]:
    document: dict[str, Any] = document_of(
        [
            {
                "id": "p1",
                "adapter": {"type": "openai", "base_url": upstream.base_url},
                "served_models": ["served"],
                "capacity": capacity,
                "max_queue": 64,
            }
        ],
        edge={"admin": {"listen": "127.0.0.1:0"}},
        placement="edge",
    )
    return document


async def peak_of(edge: Any, upstream: Any, tokens: dict[str, str], requests: int) -> int:
    """Send `requests` slow chats at once; the most the upstream ran at a time."""
    base = upstream.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base) as http:
        assert (await http.post("/fake/reset")).status_code == 200
        async with openai.AsyncOpenAI(
            base_url=f"{edge.url}/v1", api_key=tokens["search-chat"], max_retries=0, timeout=60
        ) as client:
            answers = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="m",
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=3,
                        extra_body={"fake_upstream": {"latency_ms": 150}},
                    )
                    for _ in range(requests)
                )
            )
        assert all(answer.choices[0].message.content for answer in answers)
        stats = (await http.get("/fake/stats")).json()
    assert stats["completions"] == requests
    return int(stats["peak_in_flight"])


async def test_capacity_holds_at_the_upstream_and_is_shared_among_the_edge_replicas(
    document_of, start_edge, upstream, tokens, until, monkeypatch
) -> None:
    monkeypatch.setattr(peering, "PEER_LOOKUP_S", LOOKUP_S)
    peers = Peers()
    edge = await start_edge(
        placed_document(document_of, upstream, capacity=4),
        peers_service="edges.test:7443",
        resolve=peers.resolve,
    )
    await until(lambda: edge.dispatcher.available == {"p1"})
    # Alone, the Edge runs up to the provider's whole capacity, and never more.
    assert await peak_of(edge, upstream, tokens, 10) == 4

    # Scale-up: two replicas, each takes half (and says so on /metrics).
    peers.count = 2
    await until(lambda: edge.dispatcher.snapshot.edge_replicas == 2)
    assert edge.dispatcher.snapshot.providers["p1"].capacity == 2
    assert await peak_of(edge, upstream, tokens, 10) == 2
    text = edge.metrics.render().decode()
    assert 'iop_edge_provider_capacity{provider="p1"} 2.0' in text
    assert "iop_edge_replicas 2.0" in text

    # More replicas than capacity: one run each (the documented overshoot).
    peers.count = 6
    await until(lambda: edge.dispatcher.snapshot.edge_replicas == 6)
    assert await peak_of(edge, upstream, tokens, 4) == 1

    # Scale-down: alone again, the whole capacity.
    peers.count = 1
    await until(lambda: edge.dispatcher.snapshot.edge_replicas == 1)
    assert await peak_of(edge, upstream, tokens, 10) == 4


async def test_a_lookup_that_fails_keeps_the_share(
    document_of, start_edge, upstream, until, monkeypatch
) -> None:
    monkeypatch.setattr(peering, "PEER_LOOKUP_S", LOOKUP_S)
    lookups: list[int] = []

    async def resolve(host: str, port: int) -> list[str]:
        lookups.append(port)
        if len(lookups) == 1:
            return ["10.0.0.1:7443", "10.0.0.2:7443"]
        raise OSError("Name or service not known")

    edge = await start_edge(
        placed_document(document_of, upstream, capacity=4),
        peers_service="edges.test:7443",
        resolve=resolve,
    )
    await until(lambda: len(lookups) >= 5)
    assert edge.dispatcher.snapshot.edge_replicas == 2
    assert edge.dispatcher.snapshot.providers["p1"].capacity == 2


async def test_a_live_refresh_changes_the_capacity_and_the_admin_api_lists_the_node(
    document_of, start_edge, upstream, tokens, until
) -> None:
    document = placed_document(document_of, upstream, capacity=4)
    edge = await start_edge(document)
    await until(lambda: edge.dispatcher.available == {"p1"})
    async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
        status = (await admin.get("/status")).json()
        (node,) = status["nodes"]
        assert node["node_id"] == "node-1"
        assert node["instance_id"] == "edge-local" and node["ready"] is True
        assert [(p["provider_id"], p["healthy"]) for p in node["providers"]] == [("p1", True)]

        document["nodes"][0]["providers"][0]["capacity"] = 1
        report = (await admin.post("/refresh", json={"mode": "apply", "config": document})).json()
    assert report["outcome"] == "applied", report
    assert report["live_paths"] == ["nodes[node-1].providers[p1].capacity"]
    assert [(p["node_id"], p["status"]) for p in report["pushes"]] == [("node-1", "acked")]
    assert await peak_of(edge, upstream, tokens, 4) == 1


async def test_an_adapter_change_restarts_the_edge_not_a_node(
    document_of, start_edge, upstream, until
) -> None:
    document = placed_document(document_of, upstream, capacity=4)
    edge = await start_edge(document)
    document["nodes"][0]["providers"][0]["adapter"]["connect_timeout_s"] = 2.0
    async with httpx.AsyncClient(base_url=edge.admin_url) as admin:
        report = (await admin.post("/refresh", json={"mode": "apply", "config": document})).json()
    assert report["outcome"] == "restart_required", report
    assert report["restart_required_paths"] == [
        {"path": "nodes[node-1].providers[p1].adapter.connect_timeout_s", "scope": "edge"}
    ]


async def test_a_slot_the_dispatcher_hands_on_is_free_on_the_runner_too(
    document_of, start_edge, upstream, tokens, until
) -> None:
    """Requests queued for a provider at capacity take each freed slot at once: the runner of
    the placed node has released it when the dispatcher hands it on, so no try is refused
    `provider_busy` and retried."""
    edge = await start_edge(placed_document(document_of, upstream, capacity=1))
    await until(lambda: edge.dispatcher.available == {"p1"})
    assert await peak_of(edge, upstream, tokens, 6) == 1
    text = edge.metrics.render().decode()
    assert 'reason="provider_busy"' not in text, [
        line for line in text.splitlines() if "provider_busy" in line
    ]
