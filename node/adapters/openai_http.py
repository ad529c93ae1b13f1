"""The `openai` adapter: any OpenAI-compatible HTTP server (vLLM, Ollama, llama.cpp, TGI, OpenAI).

One pooled `httpx.AsyncClient` per adapter. Streaming runs read the upstream's SSE and forward
each chunk object as it arrives. The Node always asks a streaming upstream for usage
(`stream_options.include_usage`) so the Edge can meter; it forwards the usage-only chunk, marked,
only when the client asked for it. httpx's errors are translated here, once, into `RunFailed`s:
connection refused, timeouts, a dropped connection and every upstream error status get a code
and a message that names what happened. The API key is read from the environment variable the
config names, at build time; the key itself never travels or gets logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Final

import httpx
import orjson

from iop.edgeconfig import OpenAIAdapter as OpenAISettings
from iop.wire import (
    ProviderHealth,
    RunChunk,
    RunDone,
    RunEvent,
    RunFailed,
    RunRequest,
    RunUsage,
    statuses,
)

from .base import client_wants_usage, usage_from

__all__ = ["OpenAIHttpAdapter"]

_PATHS: Final = {"chat": "/chat/completions", "completion": "/completions"}
_DONE: Final = b"[DONE]"


class OpenAIHttpAdapter:
    """Implements `Adapter` for `adapter: {type: openai}`."""

    def __init__(self, provider_id: str, settings: OpenAISettings) -> None:
        self.provider_id = provider_id
        self.settings = settings
        self.closed = False
        self._problem = ""
        headers = {"content-type": "application/json", "accept": "application/json"}
        if settings.api_key_env is not None:
            key = os.environ.get(settings.api_key_env)
            if key:
                headers["authorization"] = f"Bearer {key}"
            else:
                self._problem = f"environment variable {settings.api_key_env} is not set"
        self._urls = {kind: settings.base_url.rstrip("/") + path for kind, path in _PATHS.items()}
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(
                settings.request_timeout_s,
                connect=settings.connect_timeout_s,
                pool=settings.request_timeout_s,
            ),
            limits=httpx.Limits(
                max_connections=settings.max_connections,
                max_keepalive_connections=settings.max_connections,
            ),
            follow_redirects=False,
            trust_env=False,
        )

    @property
    def health(self) -> ProviderHealth:
        if self.closed:
            return ProviderHealth(self.provider_id, False, "adapter closed")
        if self._problem:
            return ProviderHealth(self.provider_id, False, self._problem)
        return ProviderHealth(self.provider_id, True)

    async def aclose(self) -> None:
        self.closed = True
        await self._client.aclose()

    async def run(self, request: RunRequest) -> AsyncGenerator[RunEvent, None]:
        if self._problem:
            yield statuses.failure(statuses.PROVIDER_UNHEALTHY, self._problem)
            return
        body = request.body
        wants_usage = False
        if request.stream:
            try:
                document = orjson.loads(body)
            except orjson.JSONDecodeError:
                yield statuses.failure(statuses.BAD_REQUEST, "the request body is not JSON")
                return
            if not isinstance(document, dict):
                yield statuses.failure(statuses.BAD_REQUEST, "the request body is not an object")
                return
            wants_usage = client_wants_usage(document)
            if not wants_usage:
                options = document.get("stream_options")
                options = dict(options) if isinstance(options, dict) else {}
                options["include_usage"] = True
                document["stream_options"] = options
                body = orjson.dumps(document)
        timeout = None if request.deadline is None else request.deadline - time.time()
        sent_chunk = False
        try:
            async with asyncio.timeout(timeout):
                async with self._client.stream(
                    "POST", self._urls[request.kind], content=body
                ) as response:
                    if response.status_code >= 400:
                        yield statuses.upstream_http_failure(
                            response.status_code, await response.aread()
                        )
                        return
                    if not request.stream:
                        async for event in _whole(await response.aread()):
                            yield event
                        return
                    async for event in _stream(response, wants_usage):
                        sent_chunk = sent_chunk or isinstance(event, RunChunk)
                        yield event
        except TimeoutError:
            yield _failed(statuses.UPSTREAM_TIMEOUT, "the run's deadline passed", sent_chunk)
        except httpx.ConnectTimeout:
            yield _failed(
                statuses.UPSTREAM_UNAVAILABLE,
                f"no connection to {self.settings.base_url} within "
                f"{self.settings.connect_timeout_s:g}s",
                sent_chunk,
            )
        except httpx.PoolTimeout:
            yield _failed(
                statuses.PROVIDER_BUSY,
                f"all {self.settings.max_connections} connections to the upstream are busy",
                sent_chunk,
            )
        except httpx.TimeoutException:
            yield _failed(
                statuses.UPSTREAM_TIMEOUT,
                f"the upstream sent nothing for {self.settings.request_timeout_s:g}s",
                sent_chunk,
            )
        except httpx.ConnectError as exc:
            yield _failed(
                statuses.UPSTREAM_UNAVAILABLE,
                f"cannot connect to {self.settings.base_url}: {exc}",
                sent_chunk,
            )
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            yield _failed(
                statuses.UPSTREAM_ERROR,
                f"the upstream dropped the connection mid-response ({exc or type(exc).__name__})",
                sent_chunk,
            )
        except httpx.HTTPError as exc:
            yield _failed(statuses.UPSTREAM_ERROR, f"upstream request failed: {exc!r}", sent_chunk)
        except _Malformed as exc:
            yield _failed(statuses.UPSTREAM_ERROR, str(exc), sent_chunk)


class _Malformed(Exception):
    """The upstream answered something that is not OpenAI's response format."""


def _failed(code: str, message: str, sent_chunk: bool) -> RunFailed:
    failed = statuses.failure(code, message)
    if sent_chunk and failed.retryable:
        return RunFailed(failed.code, failed.message, False, failed.status)
    return failed


def _decode(data: bytes) -> dict[str, Any]:
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _Malformed(f"the upstream sent something that is not JSON: {data[:80]!r}") from None
    if not isinstance(document, dict):
        raise _Malformed("the upstream sent JSON that is not an object")
    return document


def _finish_reason(document: dict[str, Any]) -> str | None:
    choices = document.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                return str(choice["finish_reason"])
    return None


async def _whole(data: bytes) -> AsyncIterator[RunEvent]:
    document = _decode(data)
    yield RunChunk(data)
    usage = usage_from(document)
    if usage is not None:
        yield RunUsage(*usage)
    yield RunDone(_finish_reason(document))


async def _stream(response: httpx.Response, wants_usage: bool) -> AsyncIterator[RunEvent]:
    usage: tuple[int, int, int] | None = None
    finish: str | None = None
    done = False
    # Read to the end even after [DONE] (the end of the HTTP body follows at once): breaking out
    # would leave httpx's inner generators to the garbage collector.
    async with contextlib.aclosing(_sse_data(response)) as events:
        async for data in events:
            if done or data == _DONE:
                done = True
                continue
            document = _decode(data)
            found = usage_from(document)
            if found is not None:
                usage = found
            choices = document.get("choices")
            if found is not None and not choices:
                if wants_usage:
                    yield RunChunk(data, usage_only=True)
                continue
            finish = _finish_reason(document) or finish
            yield RunChunk(data)
    if usage is not None:
        yield RunUsage(*usage)
    yield RunDone(finish)


async def _sse_data(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The `data` of each server-sent event, as bytes (multi-line data joined by newlines)."""
    buffer = b""
    async for piece in response.aiter_bytes():
        buffer += piece
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            event, buffer = buffer[:end], buffer[end + 2 :]
            data = _event_data(event)
            if data is not None:
                yield data
    data = _event_data(buffer)
    if data is not None:
        yield data


def _event_data(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None
