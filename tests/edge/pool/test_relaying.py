"""A run's trip through the pool (`relaying.py`) as the dispatcher sees it: what it weighs, and
until when. A real Edge on port 0, a fake node hub at the request path's seam."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from iop.edge import EdgeServer
from iop.wire import RunChunk, RunDone, RunEvent, RunRequest

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


async def test_a_run_weighs_its_prefill_until_its_first_event(
    config_of, provider, fake_hub, tokens, until
) -> None:
    config = config_of(
        [provider("a"), provider("b")],
        {"m": ["a", "b"]},
        model_settings={"m": {"dispatch": {"policy": "prefix_affinity"}}},
    )
    first_token, finish = asyncio.Event(), asyncio.Event()

    async def script(request: RunRequest) -> AsyncIterator[RunEvent]:
        await first_token.wait()  # the server prefills the prompt
        yield RunChunk(b'{"id": "x", "object": "chat.completion.chunk", "choices": []}')
        await finish.wait()  # ...then decodes
        yield RunDone("stop")

    fake_hub.script = script
    edge = EdgeServer(
        config, hub=fake_hub, openai_listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"
    )
    await edge.start()
    fake_hub.connect("a", "b")
    dispatcher = edge.dispatcher
    prompt = "What does the first event of a stream tell the Edge? " * 4
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True}
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def client(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for piece in response.aiter_bytes():
                received.put_nowait(piece)

    try:
        async with httpx.AsyncClient(
            base_url=edge.url, headers={"authorization": f"Bearer {tokens['search-chat']}"}
        ) as http:
            streaming = asyncio.create_task(client(http))
            await until(lambda: sum(map(dispatcher.in_flight, "ab")) == 1)
            (home,) = (pid for pid in "ab" if dispatcher.in_flight(pid))
            # Its whole prompt is new there: the role and the content, as the Edge reads them.
            assert dispatcher.pending_prefill(home) == len("user") + len(prompt)
            first_token.set()
            assert b"chat.completion.chunk" in await received.get()
            # The first event came: the prompt is prefilled, and the run goes on.
            assert dispatcher.pending_prefill(home) == 0
            assert dispatcher.in_flight(home) == 1
            finish.set()
            await streaming
            await until(lambda: dispatcher.in_flight(home) == 0)
            assert dispatcher.pending_prefill(home) == 0
    finally:
        first_token.set()
        finish.set()
        await edge.stop()
