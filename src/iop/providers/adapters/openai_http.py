"""The `openai` adapter: any OpenAI-compatible HTTP server (vLLM, Ollama, llama.cpp, TGI, OpenAI).

One `UpstreamClient` (`upstreams.py`) per adapter. A stream's reads are passed on whole, as
`RunChunk(sse=True)`, when the Edge asks for `sse_chunks` and each read is plain `data:` lines;
otherwise each event is parsed and sent as its JSON object (`StreamDecoder`, in
`streamdecoding.py`). Usage is always asked of a streaming upstream, and the usage-only chunk
forwarded only when the client asked. The client's errors become `RunFailed`s once, in
`upstreamfailures.py` (`failure`). docs/architecture.md ("The data path of one request", "The
providers") says why it is so.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator
from typing import Final
from urllib.parse import quote

import orjson

from iop.edgeconfig import OpenAIAdapterSettings as OpenAISettings
from iop.edgeconfig import UpstreamPolicy
from iop.wire import (
    ADAPTER_ERROR,
    DEFAULT_MAX_RESPONSE_BYTES,
    RESPONSE_LOOKUPS,
    ProviderHealth,
    RunChunk,
    RunDone,
    RunEvent,
    RunFailed,
    RunRequest,
    RunUsage,
    statuses,
)

from .base import Upstream, client_wants_usage, usage_from
from .streamdecoding import ResponseEvents, StreamDecoder, decode, finish_reason
from .upstreamfailures import Malformed, NoEvents, TooLarge, failure, too_large
from .upstreams import Response, UpstreamClient, UpstreamError

_PATHS: Final = {
    "chat": "/chat/completions",
    "completion": "/completions",
    "embedding": "/embeddings",
    "response": "/responses",
}
#: The list every OpenAI answer of a kind holds: what tells a model server's 2xx from another's.
_ANSWER_LIST: Final = {
    "chat": "choices",
    "completion": "choices",
    "embedding": "data",
    "response": "output",
}
#: A stored response's routes: (method, the path after /responses/{id}).
_LOOKUPS: Final = {
    "response_retrieve": (b"GET", ""),
    "response_delete": (b"DELETE", ""),
    "response_cancel": (b"POST", "/cancel"),
}
#: Idle seconds after which the pool closes a keep-alive connection instead of using it: below
#: the 5 s idle timeout of uvicorn (vLLM's server) and most others, so the client, not the
#: server, ends an idle connection, and a POST (never retried) rarely meets one being closed.
_KEEPALIVE_S: Final = 4.0
#: Most bytes of an upstream's error body read (its message is what the Edge shows).
_ERROR_BODY_BYTES: Final = 64 * 1024


class OpenAIAdapter:
    """Implements `Adapter` for `adapter: {type: openai}`."""

    def __init__(
        self, provider_id: str, settings: OpenAISettings, policy: UpstreamPolicy | None = None
    ) -> None:
        self.provider_id = provider_id
        self.settings = settings
        self.closed = False
        self._policy = policy
        self._problem = ""
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        #: Why the upstream policy refuses this provider (never probed, never called then).
        self._refused = "; ".join(
            problem for _, problem in (policy.url_problems(provider_id, settings) if policy else ())
        )
        if self._refused:
            self._problem = self._refused  # and its key, whatever it is, is never read
        elif settings.api_key_env is not None:
            key = os.environ.get(settings.api_key_env)
            if key and ("\r" in key or "\n" in key):
                self._problem = f"environment variable {settings.api_key_env} holds a line break"
            elif key:
                self._headers["authorization"] = f"Bearer {key}"
            else:
                self._problem = f"environment variable {settings.api_key_env} is not set"
        self._client: UpstreamClient | None = None

    @property
    def problem(self) -> str:
        return self._problem

    @property
    def health(self) -> ProviderHealth:
        if self.closed:
            return ProviderHealth(self.provider_id, False, "adapter closed", ADAPTER_ERROR)
        if self._problem:
            return ProviderHealth(self.provider_id, False, self._problem, ADAPTER_ERROR)
        return ProviderHealth(self.provider_id, True)

    @property
    def upstream(self) -> Upstream | None:
        if self._refused:
            return None
        return Upstream(self.settings.base_url, self._headers)

    async def aclose(self) -> None:
        self.closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _open(self) -> UpstreamClient:
        """The adapter's client; made in the running loop on the first run."""
        settings = self.settings
        return UpstreamClient(
            settings.base_url,
            self._headers,
            max_connections=settings.max_connections,
            connect_timeout=settings.connect_timeout_s,
            # Also how long a run may wait for a free connection of a full pool.
            read_timeout=settings.request_timeout_s,
            keepalive_s=_KEEPALIVE_S,
            policy=self._policy,
        )

    async def run(self, request: RunRequest) -> AsyncGenerator[RunEvent, None]:
        if self._problem:
            yield statuses.failure(statuses.PROVIDER_UNHEALTHY, self._problem)
            return
        if self.closed:
            yield statuses.failure(statuses.PROVIDER_UNHEALTHY, "the adapter is closed")
            return
        body = request.body
        limit = request.max_response_bytes or DEFAULT_MAX_RESPONSE_BYTES
        wants_usage = False
        if request.kind in RESPONSE_LOOKUPS:
            async for event in self._lookup(request, limit):
                yield event
            return
        if request.stream and request.kind != "response":  # a Responses stream has its usage
            prepared = _asking_for_usage(body)
            if isinstance(prepared, RunFailed):
                yield prepared
                return
            body, wants_usage = prepared
        if request.deadline is not None and request.deadline <= time.time():
            yield statuses.failure(statuses.UPSTREAM_TIMEOUT, "the run's deadline passed")
            return
        client = self._client
        if client is None:
            client = self._client = self._open()
        settings = self.settings
        response: Response | None = None
        sent_chunk = False
        try:
            traceparent = request.traceparent
            head = b"traceparent: %s\r\n" % traceparent.encode("ascii") if traceparent else b""
            response = await client.post(_PATHS[request.kind], body, request.deadline, head)
            if response.status >= 300:  # a redirect's body is not the answer either
                detail = await _read_at_most(response, _ERROR_BODY_BYTES) or b""
                yield statuses.upstream_http_failure(response.status, detail)
                return
            if not request.stream:
                read = await _read_at_most(response, limit)
                if read is None:
                    yield too_large(limit)
                    return
                data = read
                document = decode(data)
                if not isinstance(document.get(_ANSWER_LIST[request.kind]), list):
                    # Not an answer of this kind: a server that is not a model server (an API
                    # server, a metadata service) answering 2xx, whose body is not for the client.
                    raise Malformed(
                        f"the upstream's answer has no {_ANSWER_LIST[request.kind]} list: "
                        f"not an OpenAI {request.kind} answer"
                    )
                yield RunChunk(data)
                usage = usage_from(document)
                if usage is not None:
                    yield RunUsage(*usage)
                yield RunDone(finish_reason(document))
                return
            if request.kind == "response":
                decoder: StreamDecoder | ResponseEvents = ResponseEvents(limit)
            else:
                decoder = StreamDecoder(wants_usage, limit, request.sse_chunks)
            # Everything that arrived is split at each turn (often a whole burst of events).
            # Read to the end even after [DONE], which the end of the body follows at once:
            # only a response read to its end gives its connection back to the pool.
            # Comments and empty events are not news: the read timeout bounds the wait for the
            # next chunk, or an upstream sending only those would hold the run for ever.
            news = time.monotonic()
            while piece := await response.read_some():
                for chunk in decoder.feed(piece):
                    sent_chunk = True
                    news = time.monotonic()
                    yield chunk
                if time.monotonic() - news > settings.request_timeout_s:
                    raise NoEvents
            for event in decoder.end():
                yield event
        except (UpstreamError, Malformed, TooLarge, NoEvents) as exc:
            failed = failure(exc, settings, limit)
            if sent_chunk and failed.retryable:  # the client has bytes: another try cannot help
                failed = RunFailed(failed.code, failed.message, False, failed.status)
            yield failed
        finally:
            if response is not None:
                # A response read to its end gave its connection back to the pool already;
                # otherwise (cancelled, failed, cut short) this closes the connection at once.
                response.close()

    async def _lookup(self, request: RunRequest, limit: int) -> AsyncGenerator[RunEvent, None]:
        """A stored response's retrieve, delete or cancel: the upstream's answer, whole."""
        method, suffix = _LOOKUPS[request.kind]
        path = f"/responses/{quote(request.response_id, safe='')}{suffix}"
        client = self._client
        if client is None:
            client = self._client = self._open()
        response: Response | None = None
        try:
            response = await client.send(method, path, b"", request.deadline)
            if response.status >= 300:
                detail = await _read_at_most(response, _ERROR_BODY_BYTES) or b""
                yield statuses.upstream_http_failure(response.status, detail)
                return
            data = await _read_at_most(response, limit)
            if data is None:
                yield too_large(limit)
                return
            decode(data)  # an object, as every answer of these routes is
            yield RunChunk(data)
            yield RunDone(None)
        except (UpstreamError, Malformed) as exc:
            yield failure(exc, self.settings, limit)
        finally:
            if response is not None:
                response.close()


def _asking_for_usage(body: bytes) -> tuple[bytes, bool] | RunFailed:
    """A streaming request's body as sent upstream, which always asks for the usage chunk, and
    whether the client asked for it too (then it is forwarded); or why the body cannot go."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return statuses.failure(statuses.BAD_REQUEST, "the request body is not JSON")
    if not isinstance(document, dict):
        return statuses.failure(statuses.BAD_REQUEST, "the request body is not an object")
    if client_wants_usage(document):
        return body, True
    options = document.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    document["stream_options"] = options
    return orjson.dumps(document), False


async def _read_at_most(response: Response, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes: nothing more is read (the connection is
    closed, not pooled), so memory is bounded by the limit whatever the upstream sends."""
    length = response.content_length
    if length is not None and length > limit:
        return None
    parts: list[bytes] = []
    size = 0
    while piece := await response.read_some():
        size += len(piece)
        if size > limit:
            return None
        parts.append(piece)
    return b"".join(parts)
