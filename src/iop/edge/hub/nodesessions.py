"""One connected Node as the Edge sees it: its stream's writer, its runs, its health and acks.

A `NodeSession` lives as long as its Node's `Connect` stream: it owns the stream's single writer
(`edge_message` packs a batch of it into one message), the runs in flight on it (each a
`RunStream`, `runstreams.py`), the health the Node reported, the config it acknowledged and when
it last heard from the Node; when it ends, every run still on it fails at once with
`node_disconnected`. docs/reliability.md ("Liveness of the Node links", "Slow stream clients")
says why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence

import grpc

from iop.aiokits import LogThrottle
from iop.edgeconfig import NodePayload
from iop.wire import (
    DRAINING,
    NOT_PROBED,
    TERMINAL_EVENTS,
    CoalescingWriter,
    ConfigAck,
    DrainProgress,
    ProviderHealth,
    RunChunk,
    ack_from_proto,
    drain_from_proto,
    event_from_proto,
    health_from_proto,
    request_to_proto,
    server_load_from_proto,
    statuses,
)
from iop.wire import runtime_pb2 as pb

from .protocol import InstanceDrain, NodeStatus, ProviderLoad
from .runstreams import FlowSignal, RunStream

logger = logging.getLogger(__name__)


#: What the Edge sends a Node: runs, cancellations, config pushes, heartbeats, flow signals.
EdgeItem = pb.RunRequest | pb.Cancel | pb.NodeConfigRefreshRequest | pb.Heartbeat | FlowSignal


def edge_message(batch: Sequence[EdgeItem]) -> pb.EdgeMessage:
    message = pb.EdgeMessage()
    for item in batch:
        if isinstance(item, pb.RunRequest):
            message.runs.append(item)
        elif isinstance(item, pb.Cancel):
            message.cancels.append(item)
        elif isinstance(item, FlowSignal):
            (message.pause_runs if item.pause else message.resume_runs).append(item.run_id)
        elif isinstance(item, pb.Heartbeat):
            message.heartbeat.CopyFrom(item)
        else:
            message.refresh.CopyFrom(item)
    return message


class NodeSession:
    """A connected, authenticated Node: its stream's writer, its runs, its health and acks."""

    def __init__(
        self,
        *,
        node_id: str,
        alias: str,
        instance_id: str,
        started_at: float,
        peer: str,
        payload: NodePayload,
        generation: int,
        on_change: Callable[[], None],
        quiet_when_idle: bool = False,
        quiet_one_way: bool = False,
    ) -> None:
        self.node_id = node_id
        self.alias = alias
        self.instance_id = instance_id
        #: When the node process started (its own clock): the newest instance of a node id wins.
        self.started_at = started_at
        self.peer = peer
        self._loop = asyncio.get_running_loop()
        #: Loop time of the last message of any kind from the Node.
        self.last_heard = self._loop.time()
        #: The Node keeps the link quiet while no run is in flight on it (its hello said so).
        self.quiet_when_idle = quiet_when_idle
        #: ... and needs no heartbeat from this Edge on it then (its hello asked, the welcome
        #: says so): this side sends none of its own while the link is quiet.
        self.quiet_one_way = quiet_when_idle and quiet_one_way
        #: Loop time this side last sent a message: a heartbeat or any other, since each tells
        #: the Node this Edge is alive (a heartbeat is due an interval after the last of them).
        self.last_sent = self._loop.time()
        #: Runs sent and neither accepted nor answered yet: run id -> loop time sent (in order).
        self.unaccepted: dict[str, float] = {}
        #: Set once a newer instance of the node took over: this session only finishes its runs.
        self.superseded_by: str | None = None
        self.payload = payload
        self.connected_at = time.time()
        self.runs: dict[str, RunStream] = {}
        self.health: dict[str, ProviderHealth] = {}
        #: What the Node last said about its drains (a swap's, or its shutdown).
        self.drain = DrainProgress()
        self.ready = False
        self.welcome_generation = generation
        #: The last payload sent (on welcome or by a refresh): its digest and generation.
        self.payload_digest = payload.digest
        self.payload_generation = generation
        self.applied_generation = 0
        self.applied_hash = ""
        #: The digest of the payload the Node process runs, as its last ack said ("" before one):
        #: the acknowledged one, or what it keeps while its Edges disagree (a pending ack).
        self.in_use_hash = ""
        self.last_heartbeat: float | None = None
        self.node_in_flight: dict[str, int] = {}
        #: provider id -> its load as the last heartbeat said (what least_load reads).
        self.loads: dict[str, ProviderLoad] = {}
        self.acks: dict[int, asyncio.Future[ConfigAck]] = {}
        self.writer: CoalescingWriter[EdgeItem] | None = None
        self.closing: asyncio.Future[tuple[grpc.StatusCode, str]] = self._loop.create_future()
        self._on_change = on_change
        #: Streamed runs paused for a slow client, by run id (the hub ends those stalled too long).
        self.paused: dict[str, RunStream] = {}
        #: The Node's repeated log lines, throttled per kind (and provider).
        self._logs: dict[str, LogThrottle] = {}
        self._known = (payload, frozenset(provider.id for provider in payload.providers))

    @property
    def rank(self) -> tuple[float, str]:
        """Which of two instances of one node id wins: the one that started last."""
        return (self.started_at, self.instance_id)

    def instance_drain(self) -> InstanceDrain:
        """This session as an older instance finishing its runs (see `InstanceDrain`)."""
        drain = self.drain
        if not drain.draining:
            left: dict[str, int] = {}
            for stream in self.runs.values():
                provider_id = stream.request.provider_id
                left[provider_id] = left.get(provider_id, 0) + 1
            drain = DrainProgress(False, left)
        return InstanceDrain(self.instance_id, len(self.runs), drain)

    def status(self, superseded: Iterable[InstanceDrain]) -> NodeStatus:
        """This session for status pages, with the older instances of its node (`superseded`)."""
        return NodeStatus(
            self.node_id,
            self.alias,
            self.instance_id,
            self.peer,
            self.ready,
            self.applied_generation,
            self.applied_hash,
            len(self.runs),
            self.connected_at,
            self.drain,
            tuple(sorted(superseded, key=lambda d: d.instance_id)),
        )

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
            return
        self.unaccepted[run_id] = self._loop.time()

    def forget(self, run_id: str) -> RunStream | None:
        """Take a run off this session (cancelled on the Edge's side); returns its stream."""
        stream = self.runs.pop(run_id, None)
        if self.unaccepted:
            self.unaccepted.pop(run_id, None)
        if self.paused:
            self.paused.pop(run_id, None)
        if self.superseded_by is not None and not self.runs:
            self.close(statuses.SUPERSEDED, f"superseded by instance {self.superseded_by}")
        return stream

    def supersede(self, instance_id: str) -> None:
        """A newer instance of this node took over: finish the runs in flight, then end."""
        self.superseded_by = instance_id
        if not self.runs:
            self.close(statuses.SUPERSEDED, f"superseded by instance {instance_id}")

    def expire_unaccepted(self, now: float, timeout: float) -> int:
        """Fail the runs the Node neither accepted nor answered within `timeout`; how many."""
        expired = []
        for run_id, sent in self.unaccepted.items():
            if now - sent <= timeout:
                break  # sent in order: every later one is younger
            expired.append(run_id)
        for run_id in expired:
            stream = self.forget(run_id)
            if stream is not None:
                self.writer_put(pb.Cancel(run_id=run_id))
                stream.fail(
                    statuses.NOT_ACCEPTED,
                    f"node {self.node_id} did not accept the run within {timeout:g}s",
                )
        return len(expired)

    def receive(self, message: pb.NodeMessage) -> None:
        """Apply one message from the Node: events to their runs, health, acks, heartbeat."""
        self.last_heard = self._loop.time()
        runs = self.runs
        unaccepted = self.unaccepted
        if unaccepted:
            for run_id in message.accepted_runs:
                unaccepted.pop(run_id, None)
        for item in message.events:
            stream = runs.get(item.run_id)
            if stream is None:
                continue  # cancelled on this side already
            if unaccepted:
                unaccepted.pop(item.run_id, None)
            event = event_from_proto(item)
            if type(event) is RunChunk and item.chunk.more:
                stream.piece(event.data)
                continue
            if isinstance(event, TERMINAL_EVENTS):
                self.forget(item.run_id)
            stream.deliver(event)
        changed = self.receive_health(message.health) if message.health else False
        if message.HasField("drain"):
            self._drained(drain_from_proto(message.drain))
        for ack in message.acks:
            changed = self._acknowledged(ack_from_proto(ack)) or changed
        if message.HasField("heartbeat"):
            now = self.last_heartbeat = time.monotonic()
            heartbeat = message.heartbeat
            known = self._known_providers()
            in_flight = self.node_in_flight = {
                pid: runs for pid, runs in heartbeat.in_flight.items() if pid in known
            }
            servers = heartbeat.server_load
            elsewhere = heartbeat.in_flight_elsewhere
            self.loads = {
                provider.id: ProviderLoad(
                    in_flight.get(provider.id, 0),
                    server_load_from_proto(servers[provider.id])
                    if provider.id in servers
                    else None,
                    now,
                    elsewhere.get(provider.id, 0),
                )
                for provider in self.payload.providers
            }
        if changed and self.ready:
            self._on_change()

    def receive_health(self, reports: Iterable[pb.ProviderHealth]) -> bool:
        """Apply the Node's health reports (its hello's, or a message's); True when one changed.

        A report for a provider this Node's payload does not hold is refused: nothing stores
        it, and one (throttled) line says how many came and which, whatever their number.
        """
        changed = False
        known = self._known_providers()
        unknown: list[str] = []
        for report in reports:
            health = health_from_proto(report)
            provider_id = health.provider_id
            if provider_id not in known:
                unknown.append(provider_id)
                continue
            before = self.health.get(provider_id)
            if before == health:
                continue
            self.health[provider_id] = health
            changed = True
            if not health.healthy:
                # Not probed yet (every provider's first word) and draining (a node leaving
                # on purpose) are no cause for a warning.
                planned = health.reason in (NOT_PROBED, DRAINING)
                self._log(f"down:{provider_id}").log(
                    logging.INFO if planned else logging.WARNING,
                    "node %s: provider %s unhealthy (%s): %s",
                    self.node_id,
                    provider_id,
                    health.reason or "unspecified",
                    health.detail,
                )
            elif before is not None and not before.healthy:
                self._log(f"up:{provider_id}").info(
                    "node %s: provider %s healthy again", self.node_id, provider_id
                )
        if unknown:
            shown = ", ".join(repr(pid) for pid in unknown[:5])
            self._log("unknown").warning(
                "node %s reported the health of %d provider(s) its config does not hold "
                "(ignored): %s%s",
                self.node_id,
                len(unknown),
                shown,
                ", ..." if len(unknown) > 5 else "",
            )
        return changed

    def _known_providers(self) -> frozenset[str]:
        """The provider ids of the payload last sent to the Node."""
        payload, known = self._known
        if payload is not self.payload:
            payload = self.payload
            known = frozenset(provider.id for provider in payload.providers)
            self._known = (payload, known)
        return known

    def _log(self, kind: str) -> LogThrottle:
        """The throttle of one kind of this Node's lines (at most one line a minute each)."""
        throttle = self._logs.get(kind)
        if throttle is None:
            throttle = self._logs[kind] = LogThrottle(logger)
        return throttle

    def _drained(self, progress: DrainProgress) -> None:
        known = self._known_providers()
        if any(pid not in known for pid in progress.runs_left):
            runs_left = {pid: n for pid, n in progress.runs_left.items() if pid in known}
            progress = DrainProgress(progress.shutting_down, runs_left)
        before, self.drain = self.drain, progress
        if progress.draining and not before.draining:
            what = "to exit" if progress.shutting_down else "replaced adapters"
            self._log("drain").info(
                "node %s is draining (%s): %d run(s) left", self.node_id, what, progress.total
            )
        elif before.draining and not progress.draining:
            self._log("drained").info("node %s: drain done", self.node_id)

    def _acknowledged(self, ack: ConfigAck) -> bool:
        future = self.acks.pop(ack.generation, None)
        if future is not None and not future.done():
            future.set_result(ack)
        if not ack.ok:
            self._log("refused").error(
                "node %s refused config generation %d: %s", self.node_id, ack.generation, ack.error
            )
            return False
        if ack.generation >= self.applied_generation:
            self.applied_generation = ack.generation
            self.applied_hash = ack.config_hash
            self.in_use_hash = ack.in_use_hash if ack.pending else ack.config_hash
        if not self.ready and ack.generation >= self.welcome_generation:
            self.ready = True
            return True
        return False

    def close(self, code: grpc.StatusCode, reason: str) -> None:
        """Ask the session to end (its handler returns with the gRPC status `code`)."""
        if not self.closing.done():
            self.closing.set_result((code, reason))

    def expire_stalled(self, now: float, timeout: float) -> int:
        """Stop the streams paused for their client longer than `timeout`; how many."""
        stalled = [
            stream
            for stream in self.paused.values()
            if stream.paused_at is not None and now - stream.paused_at > timeout
        ]
        for stream in stalled:
            stream.stall(timeout)
        return len(stalled)

    def fail_runs(self, code: str, message: str) -> None:
        runs, self.runs = self.runs, {}
        self.unaccepted.clear()
        self.paused.clear()
        for stream in runs.values():
            stream.fail(code, message)
        for future in self.acks.values():
            future.cancel()
        self.acks.clear()
