"""The fake upstream answers OpenAI's Responses API as OpenAI and vLLM do, checked with the
official openai client: plain and streamed, kept for `previous_response_id`, retrieved, deleted
and cancelled."""

from __future__ import annotations

import httpx
import openai
import pytest

from iop.fakes import FakeUpstream, FakeUpstreamSettings, tokens

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


@pytest.fixture
async def client(fake_upstream: FakeUpstream):
    async with openai.AsyncOpenAI(
        base_url=fake_upstream.base_url, api_key="unused", max_retries=0
    ) as client:
        yield client


async def test_a_response_is_answered_kept_and_retrieved(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model="m", input="say something", instructions="be brief", max_output_tokens=4
    )
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert response.output_text == "".join(tokens(4))
    assert response.status == "incomplete"  # max_output_tokens cut it short
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (4, 4)
    again = await client.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == response.output_text


async def test_a_continuation_reads_the_conversation_again(client: openai.AsyncOpenAI) -> None:
    first = await client.responses.create(model="m", input="one two three")
    second = await client.responses.create(model="m", input="four", previous_response_id=first.id)
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens == 1 + first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id


async def test_an_unknown_response_is_vllms_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        await client.responses.create(model="m", input="x", previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_nope")


async def test_a_stream_is_typed_events_ending_with_completed(
    client: openai.AsyncOpenAI, fake_upstream: FakeUpstream
) -> None:
    stream = await client.responses.create(model="m", input="hello there", stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "".join(tokens(16))
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.usage is not None
    assert completed.response.usage.output_tokens == 16
    created = events[0]
    assert created.type == "response.created"
    kept = await client.responses.retrieve(created.response.id)
    assert kept.status == "completed"


async def test_the_raw_stream_names_each_event(fake_upstream: FakeUpstream) -> None:
    async with httpx.AsyncClient(base_url=fake_upstream.base_url) as http:
        answer = await http.post(
            "/responses", json={"model": "m", "input": "x", "stream": True, "max_output_tokens": 1}
        )
    assert answer.text.startswith("event: response.created\ndata: {")
    assert "[DONE]" not in answer.text
    assert answer.text.endswith("}\n\n")


async def test_delete_and_cancel(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model="m", input="x")
    with pytest.raises(openai.BadRequestError, match="only a response in progress"):
        await client.responses.cancel(response.id)
    await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)


async def test_a_response_in_progress_can_be_cancelled() -> None:
    settings = FakeUpstreamSettings(tokens_per_second=20, completion_tokens=40)
    async with (
        FakeUpstream(settings) as upstream,
        openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x", max_retries=0) as client,
    ):
        stream = await client.responses.create(model="m", input="x", stream=True)
        async for event in stream:
            assert event.type == "response.created"
            cancelled = await client.responses.cancel(event.response.id)
            assert cancelled.status == "cancelled"
            break
        await stream.close()


async def test_store_false_keeps_nothing(
    client: openai.AsyncOpenAI, fake_upstream: FakeUpstream
) -> None:
    await client.responses.create(model="m", input="x", store=False)
    assert len(fake_upstream.responses) == 0
