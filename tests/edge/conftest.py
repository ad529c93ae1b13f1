"""Shared fixtures of the Edge tests: small configs, a fake node hub at our own seam, and (for the
live refresh tests) a real in-process Edge with its admin API and a connected Node."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
import orjson
import pytest

from iop.edge.hub.protocol import (
    Hub,
    NodeStatus,
    PreparedSwap,
    ProviderLink,
    ProviderLoad,
    RunEvents,
)
from iop.edgeconfig import EdgeConfig
from iop.wire import RunChunk, RunDone, RunEvent, RunFailed, RunRequest, RunUsage
from iop.wire.nodestates import ConfigAck
from testkit import provider as provider_entry


def provider(pid: str, **settings: Any) -> dict[str, Any]:
    """testkit's provider entry with the Edge tests' defaults (serving `<pid>-served`)."""
    settings = {"capacity": 4, "priority": 10, **settings}
    return provider_entry(pid, served=f"{pid}-served", **settings)


@pytest.fixture(name="provider", scope="session")
def provider_fixture() -> Callable[..., dict[str, Any]]:
    """`provider(id, **settings)`: a provider entry (fake adapter, capacity 4, priority 10)."""
    return provider


# -- a fake node hub at the request path's seam ------------------------------------------------


Script = Callable[[RunRequest], AsyncIterator[RunEvent]]


async def echo_script(request: RunRequest) -> AsyncIterator[RunEvent]:
    """What a well-behaved provider answers: an OpenAI body (or chunks), usage, done."""
    body = orjson.loads(request.body)
    created = 1_700_000_000
    if request.stream:
        words = ["Hello", " from", f" {request.provider_id}"]
        for index, word in enumerate(words):
            delta: dict[str, Any] = {"content": word}
            if index == 0:
                delta["role"] = "assistant"
            yield RunChunk(
                orjson.dumps(
                    _chunk(request, created, [{"index": 0, "delta": delta, "finish_reason": None}])
                )
            )
        yield RunChunk(
            orjson.dumps(
                _chunk(request, created, [{"index": 0, "delta": {}, "finish_reason": "stop"}])
            )
        )
        include = (body.get("stream_options") or {}).get("include_usage")
        if include:
            usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
            yield RunChunk(orjson.dumps(_chunk(request, created, [], usage)), usage_only=True)
    else:
        if request.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": f"Hello from {request.provider_id}"},
                "finish_reason": "stop",
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": f"Hello from {request.provider_id}",
                "finish_reason": "stop",
            }
            obj = "text_completion"
        yield RunChunk(
            orjson.dumps(
                {
                    "id": f"run-{request.run_id}",
                    "object": obj,
                    "created": created,
                    "model": request.served_model,
                    "choices": [choice],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
                }
            )
        )
    yield RunUsage(5, 3, 8)
    yield RunDone("stop")


def _chunk(
    request: RunRequest, created: int, choices: list[Any], usage: Any = None
) -> dict[str, Any]:
    obj = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    if request.kind == "completion":
        choices = [
            {
                "index": c["index"],
                "text": c["delta"].get("content", ""),
                "finish_reason": c["finish_reason"],
            }
            for c in choices
        ]
    return {
        "id": f"run-{request.run_id}",
        "object": obj,
        "created": created,
        "model": request.served_model,
        "choices": choices,
        "usage": usage,
    }


class FakeStream:
    def __init__(self, hub: FakeHub, request: RunRequest) -> None:
        self._hub = hub
        self._request = request
        self._events: AsyncIterator[RunEvent] | None = None
        self._on_end: list[Callable[[], object]] = []
        self._ended = False
        #: With `FakeHub.at_once`: every event of the run, there before the Edge asks.
        self._ready: deque[RunEvent] | None = None

    def on_end(self, callback: Callable[[], object]) -> None:
        if self._ended:
            callback()
        else:
            self._on_end.append(callback)

    def _end(self) -> None:
        self._ended = True
        callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            callback()

    async def __aenter__(self) -> FakeStream:
        self._hub.active[self._request.run_id] = self._request
        self._events = self._hub.script(self._request)
        if self._hub.at_once:
            self._ready = deque([event async for event in self._events])
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hub.active.pop(self._request.run_id, None)
        self._end()
        if self._hub.ended.get(self._request.run_id) is None:
            self._hub.ended[self._request.run_id] = "cancelled" if exc is not None else "closed"
        if self._events is not None:
            await self._events.aclose()  # type: ignore[attr-defined]

    def __aiter__(self) -> FakeStream:
        return self

    def cancel(self, *, first_byte_timeout: bool = False) -> None:
        if self._hub.ended.get(self._request.run_id) is None:
            self._hub.ended[self._request.run_id] = (
                "first byte timeout" if first_byte_timeout else "cancelled"
            )

    def take_ready(self) -> list[RunEvent]:
        if self._ready is None:
            return []  # a script's next event is only known by awaiting it
        taken: list[RunEvent] = []
        while self._ready and not (taken and isinstance(taken[-1], RunDone | RunFailed)):
            taken.append(self._seen(self._ready.popleft()))
        return taken

    async def __anext__(self) -> RunEvent:
        if self._ready is not None:
            if not self._ready:
                raise StopAsyncIteration
            return self._seen(self._ready.popleft())
        assert self._events is not None
        return self._seen(await anext(self._events))

    def _seen(self, event: RunEvent) -> RunEvent:
        if isinstance(event, RunDone | RunFailed):
            self._hub.ended[self._request.run_id] = type(event).__name__
            self._end()
        return event


@dataclass
class FakeHub:
    """Runs requests in-process with `script`; records what it was asked and what ended how."""

    providers: dict[str, ProviderLink] = field(default_factory=dict)
    #: What the nodes reported of their providers' load (`provider_loads`).
    loads: dict[str, ProviderLoad] = field(default_factory=dict)
    script: Script = echo_script
    requests: list[RunRequest] = field(default_factory=list)
    active: dict[str, RunRequest] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)
    listeners: list[Callable[[], None]] = field(default_factory=list)
    started: bool = False
    #: Hand each run's events over all at once, as when a Node's one message carries them all.
    at_once: bool = False

    def reset(self) -> None:
        """Back to answering like a well-behaved provider, with nothing recorded."""
        self.script = echo_script
        self.at_once = False
        self.requests.clear()
        self.ended.clear()

    def connected_providers(self) -> Mapping[str, ProviderLink]:
        return self.providers

    def add_listener(self, callback: Callable[[], None]) -> None:
        self.listeners.append(callback)

    def provider_loads(self) -> Mapping[str, ProviderLoad]:
        return self.loads

    def run(self, request: RunRequest) -> RunEvents:
        self.requests.append(request)
        return FakeStream(self, request)

    async def start(self) -> int:
        self.started = True
        return 0

    async def stop(self, grace: float = 0.0) -> None:
        self.started = False

    def prepare(self, config: EdgeConfig, generation: int) -> PreparedSwap:
        return PreparedSwap(config, generation, config, {}, {})

    async def swap_config(
        self,
        config: EdgeConfig,
        *,
        generation: int | None = None,
        ack_timeout: float = 0.0,
        hold: Collection[str] = (),
        prepared: PreparedSwap | None = None,
    ) -> Mapping[str, ConfigAck | None]:
        return {}  # no Node is connected to a fake hub: nothing to push

    def nodes(self) -> Mapping[str, NodeStatus]:
        return {}

    def payload_digests(self) -> Mapping[str, str]:
        return {}

    def connect(self, *provider_ids: str, node_id: str = "node-1", healthy: bool = True) -> None:
        for pid in provider_ids:
            self.providers[pid] = ProviderLink(pid, node_id, healthy)
        for callback in self.listeners:
            callback()

    def disconnect(self, *provider_ids: str) -> None:
        for pid in provider_ids:
            self.providers.pop(pid, None)
        for callback in self.listeners:
            callback()


def _check_protocol(hub: FakeHub) -> Hub:
    return hub  # mypy checks that the fake implements the Protocol


@pytest.fixture
def fake_hub() -> FakeHub:
    """A fresh fake hub for each test."""
    return FakeHub()


# -- live refresh: an in-process Edge with its admin API, and node-1 connected --------------------


@dataclass
class RefreshStack:
    """An Edge (in-process, admin API on), node-1 connected, and clients for both APIs."""

    edge: Any
    node: Any
    http: httpx.AsyncClient
    admin: httpx.AsyncClient

    async def refresh(
        self, document: Any, mode: str = "apply", *, status: int | None = 200, **body: Any
    ) -> dict[str, Any]:
        """POST /refresh with `document` as the config object; asserts the status."""
        payload = {"mode": mode, **({"config": document} if document is not None else {}), **body}
        response = await self.admin.post("/refresh", json=payload)
        if status is not None:
            assert response.status_code == status, response.text
        report: dict[str, Any] = response.json()
        return report

    async def current(self) -> dict[str, Any]:
        response = await self.admin.get("/config")
        assert response.status_code == 200, response.text
        document: dict[str, Any] = response.json()
        return document

    @staticmethod
    def served(response: httpx.Response) -> str:
        """The model name the answering provider was asked for (`served-<letter>` by default)."""
        assert response.status_code == 200, response.text
        model: str = response.json()["model"]
        return model

    async def chat(self, model: str = "m", **body: Any) -> httpx.Response:
        document = {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}
        return await self.http.post("/v1/chat/completions", json=document)


@pytest.fixture
async def refresh_stack(
    start_edge, start_node, refresh_document, refresh_client_token, until
) -> AsyncIterator[Callable[..., Any]]:
    """`await refresh_stack(document=None, **node_options)`: a `RefreshStack`."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            document: dict[str, Any] | None = None, **node_options: Any
        ) -> RefreshStack:
            document = document if document is not None else refresh_document()
            edge = await start_edge(document)
            node = await start_node(edge.hub, **node_options)
            wanted = {p["id"] for p in document["nodes"][0]["providers"] if p.get("enabled", True)}
            await until(lambda: wanted <= edge.dispatcher.available)
            http = await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=edge.url,
                    headers={"authorization": f"Bearer {refresh_client_token}"},
                    timeout=30,
                )
            )
            admin = await stack.enter_async_context(
                httpx.AsyncClient(base_url=edge.admin_url, timeout=30)
            )
            return RefreshStack(edge, node, http, admin)

        yield start
