"""One Node-Edge connection, kept up: dial, hello, serve runs, and redial with backoff on loss.

The Node dials (it may sit behind NAT). Per connection there is one bidirectional stream, one
reader (this coroutine) and one `CoalescingWriter`; runs share them. Every run is a task owned
by the connection that received it: a Cancel from the Edge or the loss of the connection
cancels the task, which aborts the upstream request at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from iop import runtime_pb2 as pb
from iop.aiokits import guarded_task, stop_tasks
from iop.runtime_pb2_grpc import NodeRuntimeStub
from iop.wire import (
    PROTOCOL_VERSION,
    CoalescingWriter,
    ProviderHealth,
    RunEvent,
    RunFailed,
    grpc_options,
    statuses,
)
from iop.wire.converting import (
    event_to_proto,
    health_to_proto,
    payload_from_proto,
    request_from_proto,
)

from .routing import Router

__all__ = ["Backoff", "EdgeConnection", "NodeIdentity"]

logger = logging.getLogger(__name__)

_Outgoing = pb.RunEvent | pb.ProviderHealth | pb.ConfigAck | pb.Heartbeat


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    node_id: str
    token: str = field(repr=False)
    alias: str | None = None
    instance_id: str = ""


@dataclass(slots=True)
class Backoff:
    """Jittered exponential backoff: the n-th wait is uniform in [d/2, d], d = initial * 2^n."""

    initial: float = 0.1
    maximum: float = 10.0
    attempt: int = 0

    def next_delay(self, *, slowest: bool = False) -> float:
        ceiling = self.maximum if slowest else min(self.maximum, self.initial * 2**self.attempt)
        self.attempt += 1
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0


class _StreamEnded(Exception):
    """The Edge ended the stream (or never welcomed us)."""


def _message(batch: Sequence[_Outgoing]) -> pb.NodeMessage:
    message = pb.NodeMessage()
    for item in batch:
        if isinstance(item, pb.RunEvent):
            message.events.append(item)
        elif isinstance(item, pb.ProviderHealth):
            message.health.append(item)
        elif isinstance(item, pb.ConfigAck):
            message.acks.append(item)
        else:
            message.heartbeat.CopyFrom(item)
    return message


class EdgeConnection:
    """Keeps this Node connected to the Edge at `target` until cancelled."""

    def __init__(
        self,
        target: str,
        identity: NodeIdentity,
        router: Router,
        *,
        backoff: Backoff | None = None,
        heartbeat_interval: float = 15.0,
    ) -> None:
        self.target = target
        self.identity = identity
        self.router = router
        self.backoff = backoff or Backoff()
        self.heartbeat_interval = heartbeat_interval
        self.edge_id: str | None = None
        self.connected = asyncio.Event()
        self.welcomes = 0
        #: Config refreshes received from the Edge on this connection (beyond the welcome's).
        self.refreshes = 0
        self.last_error = ""
        #: Sessions that ended in a refusal, a lost stream or an error (each one is redialed).
        self.failures = 0
        self._writer: CoalescingWriter[_Outgoing] | None = None
        self._runs: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        """Connect, serve, and reconnect after every loss, until cancelled.

        Only cancellation ends this loop. A refusal or a lost stream is expected and logged in
        a line; anything else is a bug somewhere below (an adapter that fails to build from a
        pushed config, say), logged with its traceback, and the Node reconnects all the same:
        a Node that stays up but disconnected would serve nothing and say nothing.
        """
        while True:
            slowest = False
            unexpected: Exception | None = None
            try:
                await self._session()
                self.last_error = "the Edge ended the stream"
            except grpc.aio.AioRpcError as exc:
                refusal = statuses.describe_connection_error(exc.code(), exc.details())
                slowest = refusal.permanent
                self.last_error = refusal.description
            except _StreamEnded as exc:
                self.last_error = str(exc)
            except Exception as exc:
                unexpected = exc
                self.last_error = f"unexpected error: {exc!r}"
            self.failures += 1
            delay = self.backoff.next_delay(slowest=slowest)
            log = logger.error if slowest or unexpected else logger.warning
            log(
                "edge %s: %s; retrying in %.2fs",
                self.target,
                self.last_error,
                delay,
                exc_info=unexpected,
            )
            await asyncio.sleep(delay)

    async def _session(self) -> None:
        async with grpc.aio.insecure_channel(self.target, options=grpc_options()) as channel:
            call = NodeRuntimeStub(channel).Connect()
            hello = pb.Hello(
                protocol_version=PROTOCOL_VERSION,
                node_id=self.identity.node_id,
                alias=self.identity.alias or "",
                token=self.identity.token,
                instance_id=self.identity.instance_id,
                health=[health_to_proto(h) for h in self.router.health()],
            )
            await call.write(pb.NodeMessage(hello=hello))
            first = await call.read()
            if not isinstance(first, pb.EdgeMessage) or not first.HasField("welcome"):
                raise _StreamEnded("the Edge ended the stream without a welcome")
            welcome = first.welcome

            async def send(batch: Sequence[_Outgoing]) -> None:
                await call.write(_message(batch))

            name = f"node-writer-{self.target}"
            async with CoalescingWriter(send, name=name) as writer:
                self._writer = writer
                # Health reaches the Edge through this session's writer: listen only while it
                # lives, so connections that come and go leave no listener behind.
                self.router.add_health_listener(self._on_health)
                heartbeat = guarded_task(
                    self._heartbeat(writer), name=f"node-heartbeat-{self.target}", logger=logger
                )
                try:
                    writer.put(self._apply(welcome.config))
                    self._on_health(self.router.health())
                    self.edge_id = welcome.edge_id
                    self.welcomes += 1
                    self.backoff.reset()
                    self.connected.set()
                    logger.info("connected to edge %s at %s", welcome.edge_id, self.target)
                    await self._read(call, writer)
                finally:
                    self.router.remove_health_listener(self._on_health)
                    self.connected.clear()
                    self._writer = None
                    await stop_tasks([heartbeat, *self._runs.values()])
                    call.cancel()

    async def _read(
        self,
        call: grpc.aio.StreamStreamCall[pb.NodeMessage, pb.EdgeMessage],
        writer: CoalescingWriter[_Outgoing],
    ) -> None:
        while True:
            message = await call.read()
            if not isinstance(message, pb.EdgeMessage):
                raise _StreamEnded("the Edge ended the stream")
            for request in message.runs:
                self._start(request, writer)
            for cancel in message.cancels:
                task = self._runs.get(cancel.run_id)
                if task is not None:
                    task.cancel()
            if message.HasField("refresh"):
                self.refreshes += 1
                writer.put(self._apply(message.refresh.config))

    def _start(self, message: pb.RunRequest, writer: CoalescingWriter[_Outgoing]) -> None:
        run_id = message.run_id
        try:
            request = request_from_proto(message)
        except ValueError as exc:
            writer.put(event_to_proto(run_id, statuses.failure(statuses.BAD_REQUEST, str(exc))))
            return
        admitted = self.router.admit(request)
        if isinstance(admitted, RunFailed):
            writer.put(event_to_proto(run_id, admitted))
            return

        def emit(event: RunEvent) -> None:
            writer.put(event_to_proto(run_id, event))

        task = guarded_task(
            self.router.execute(request, admitted, emit), name=f"run-{run_id}", logger=logger
        )
        self._runs[run_id] = task
        task.add_done_callback(lambda _: self._runs.pop(run_id, None))

    def _apply(self, config: pb.NodeConfig) -> pb.ConfigAck:
        try:
            payload, generation = payload_from_proto(config)
        except ValueError as exc:
            logger.error("edge %s sent a config this node cannot read: %s", self.target, exc)
            return pb.ConfigAck(
                generation=config.generation, config_hash=config.config_hash, error=str(exc)
            )
        if payload.node_id != self.identity.node_id:
            error = f"config is for node {payload.node_id!r}, this is {self.identity.node_id!r}"
            return pb.ConfigAck(generation=generation, config_hash=config.config_hash, error=error)
        digest = payload.digest
        if digest != config.config_hash:
            logger.warning("config hash mismatch: edge %s, node %s", config.config_hash, digest)
        self.router.apply(payload, digest)
        return pb.ConfigAck(generation=generation, config_hash=digest, ok=True)

    def _on_health(self, health: list[ProviderHealth]) -> None:
        writer = self._writer
        if writer is not None:
            for item in health:
                writer.put(health_to_proto(item))

    async def _heartbeat(self, writer: CoalescingWriter[_Outgoing]) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            writer.put(pb.Heartbeat(sent_at=time.time(), in_flight=self.router.in_flight()))
