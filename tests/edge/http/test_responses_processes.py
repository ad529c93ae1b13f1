"""`/v1/responses` through the pool with real processes: `iop edge run`, two `iop node run`s and
two `iop fake-upstream`s (one provider each, round robin), driven by the official openai client.

A response is answered plain and streamed, its usage metered; a continuation
(`previous_response_id`) always lands on the server that holds its previous response (the other
one answers 404: it holds nothing of it), as do retrieve, delete and cancel; a bad body is refused
naming its field; an id the Edge never saw, and a holder whose node has gone, get the clear
errors of docs/edge.md, "The Responses API".
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import yaml

from iop.processes import spawn_fake_upstream, spawn_iop, terminate
from testkit import CLIENT_TOKEN, node_token_of, provider

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


@dataclass
class Stack:
    url: str
    metrics_url: str
    upstreams: dict[str, str]  # provider id -> its fake upstream's base URL
    nodes: dict[str, Any]  # node id -> its process

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=CLIENT_TOKEN, max_retries=0)

    async def holder(self, response_id: str) -> str:
        """The provider whose upstream holds `response_id` (asked of each upstream directly)."""
        found = []
        for provider_id, base_url in self.upstreams.items():
            async with httpx.AsyncClient(base_url=base_url) as http:
                if (await http.get(f"/responses/{response_id}")).status_code == 200:
                    found.append(provider_id)
        assert len(found) == 1, found
        return found[0]

    async def tokens(self) -> tuple[float, float]:
        """The prompt and completion tokens metered for model `m`, over its providers."""
        async with httpx.AsyncClient(base_url=self.metrics_url) as http:
            text = (await http.get("/metrics")).text
        return _sum(text, "iop_edge_prompt_tokens_total"), _sum(
            text, "iop_edge_completion_tokens_total"
        )


def _sum(text: str, name: str) -> float:
    pattern = re.compile(rf'^{name}\{{[^}}]*model="m"[^}}]*\}} (\S+)$', re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


@contextlib.asynccontextmanager
async def stack_of(
    folder: Path,
    iop_processes: Any,
    document_of: Callable[..., dict[str, Any]],
    upstream_args: dict[str, list[str]] | None = None,
) -> AsyncIterator[Stack]:
    """Two nodes of one provider each (`p1`, `p2`: model `m`), each before a fake upstream of
    its own (started with `upstream_args[provider]`)."""
    args = upstream_args or {}
    async with contextlib.AsyncExitStack() as stack:
        upstreams = {
            pid: (await stack.enter_async_context(spawn_fake_upstream(args.get(pid, [])))).base_url
            for pid in ("p1", "p2")
        }
        nodes = {
            f"node-{n}": [provider(pid, {"type": "openai", "base_url": upstreams[pid]})]
            for n, pid in ((1, "p1"), (2, "p2"))
        }
        document = document_of(nodes=nodes, metrics=True)
        config = folder / "edge.yaml"
        config.write_text(yaml.safe_dump(document))
        _, started = await iop_processes.edge(stack, config)
        processes = {}
        for node_id in nodes:
            token = folder / f"{node_id}.token"
            token.write_text(node_token_of(node_id))
            processes[node_id] = await iop_processes.node(
                stack, started["hub_port"], node_id, token
            )
        await iop_processes.wait_available(started["url"], ["p1", "p2"])
        yield Stack(started["url"], started["metrics_url"], upstreams, processes)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def edge(
    tmp_path_factory: pytest.TempPathFactory,
    iop_processes: Any,
    document_of: Callable[..., dict[str, Any]],
) -> AsyncIterator[Stack]:
    async with stack_of(tmp_path_factory.mktemp("responses"), iop_processes, document_of) as s:
        yield s


async def test_a_response_plain_retrieved_and_metered(edge: Stack) -> None:
    async with edge.client() as client:
        before = await edge.tokens()
        response = await client.responses.create(
            model="m", input="one two three", instructions="be brief", max_output_tokens=5
        )
        after = await edge.tokens()
        assert response.output_text.split() == ["The", "quick", "brown", "fox", "jumps"]
        assert response.usage is not None
        assert after[0] - before[0] == response.usage.input_tokens == 5
        assert after[1] - before[1] == response.usage.output_tokens == 5
        again = await client.responses.retrieve(response.id)
        assert (again.id, again.output_text) == (response.id, response.output_text)
    async with httpx.AsyncClient(base_url=edge.metrics_url) as http:
        text = (await http.get("/metrics")).text
    remembered = re.search(r"^iop_edge_response_homes (\S+)$", text, re.MULTILINE)
    assert remembered is not None and float(remembered.group(1)) >= 1


async def test_continuations_land_on_the_server_that_holds_them(edge: Stack) -> None:
    async with edge.client() as client:
        for conversation in range(4):  # round robin: without affinity, half would miss
            first = await client.responses.create(model="m", input=f"hello {conversation}")
            holder = await edge.holder(first.id)
            previous = first
            for _ in range(3):
                turn = await client.responses.create(
                    model="m", input="and then?", previous_response_id=previous.id
                )
                assert await edge.holder(turn.id) == holder
                assert turn.usage is not None and previous.usage is not None
                assert turn.usage.input_tokens == 2 + previous.usage.total_tokens
                previous = turn


async def test_a_stream_passes_its_typed_events_and_is_continued(edge: Stack) -> None:
    async with edge.client() as client:
        before = await edge.tokens()
        stream = await client.responses.create(model="m", input="stream this", stream=True)
        events = [event async for event in stream]
        after = await edge.tokens()
        kinds = [event.type for event in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") == 16
        assert [event.sequence_number for event in events] == list(range(len(events)))
        completed = events[-1]
        assert completed.type == "response.completed" and completed.response.usage is not None
        usage = completed.response.usage
        assert (
            (after[0] - before[0], after[1] - before[1])
            == (2, 16)
            == (
                usage.input_tokens,
                usage.output_tokens,
            )
        )
        response_id = completed.response.id
        holder = await edge.holder(response_id)
        for _ in range(3):
            turn = await client.responses.create(
                model="m", input="more", previous_response_id=response_id, stream=True
            )
            created, *_ = [event async for event in turn]
            assert created.type == "response.created"
            assert await edge.holder(created.response.id) == holder
            response_id = created.response.id


async def test_a_failure_mid_stream_ends_it_with_an_error_event(edge: Stack) -> None:
    async with edge.client() as client:
        stream = await client.responses.create(
            model="m",
            input="x",
            stream=True,
            extra_body={"fake_upstream": {"fail": "drop-mid-stream"}},
        )
        seen = []
        with pytest.raises(openai.APIError, match="dropped the connection mid-response"):
            async for event in stream:
                seen.append(event.type)
        assert seen[0] == "response.created" and "response.completed" not in seen


async def test_failures_before_the_first_byte_are_retried_elsewhere(
    tmp_path: Path, iop_processes: Any, document_of: Callable[..., dict[str, Any]]
) -> None:
    broken = {"p2": ["--fail-rate", "1"]}  # p2 answers 500 to every response (not its probes)
    async with (
        stack_of(tmp_path, iop_processes, document_of, broken) as edge,
        edge.client() as client,
    ):
        for attempt in range(4):
            if attempt % 2:
                stream = await client.responses.create(model="m", input="x", stream=True)
                response_id = [event async for event in stream][-1].response.id  # type: ignore[union-attr]
            else:
                response_id = (await client.responses.create(model="m", input="x")).id
            assert await edge.holder(response_id) == "p1"
        turn = await client.responses.create(
            model="m", input="more", previous_response_id=response_id
        )
        assert await edge.holder(turn.id) == "p1"


async def test_the_raw_stream_is_the_servers_bytes(edge: Stack) -> None:
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
        answer = await http.post(
            "/v1/responses",
            json={"model": "m", "input": "x", "stream": True, "max_output_tokens": 2},
            headers={"authorization": f"Bearer {CLIENT_TOKEN}"},
        )
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.text.startswith("event: response.created\ndata: {")
    assert answer.text.count("event: response.output_text.delta\n") == 2
    assert "[DONE]" not in answer.text


async def test_delete_and_cancel_reach_the_holder(edge: Stack) -> None:
    async with edge.client() as client:
        response = await client.responses.create(model="m", input="x")
        # The holder refuses to cancel a completed response; another server would say 404.
        with pytest.raises(openai.BadRequestError, match="only a response in progress"):
            await client.responses.cancel(response.id)
        await client.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(response.id)
        assert gone.value.code == "response_not_found"
        assert f"No response with id '{response.id}' is known to this Edge" in gone.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param(
            {"input": [{"role": "user", "content": [{"text": "x"}]}]},
            "input[0].content[0]",
            id="part-type",
        ),
        pytest.param({"input": 7}, "input", id="input"),
        pytest.param(
            {"input": "x", "max_output_tokens": "12"}, "max_output_tokens", id="max-output"
        ),
        pytest.param({"input": "x", "temperature": 3}, "temperature", id="temperature"),
        pytest.param(
            {"input": "x", "previous_response_id": ""}, "previous_response_id", id="previous"
        ),
        pytest.param({}, "input", id="missing-input"),
    ],
)
async def test_a_bad_body_is_refused_naming_its_field(
    edge: Stack, body: dict[str, Any], param: str
) -> None:
    async with edge.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.post("/responses", body={"model": "m", **body}, cast_to=httpx.Response)
    assert refused.value.param == param
    assert f"'{param}'" in refused.value.message


async def test_a_stored_response_is_not_streamed_again(edge: Stack) -> None:
    async with edge.client() as client:
        response = await client.responses.create(model="m", input="x")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.retrieve(response.id, stream=True)
        assert refused.value.param == "stream"


async def test_an_id_the_edge_never_saw_is_named(edge: Stack) -> None:
    async with edge.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="m", input="x", previous_response_id="resp_x")
        assert refused.value.code == "previous_response_not_found"
        assert refused.value.param == "previous_response_id"
        assert "'resp_x'" in refused.value.message
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.retrieve("resp_x")
        assert unknown.value.code == "response_not_found"


async def test_a_holder_whose_node_is_gone_is_named(
    tmp_path: Path, iop_processes: Any, document_of: Callable[..., dict[str, Any]]
) -> None:
    async with (
        stack_of(tmp_path, iop_processes, document_of) as edge,
        edge.client() as client,
    ):
        held: dict[str, str] = {}
        while len(held) < 2:
            response = await client.responses.create(model="m", input="x")
            held[await edge.holder(response.id)] = response.id
        node = edge.nodes["node-2"]
        node.terminate()
        await node.wait()
        await iop_processes.wait_available(edge.url, ["p1"])
        with pytest.raises(openai.APIStatusError) as unavailable:
            await client.responses.create(model="m", input="more", previous_response_id=held["p2"])
        assert unavailable.value.status_code == 503
        assert unavailable.value.code == "response_holder_unavailable"
        assert f"'{held['p2']}' is held by provider `p2`" in unavailable.value.message
        with pytest.raises(openai.APIStatusError) as lookup:
            await client.responses.retrieve(held["p2"])
        assert (lookup.value.status_code, lookup.value.code) == (
            503,
            "response_holder_unavailable",
        )
        # The other holder still serves its conversations, and new ones go there.
        turn = await client.responses.create(
            model="m", input="more", previous_response_id=held["p1"]
        )
        assert await edge.holder(turn.id) == "p1"


async def test_nodes_placed_on_the_edge_keep_the_affinity(
    tmp_path: Path, iop_processes: Any, document_of: Callable[..., dict[str, Any]]
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        upstreams = {
            pid: (await stack.enter_async_context(spawn_fake_upstream())).base_url
            for pid in ("p1", "p2")
        }
        providers = [
            provider(pid, {"type": "openai", "base_url": upstreams[pid]}, capacity=1)
            for pid in upstreams
        ]
        document = document_of(providers, placement="edge", metrics=True)
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        _, started = await iop_processes.edge(stack, tmp_path / "edge.yaml")
        await iop_processes.wait_available(started["url"], ["p1", "p2"])
        edge = Stack(started["url"], started["metrics_url"], upstreams, {})
        async with edge.client() as client:
            stream = await client.responses.create(model="m", input="x", stream=True)
            created, *_ = [event async for event in stream]
            assert created.type == "response.created"
            holder = await edge.holder(created.response.id)
            previous = created.response.id
            for _ in range(4):
                turn = await client.responses.create(
                    model="m", input="more", previous_response_id=previous
                )
                assert await edge.holder(turn.id) == holder
                previous = turn.id
            assert (await client.responses.retrieve(previous)).id == previous


@pytest.mark.slow
async def test_replicas_sharing_a_limit_store_find_each_others_responses(
    tmp_path: Path,
    iop_processes: Any,
    document_of: Callable[..., dict[str, Any]],
    redis_url: str,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        upstreams = {
            pid: (await stack.enter_async_context(spawn_fake_upstream())).base_url
            for pid in ("p1", "p2")
        }
        providers = [
            provider(pid, {"type": "openai", "base_url": upstreams[pid]}) for pid in upstreams
        ]
        store = {"url": redis_url, "key_prefix": f"responses{os.urandom(4).hex()}"}
        document = document_of(providers, metrics=True, openai={"limit_store": store})
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        (tmp_path / "node.token").write_text(node_token_of("node-1"))
        edges = []
        hubs = []
        for _ in range(2):
            _, started = await iop_processes.edge(stack, tmp_path / "edge.yaml")
            edges.append(Stack(started["url"], started["metrics_url"], upstreams, {}))
            hubs.append(f"127.0.0.1:{started['hub_port']}")
        # One Node dials both replicas, as Nodes do behind a headless Service.
        node = await spawn_iop(
            *("node", "run", "--node-id", "node-1", "--token-file", str(tmp_path / "node.token")),
            *(arg for edge_hub in hubs for arg in ("--edge", edge_hub)),
            *iop_processes.tls.node_args(),
            "--log-level",
            "WARNING",
        )
        stack.push_async_callback(terminate, node)
        for edge in edges:
            await iop_processes.wait_available(edge.url, ["p1", "p2"])
        clients = [await stack.enter_async_context(edge.client()) for edge in edges]
        first = await clients[0].responses.create(model="m", input="hello")
        holder = await edges[0].holder(first.id)
        previous = first.id
        for turn_number in range(1, 7):  # alternating replicas, as a Service's connections would
            turn = await clients[turn_number % 2].responses.create(
                model="m", input="more", previous_response_id=previous
            )
            assert await edges[0].holder(turn.id) == holder
            previous = turn.id
        assert (await clients[1].responses.retrieve(first.id)).id == first.id
        await clients[1].responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):  # forgotten by every replica
            await clients[0].responses.retrieve(first.id)
