"""The adapters run the Responses API against a real fake upstream: a response and its usage,
its typed events passed through as the server wrote them, and a stored response's retrieve,
delete and cancel (lookups that take no capacity slot)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from iop.edgeconfig import FakeAdapterSettings, OpenAIAdapterSettings
from iop.fakes import FakeUpstream, tokens
from iop.providers import FakeAdapter, OpenAIAdapter
from iop.wire import RunChunk, RunDone, RunEvent, RunFailed, RunRequest, RunUsage, statuses

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


def create(stream: bool, limit: int = 32 * 1024 * 1024, **body: Any) -> RunRequest:
    document = {"model": "served", "input": "hello there", "stream": stream, **body}
    return RunRequest(
        "r1",
        "p1",
        "served",
        "response",
        orjson.dumps(document),
        stream,
        max_response_bytes=limit,
        sse_chunks=stream,
    )


def lookup(kind: str, response_id: str) -> RunRequest:
    return RunRequest("r2", "p1", "", kind, b"", False, response_id=response_id)  # type: ignore[arg-type]


async def collect(adapter: Any, run: RunRequest) -> list[RunEvent]:
    return [event async for event in adapter.run(run)]


@pytest.fixture
async def adapter(fake_upstream: FakeUpstream):
    adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=fake_upstream.base_url))
    yield adapter
    await adapter.aclose()


@pytest.fixture(params=["openai", "fake"])
async def any_adapter(request: pytest.FixtureRequest, fake_upstream: FakeUpstream):
    if request.param == "fake":
        adapter: Any = FakeAdapter("p1", FakeAdapterSettings())
    else:
        adapter = OpenAIAdapter("p1", OpenAIAdapterSettings(base_url=fake_upstream.base_url))
    yield adapter
    await adapter.aclose()


async def test_a_response_with_its_usage_and_status(any_adapter: Any) -> None:
    chunk, usage, done = await collect(any_adapter, create(False, max_output_tokens=3))
    assert isinstance(chunk, RunChunk) and not chunk.sse
    document = orjson.loads(chunk.data)
    assert document["output"][0]["content"][0]["text"] == "".join(tokens(3))
    assert usage == RunUsage(2, 3, 5)
    assert done == RunDone("incomplete")


async def test_a_stream_passes_through_with_its_event_lines(any_adapter: Any) -> None:
    events = await collect(any_adapter, create(True))
    chunks = [e for e in events if isinstance(e, RunChunk)]
    assert chunks and all(chunk.sse for chunk in chunks)
    data = b"".join(chunk.data for chunk in chunks)
    assert data.startswith(b"event: response.created\ndata: {")
    assert data.endswith(b"}\n\n") and b"[DONE]" not in data
    assert data.count(b"event: response.output_text.delta\n") == 16
    assert events[-2:] == [RunUsage(2, 16, 18), RunDone("completed")]


async def test_a_streams_events_keep_to_the_runs_bound(adapter: OpenAIAdapter) -> None:
    events = await collect(adapter, create(True, limit=900))
    chunks = [e for e in events if isinstance(e, RunChunk)]
    assert len(chunks) > 1 and all(len(chunk.data) <= 900 for chunk in chunks)
    assert isinstance(events[-1], RunFailed)  # the final event holds the whole response
    assert events[-1].code == statuses.RESPONSE_TOO_LARGE


async def test_lookups_reach_the_stored_response(any_adapter: Any) -> None:
    chunk, _, _ = await collect(any_adapter, create(False))
    assert isinstance(chunk, RunChunk)
    response_id = orjson.loads(chunk.data)["id"]
    found, done = await collect(any_adapter, lookup("response_retrieve", response_id))
    assert isinstance(found, RunChunk) and orjson.loads(found.data)["id"] == response_id
    assert done == RunDone(None)
    refused = (await collect(any_adapter, lookup("response_cancel", response_id)))[-1]
    assert isinstance(refused, RunFailed) and refused.status == 400
    deleted, _ = await collect(any_adapter, lookup("response_delete", response_id))
    assert isinstance(deleted, RunChunk) and orjson.loads(deleted.data)["deleted"] is True
    gone = (await collect(any_adapter, lookup("response_retrieve", response_id)))[-1]
    assert isinstance(gone, RunFailed) and gone.status == 404
    assert response_id in gone.message


async def test_an_odd_id_is_quoted_into_the_path(adapter: OpenAIAdapter) -> None:
    gone = (await collect(adapter, lookup("response_retrieve", "../models")))[-1]
    assert isinstance(gone, RunFailed) and gone.status == 404
    assert "../models" in gone.message  # the fake's own "not found" for that id, not a route
