"""One connected Node as the Edge sees it, and the stream of one run on it.

A `NodeSession` lives as long as its Node's `Connect` stream: it owns that stream's single
writer, the runs in flight on it, the providers' health the Node reported and the config
generation it acknowledged. A `RunStream` is what `NodeHub.run` hands the dispatch layer: an
async iterator of the run's events and an async context manager whose early exit cancels the run
on the Node at once. When the session ends, every run still in flight on it fails at once with
`node_disconnected`, so nothing hangs on a Node that went away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

import grpc

from iop import runtime_pb2 as pb
from iop.edgeconfig import NodePayload
from iop.wire import (
    TERMINAL_EVENTS,
    CoalescingWriter,
    ProviderHealth,
    RunChunk,
    RunEvent,
    RunFailed,
    RunRequest,
    statuses,
)
from iop.wire.converting import event_from_proto, health_from_proto, request_to_proto

if TYPE_CHECKING:
    from .nodehub import NodeHub

__all__ = ["EdgeItem", "NodeSession", "RunStream"]

logger = logging.getLogger(__name__)

#: What the Edge sends a Node: runs, cancellations and config pushes.
EdgeItem = pb.RunRequest | pb.Cancel | pb.NodeConfigRefreshRequest


def edge_message(batch: Sequence[EdgeItem]) -> pb.EdgeMessage:
    message = pb.EdgeMessage()
    for item in batch:
        if isinstance(item, pb.RunRequest):
            message.runs.append(item)
        elif isinstance(item, pb.Cancel):
            message.cancels.append(item)
        else:
            message.refresh.CopyFrom(item)
    return message


class RunStream:
    """The events of one run, in order, ending with exactly one `RunDone` or `RunFailed`.

    `async with hub.run(request) as stream: async for event in stream: ...`. Leaving the block
    before the terminal event (the client went away, an error) sends Cancel to the Node at once
    and frees the run on the Edge; the Node then aborts the upstream request. Iterating without
    the `async with` also works, but then only `aclose()` cancels early.
    """

    __slots__ = (
        "_events",
        "_finished",
        "_hub",
        "_saw_chunk",
        "_session",
        "_started",
        "_waiter",
        "request",
    )

    def __init__(self, hub: NodeHub, request: RunRequest) -> None:
        self.request = request
        self._hub = hub
        self._session: NodeSession | None = None
        self._events: deque[RunEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._started = False
        self._finished = False
        self._saw_chunk = False

    async def __aenter__(self) -> RunStream:
        self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cancel()

    def __aiter__(self) -> RunStream:
        return self

    async def __anext__(self) -> RunEvent:
        if not self._started:
            self._start()
        while not self._events:
            if self._finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._consume()

    def take_ready(self) -> list[RunEvent]:
        """The events that arrived and were not consumed yet, without waiting (up to and with
        the terminal one): what the caller can write out in one go."""
        taken: list[RunEvent] = []
        while self._events and not self._finished:
            taken.append(self._consume())
        return taken

    def _consume(self) -> RunEvent:
        """Hand the oldest event to the consumer. Both ways out (`__anext__`, `take_ready`) go
        through here, so whatever consuming an event must update is updated once, here."""
        event = self._events.popleft()
        if isinstance(event, TERMINAL_EVENTS):
            self._finished = True
        return event

    async def aclose(self) -> None:
        self.cancel()

    @property
    def node_id(self) -> str | None:
        """The node the run went to (None when it never left the Edge)."""
        return None if self._session is None else self._session.node_id

    def cancel(self) -> None:
        """Stop the run now unless it has ended: Cancel goes to the Node, nothing more arrives."""
        if not self._started:
            self._started = True
            self._finished = True
            return
        session = self._session
        if session is not None and session.runs.pop(self.request.run_id, None) is self:
            session.writer_put(pb.Cancel(run_id=self.request.run_id))
        self._session = None
        self._finished = True
        self._wake()

    def _start(self) -> None:
        self._started = True
        self._hub._start_run(self)

    def attach(self, session: NodeSession) -> None:
        self._session = session

    def deliver(self, event: RunEvent) -> None:
        """Queue an event for the consumer (called by the session's reader)."""
        if isinstance(event, RunChunk):
            self._saw_chunk = True
        elif isinstance(event, TERMINAL_EVENTS):
            self._session = None
        self._events.append(event)
        self._wake()

    def fail(self, code: str, message: str) -> None:
        """End the run with a failure; retryable only while nothing reached the client."""
        failed = statuses.failure(code, message)
        if failed.code == statuses.NODE_DISCONNECTED:
            failed = RunFailed(failed.code, failed.message, not self._saw_chunk, None)
        self.deliver(failed)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class NodeSession:
    """A connected, authenticated Node: its stream's writer, its runs, its health and acks."""

    def __init__(
        self,
        *,
        node_id: str,
        alias: str,
        instance_id: str,
        peer: str,
        payload: NodePayload,
        generation: int,
        on_change: Callable[[], None],
    ) -> None:
        self.node_id = node_id
        self.alias = alias
        self.instance_id = instance_id
        self.peer = peer
        self.payload = payload
        self.connected_at = time.time()
        self.runs: dict[str, RunStream] = {}
        self.health: dict[str, ProviderHealth] = {}
        self.ready = False
        self.welcome_generation = generation
        #: The last payload sent (on welcome or by a refresh): its digest and generation.
        self.payload_digest = payload.digest
        self.payload_generation = generation
        self.applied_generation = 0
        self.applied_hash = ""
        self.last_heartbeat: float | None = None
        self.node_in_flight: dict[str, int] = {}
        self.acks: dict[int, asyncio.Future[pb.ConfigAck]] = {}
        self.writer: CoalescingWriter[EdgeItem] | None = None
        self.closing: asyncio.Future[tuple[grpc.StatusCode, str]] = (
            asyncio.get_running_loop().create_future()
        )
        self._on_change = on_change

    def writer_put(self, item: EdgeItem) -> bool:
        writer = self.writer
        return writer is not None and writer.put(item)

    def send_run(self, stream: RunStream) -> None:
        run_id = stream.request.run_id
        if run_id in self.runs:
            stream.fail(statuses.INTERNAL_ERROR, f"run id {run_id!r} is already in flight")
            return
        self.runs[run_id] = stream
        stream.attach(self)
        if not self.writer_put(request_to_proto(stream.request)):
            self.runs.pop(run_id, None)
            stream.fail(statuses.NODE_DISCONNECTED, f"node {self.node_id} is disconnecting")

    def receive(self, message: pb.NodeMessage) -> None:
        """Apply one message from the Node: events to their runs, health, acks, heartbeat."""
        runs = self.runs
        for item in message.events:
            stream = runs.get(item.run_id)
            if stream is None:
                continue  # cancelled on this side already
            event = event_from_proto(item)
            if isinstance(event, TERMINAL_EVENTS):
                del runs[item.run_id]
            stream.deliver(event)
        changed = False
        for report in message.health:
            health = health_from_proto(report)
            if self.health.get(health.provider_id) != health:
                self.health[health.provider_id] = health
                changed = True
                if not health.healthy:
                    logger.warning(
                        "node %s: provider %s unhealthy: %s",
                        self.node_id,
                        health.provider_id,
                        health.detail,
                    )
        for ack in message.acks:
            changed = self._acknowledged(ack) or changed
        if message.HasField("heartbeat"):
            self.last_heartbeat = time.monotonic()
            self.node_in_flight = dict(message.heartbeat.in_flight)
        if changed and self.ready:
            self._on_change()

    def _acknowledged(self, ack: pb.ConfigAck) -> bool:
        future = self.acks.pop(ack.generation, None)
        if future is not None and not future.done():
            future.set_result(ack)
        if not ack.ok:
            logger.error(
                "node %s refused config generation %d: %s", self.node_id, ack.generation, ack.error
            )
            return False
        if ack.generation >= self.applied_generation:
            self.applied_generation = ack.generation
            self.applied_hash = ack.config_hash
        if not self.ready and ack.generation >= self.welcome_generation:
            self.ready = True
            return True
        return False

    def close(self, code: grpc.StatusCode, reason: str) -> None:
        """Ask the session to end (its handler returns with the gRPC status `code`)."""
        if not self.closing.done():
            self.closing.set_result((code, reason))

    def fail_runs(self, code: str, message: str) -> None:
        runs, self.runs = self.runs, {}
        for stream in runs.values():
            stream.fail(code, message)
        for future in self.acks.values():
            future.cancel()
        self.acks.clear()
