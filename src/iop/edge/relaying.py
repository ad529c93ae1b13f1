"""One request's trip through the pool and a Node: lease a slot, run, meter, give the slot back.

`Relay.open()` returns a `RelayedRun`, an async context manager that yields the run's events.
Entering it leases a slot (waiting in the queue if needs be), starts the run on the provider's
Node and waits for the first event, so that a failure before anything reached the client can
still be retried:

- `provider_busy` (the Node's capacity is shared with other Edges): the slot goes back, the
  provider cools down briefly, and the request tries another candidate or waits, with its original
  queue deadline; it never fails the request by itself.
- other retryable failures (node gone, provider unknown to its Node, upstream unreachable...): the
  same, at most `MAX_RETRIES` times; then the failure is the answer.

The slot goes back as soon as the run has ended on its Node, even while a slow client still
reads the end of its answer from the Edge's buffer: the provider is free then. Leaving the
context (normally, by an error or by cancellation when the client disconnects) closes the run,
which cancels it on the Node at once, and releases the slot if it was still held.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Final, Self

from iop.wire import TERMINAL_EVENTS, RunEvent, RunFailed, RunRequest, RunUsage
from iop.wire import statuses as wire_statuses

from .authenticating import Principal
from .bodies import ParsedRequest
from .dispatching import Dispatcher, Lease
from .hubs import NodeRuns, RunEvents
from .metering import Metrics

__all__ = ["MAX_RETRIES", "Relay", "RelayedRun"]

#: Retries after retryable failures other than `provider_busy` (which retries until the deadline).
MAX_RETRIES: Final = 2


class Relay:
    """Runs parsed requests through the dispatcher and the node hub."""

    def __init__(self, dispatcher: Dispatcher, hub: NodeRuns, metrics: Metrics) -> None:
        self._dispatcher = dispatcher
        self._hub = hub
        self._metrics = metrics
        self._run_ids = itertools.count(1)
        self._run_prefix = os.urandom(4).hex()

    def open(self, request: ParsedRequest, long: bool, principal: Principal) -> RelayedRun:
        return RelayedRun(self, request, long, principal)

    def _run_id(self) -> str:
        return f"{self._run_prefix}-{next(self._run_ids):x}"


class RelayedRun:
    """The events of one request's run, from its first event on."""

    def __init__(
        self, relay: Relay, request: ParsedRequest, long: bool, principal: Principal
    ) -> None:
        self._relay = relay
        self._request = request
        self._long = long
        self._principal = principal
        self._lease: Lease | None = None
        self._stream: RunEvents | None = None
        self._events: AsyncIterator[RunEvent] | None = None
        self._first: RunEvent | None = None

    @property
    def provider_id(self) -> str:
        return self._lease.provider_id if self._lease is not None else ""

    @property
    def lease(self) -> Lease | None:
        return self._lease

    async def __aenter__(self) -> Self:
        relay = self._relay
        dispatcher = relay._dispatcher
        request = self._request
        deadline: float | None = None
        retries = 0
        while True:
            lease = await dispatcher.acquire(
                request.model,
                self._long,
                deadline=deadline,
                principal=self._principal.principal_ref,
            )
            if deadline is None:
                relay._metrics.observe_queue_wait(
                    request.model, self._principal.principal_ref, lease.waited_s
                )
            deadline = lease.deadline
            self._lease = lease
            try:
                first = await self._start(lease)
            except BaseException:
                dispatcher.release(lease)
                self._lease = None
                raise
            if (
                isinstance(first, RunFailed)
                and first.retryable
                and (first.code == wire_statuses.PROVIDER_BUSY or retries < MAX_RETRIES)
            ):
                if first.code != wire_statuses.PROVIDER_BUSY:
                    retries += 1
                await self._close_stream(None, None, None)
                dispatcher.refuse(lease)
                self._lease = None
                continue
            self._first = first
            stream = self._stream
            assert stream is not None
            stream.on_end(functools.partial(dispatcher.release, lease))
            return self

    async def _start(self, lease: Lease) -> RunEvent:
        request = self._request
        stream = self._relay._hub.run(
            RunRequest(
                run_id=self._relay._run_id(),
                provider_id=lease.provider_id,
                served_model=lease.served_model,
                kind=request.kind,
                body=request.encode(lease.served_model),
                stream=request.stream,
                long_context=self._long,
            )
        )
        await stream.__aenter__()
        self._stream = stream
        events = stream.__aiter__()
        self._events = events
        try:
            return await anext(events)
        except BaseException as exc:
            await self._close_stream(type(exc), exc, exc.__traceback__)
            raise

    async def _close_stream(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stream, self._stream, self._events = self._stream, None, None
        if stream is not None:
            await stream.__aexit__(exc_type, exc, tb)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._close_stream(exc_type, exc, tb)
        finally:
            if self._lease is not None:
                self._relay._dispatcher.release(self._lease)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RunEvent:
        event = self._first
        if event is not None:
            self._first = None
        else:
            if self._events is None:
                raise StopAsyncIteration
            event = await anext(self._events)
        if isinstance(event, RunUsage):
            self._meter(event)
        return event

    def take_ready(self) -> list[RunEvent]:
        """The events that already arrived, without waiting (see `RunEvents.take_ready`)."""
        taken: list[RunEvent] = []
        if self._first is not None:
            taken.append(self._first)
            self._first = None
        if self._stream is not None and not (taken and isinstance(taken[0], TERMINAL_EVENTS)):
            taken.extend(self._stream.take_ready())
        for event in taken:
            if isinstance(event, RunUsage):
                self._meter(event)
        return taken

    def _meter(self, usage: RunUsage) -> None:
        lease = self._lease
        assert lease is not None
        self._relay._metrics.count_usage(
            self._principal,
            self._request.model,
            lease.provider_id,
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens,
        )
