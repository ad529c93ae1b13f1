"""The `fake` adapter: a deterministic in-process generator, for demos, tests and benchmarks.

It answers exactly what the fake upstream would (the same module builds the bytes), paced by
`latency_ms` (time to the first token) and `tokens_per_second`, without any network; embeddings
come after `latency_ms`. Responses (`/v1/responses`) are kept by the adapter, as a server keeps
them, for `previous_response_id`, retrieve, delete and cancel.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from iop.edgeconfig import FakeAdapterSettings as FakeSettings
from iop.fakes import (
    OpenAIError,
    ResponseStore,
    embedding_response,
    parse_request,
    parse_response_request,
    tokens,
)
from iop.wire import (
    ADAPTER_ERROR,
    ProviderHealth,
    RunChunk,
    RunDone,
    RunEvent,
    RunRequest,
    RunUsage,
    statuses,
)

from .base import Upstream


class FakeAdapter:
    """Implements `Adapter` for `adapter: {type: fake}`."""

    def __init__(self, provider_id: str, settings: FakeSettings) -> None:
        self.provider_id = provider_id
        self.settings = settings
        self.closed = False
        self.responses = ResponseStore()

    @property
    def problem(self) -> str:
        return ""  # nothing of the node's environment can stop it

    @property
    def health(self) -> ProviderHealth:
        if self.closed:
            return ProviderHealth(self.provider_id, False, "adapter closed", ADAPTER_ERROR)
        return ProviderHealth(self.provider_id, True)

    @property
    def upstream(self) -> Upstream | None:
        return None  # it answers in-process: there is nothing to probe

    async def aclose(self) -> None:
        self.closed = True

    async def run(self, request: RunRequest) -> AsyncGenerator[RunEvent, None]:
        if request.kind == "embedding":
            try:
                body, prompt_tokens = embedding_response(request.body, models=())
            except OpenAIError as refusal:
                yield statuses.upstream_http_failure(refusal.status, refusal.body)
                return
            if self.settings.latency_ms:
                await asyncio.sleep(self.settings.latency_ms / 1000)
            yield RunChunk(body)
            yield RunUsage(prompt_tokens, 0, prompt_tokens)
            yield RunDone(None)
            return
        if request.kind != "chat" and request.kind != "completion":
            async for event in self._responses(request):
                yield event
            return
        try:
            completion = parse_request(
                request.kind,
                request.body,
                default_tokens=self.settings.completion_tokens,
                models=(),
                now=int(time.time()),
            )
        except OpenAIError as refusal:
            yield statuses.upstream_http_failure(refusal.status, refusal.body)
            return
        latency = self.settings.latency_ms / 1000
        speed = self.settings.tokens_per_second
        interval = 1 / speed if speed else 0.0
        usage = completion.usage
        if not completion.stream:
            delay = latency + interval * completion.completion_tokens
            if delay:
                await asyncio.sleep(delay)
            yield RunChunk(completion.response())
        else:
            loop = asyncio.get_running_loop()
            if latency:
                await asyncio.sleep(latency)
            first = completion.first_chunk()
            if first is not None:
                yield RunChunk(first)
            start = loop.time()
            for index, token in enumerate(tokens(completion.completion_tokens)):
                if interval and index:
                    await asyncio.sleep(max(0.0, start + index * interval - loop.time()))
                yield RunChunk(completion.token_chunk(token))
            yield RunChunk(completion.final_chunk())
            usage_chunk = completion.usage_chunk()
            if usage_chunk is not None:
                yield RunChunk(usage_chunk, usage_only=True)
        yield RunUsage(usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
        yield RunDone(completion.finish_reason)

    async def _responses(self, request: RunRequest) -> AsyncGenerator[RunEvent, None]:
        """The Responses API: a response (kept), or a kept one's retrieve, delete, cancel."""
        store = self.responses
        try:
            if request.kind == "response_retrieve":
                body = store.retrieve(request.response_id)
            elif request.kind == "response_delete":
                body = store.delete(request.response_id)
            elif request.kind == "response_cancel":
                body = store.cancel(request.response_id)
            else:
                answer = parse_response_request(
                    request.body,
                    default_tokens=self.settings.completion_tokens,
                    models=(),
                    now=int(time.time()),
                    store=store,
                )
                body = b""
        except OpenAIError as refusal:
            yield statuses.upstream_http_failure(refusal.status, refusal.body)
            return
        if body:
            yield RunChunk(body)
            yield RunDone(None)
            return
        latency = self.settings.latency_ms / 1000
        speed = self.settings.tokens_per_second
        interval = 1 / speed if speed else 0.0
        if not answer.stream:
            delay = latency + interval * answer.output_tokens
            if delay:
                await asyncio.sleep(delay)
            yield RunChunk(answer.body())
        else:
            if latency:
                await asyncio.sleep(latency)
            if answer.store:
                store.keep(answer.document(final=False))
            yield RunChunk(b"".join(answer.opening_events()), sse=True)
            loop = asyncio.get_running_loop()
            start = loop.time()
            for index, token in enumerate(tokens(answer.output_tokens)):
                if interval and index:
                    await asyncio.sleep(max(0.0, start + index * interval - loop.time()))
                yield RunChunk(b"".join(answer.delta_events((token,), index)), sse=True)
            yield RunChunk(b"".join(answer.closing_events()), sse=True)
        if answer.store and store.status(answer.id) != "cancelled":
            store.keep(answer.document())
        usage = answer.usage
        yield RunUsage(usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])
        yield RunDone(answer.status)
