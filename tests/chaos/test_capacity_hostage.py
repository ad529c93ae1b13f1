"""Capacity is not a hostage: clients that read nothing give their slots back well before the send
timeout, a request for a model they hold is served by its fallback or by the first slot freed,
and one client address can take neither every connection nor every request in flight.

The non-reading clients are raw sockets from 127.0.0.2 (another client than the tests' own
127.0.0.1) that send a streaming request for a long, fast answer and never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from iop.processes import spawn_edge, spawn_node, terminate
from testkit import CLIENT_TOKEN, CLIENTS, Client, node_token_of
from tests.waiting import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

ATTACKER = "127.0.0.2"
#: A client of another principal than the attackers' (team-search), for the normal requests.
OTHER = Client("other-app", "sk-other-team", "team-other")
#: Room for a loaded two-core machine on top of a deadline: a bound on correctness, not speed.
SLACK_S = 5.0
#: A fast model's long answer: far more than every buffer between the Edge and its client.
FAST = {"type": "fake", "completion_tokens": 200_000}


async def in_flight(metrics: httpx.AsyncClient, provider: str) -> float:
    text = (await metrics.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(f'iop_edge_in_flight{{provider="{provider}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def streams_paused(metrics: bytes) -> float:
    """`iop_edge_streams_paused` in an Edge's /metrics text."""
    for line in metrics.decode().splitlines():
        if line.startswith("iop_edge_streams_paused "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no iop_edge_streams_paused in the metrics")


async def kit_until(condition: Any, timeout: float) -> None:
    """Until the async `condition` holds (state in another process)."""
    await wait_until(condition, timeout, 0.1)


async def test_a_normal_request_is_served_while_eight_non_reading_clients_hold_a_model(
    document_of, kit, tmp_path: Path
) -> None:
    """The finding replayed: 8 clients that read nothing hold every slot of `mistral`; a normal
    request for it waited 30 s for 503 queue_timeout, its fallback never tried."""
    # A model at 5,000 tokens a second: the answers of the non-reading clients last 40 s.
    model = {**FAST, "tokens_per_second": 5000}
    document = document_of(
        [
            {"id": "p1", "adapter": model, "served_models": ["mistral-7b"], "capacity": 8},
            {"id": "p2", "adapter": model, "served_models": ["llama-8b"], "capacity": 8},
        ],
        {"mistral": ["p1"], "llama": ["p2"]},
        model_settings={"mistral": {"fallbacks": ["llama"]}},
        clients=[*CLIENTS, OTHER],
        tls=None,
        metrics=True,
    )
    (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
    (tmp_path / "node.token").write_text(node_token_of("node-1"))
    async with contextlib.AsyncExitStack() as stack:
        edge, started = await spawn_edge(tmp_path / "edge.yaml")
        stack.push_async_callback(terminate, edge)
        node = await spawn_node(started["hub_port"], "node-1", tmp_path / "node.token")
        stack.push_async_callback(terminate, node)
        metrics = await stack.enter_async_context(
            httpx.AsyncClient(base_url=started["metrics_url"], timeout=30)
        )
        async with httpx.AsyncClient(base_url=started["url"]) as http:

            async def available() -> bool:
                ready = (await http.get("/readyz")).json()
                return bool(ready["providers_available"] == ["p1", "p2"])

            await kit_until(available, 90)
        holders = [
            await kit.open_stream(
                started["url"], 200_000, model="mistral", receive_buffer=4096, source=ATTACKER
            )
            for _ in range(8)
        ]
        try:

            async def held() -> bool:
                return await in_flight(metrics, "p1") == 8

            await kit_until(held, 30)
            client = openai.AsyncOpenAI(
                base_url=started["url"] + "/v1", api_key=OTHER.key, max_retries=0, timeout=60
            )
            async with client:
                began = time.perf_counter()
                answer = await client.chat.completions.create(
                    model="mistral",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=5,
                )
                took = time.perf_counter() - began
            # Served by the fallback's provider at once, not after 30 s of waiting.
            assert answer.model == "llama-8b"
            assert took < SLACK_S, f"{took:.2f}s"
            text = (await metrics.get("/metrics")).text
            assert (
                'iop_edge_fallbacks_total{fallback="llama",model="mistral",reason="busy"}' in text
            )
        finally:
            for _, writer in holders:
                writer.close()


@pytest.mark.parametrize("placement", ["node", "edge"])
async def test_a_stalled_stream_frees_its_slot_and_its_client_gets_its_bytes_then_an_error(
    placement, document_of, kit, start_edge, start_node, until
) -> None:
    stall_s = 1.5
    # A model fast enough to fill every buffer in a moment (5,000 tokens a second); one that
    # never waits between tokens would hold this process's only event loop instead.
    model = {**FAST, "tokens_per_second": 5000}
    document = document_of(
        [{"id": "p1", "adapter": model, "served_models": ["served"], "capacity": 2}],
        openai={"stream_stall_timeout_ms": round(stall_s * 1000)},
        clients=[*CLIENTS, OTHER],
        admin=True,
        placement=placement,
    )
    edge = await start_edge(document)
    if placement == "node":
        await start_node(edge.hub)
    await until(lambda: edge.dispatcher.available == {"p1"})
    holders: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    stopping = asyncio.Event()

    async def keep_holding() -> None:
        """The attacker: another stream that reads nothing every half second."""
        while not stopping.is_set():
            holders.append(
                await kit.open_stream(edge.url, 200_000, receive_buffer=4096, source=ATTACKER)
            )
            await asyncio.sleep(0.5)

    attacker = asyncio.create_task(keep_holding())
    try:
        try:
            await until(lambda: edge.dispatcher.in_flight("p1") == 2, timeout=30)
            # The stall's clock starts once the Edge's buffers for a holder are full: how long
            # filling them takes is the machine's speed at 5,000 tokens a second, not a bound.
            await until(lambda: streams_paused(edge.metrics.render()) >= 1, timeout=30)
            async with httpx.AsyncClient(
                base_url=edge.url, headers={"authorization": f"Bearer {OTHER.key}"}, timeout=60
            ) as http:
                began = time.perf_counter()
                status, text = await kit.chat(http, max_tokens=5)
                took = time.perf_counter() - began
            # The first slot a stall frees goes to the waiting request, ahead of the attacker's
            # newer ones: served within the stall timeout, not after the 30 s send timeout.
            assert status == 200, (text, edge.hub.streams_stalled, len(holders))
            assert took < stall_s + SLACK_S, f"{took:.2f}s"
            assert edge.hub.streams_stalled >= 1
        finally:
            stopping.set()
            await attacker
        # The first holder reads at last: what the Edge held for it, then the error event.
        rest = await asyncio.wait_for(holders[0][0].read(), 30)
        assert rest.count(b"data: {") > 10
        assert b'"code":"stream_stalled"' in rest, rest[-300:]
    finally:  # every holder closed whatever failed (a socket left open fails a later test)
        for _, other in holders:
            other.close()
        await asyncio.gather(*(w.wait_closed() for _, w in holders), return_exceptions=True)


async def test_one_address_cannot_take_every_connection(
    document_of, start_edge, start_node, until
) -> None:
    """The finding replayed: 4,300 idle sockets from one client made 12 of 27 requests 503."""
    document = document_of(
        [{"id": "p1", "adapter": {"type": "fake", "completion_tokens": 4}, "served_models": ["s"]}],
        edge={"admin": {"listen": "127.0.0.1:0"}},
        openai={"header_timeout_ms": 60_000},
    )
    edge = await start_edge(document)
    await start_node(edge.hub)
    await until(lambda: edge.dispatcher.available == {"p1"})
    server = edge.http_server
    assert server is not None
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    idle: list[asyncio.StreamWriter] = []
    refused = 0
    try:
        for _ in range(4300):
            _, writer = await asyncio.open_connection(host, int(port), local_addr=(ATTACKER, 0))
            idle.append(writer)
        await until(lambda: server.refusals.counts["connections"] >= 4300 - 1024, timeout=30)
        async with httpx.AsyncClient(
            base_url=edge.url, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, timeout=30
        ) as http:
            statuses = [
                (
                    await http.post(
                        "/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    )
                ).status_code
                for _ in range(27)
            ]
        assert statuses == [200] * 27
        refused = server.refusals.counts["connections"]
        assert server.open_connections <= 1024 + 1
    finally:
        for writer in idle:
            writer.close()
        await asyncio.gather(*(writer.wait_closed() for writer in idle), return_exceptions=True)
    assert refused == 4300 - 1024


async def test_one_client_cannot_hold_every_request_in_flight(
    document_of, start_edge, start_node, until
) -> None:
    slow = {"type": "fake", "tokens_per_second": 2, "completion_tokens": 100}
    document = document_of(
        [{"id": "p1", "adapter": slow, "served_models": ["served"], "capacity": 16}],
        openai={"max_requests_per_client": 3},
        clients=[*CLIENTS, OTHER],
        admin=True,
    )
    edge = await start_edge(document)
    await start_node(edge.hub)
    await until(lambda: edge.dispatcher.available == {"p1"})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    def client(key: str, source: str) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(local_address=source)
        return httpx.AsyncClient(
            base_url=edge.url,
            headers={"authorization": f"Bearer {key}"},
            transport=transport,
            timeout=60,
        )

    async with (
        client(CLIENTS[0].key, ATTACKER) as attacker,
        client(CLIENTS[1].key, "127.0.0.3") as same_principal,
        client(OTHER.key, "127.0.0.1") as other,
    ):
        streams = [
            await attacker.send(
                attacker.build_request("POST", "/v1/chat/completions", json=body), stream=True
            )
            for _ in range(3)
        ]
        try:
            assert [s.status_code for s in streams] == [200] * 3
            by_address = await attacker.post("/v1/chat/completions", json=body)
            assert by_address.status_code == 429
            assert by_address.json()["error"]["code"] == "too_many_requests_in_flight"
            assert by_address.headers["retry-after"] == "1"
            # The same principal from another address is bound too; another principal is not.
            by_principal = await same_principal.post("/v1/chat/completions", json=body)
            assert by_principal.status_code == 429, by_principal.text
            served = await other.post(
                "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2}
            )
            assert served.status_code == 200, served.text
        finally:
            for stream in streams:
                await stream.aclose()
    assert edge.guard.refused == {"address": 1, "principal": 1}
