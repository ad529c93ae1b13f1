"""One Node-Edge connection, kept up: dial, hello, serve runs, and redial with backoff on loss.

Per connection: one bidirectional stream, one reader, one `CoalescingWriter` and one keep-alive
task, shared by its runs, each a task the connection owns (a Cancel or the connection's loss
cancels it, aborting the upstream request). The keep-alive task sends heartbeats and leaves an
Edge silent past the deadline (none on a quiet link whose beats go one way: the transport finds
a stopped Edge there); admitted runs are listed in `accepted_runs`; the Edge's pause reaches a
run's `RunGate`. `leave()` ends a link on purpose without losing a message: it ends its
half of the stream and waits for the Edge to close it. docs/reliability.md ("Liveness of the
Node links", "Node drain") says why; docs/architecture.md, "The Node", has the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import grpc.aio

from iop.aiokits import guarded_task, stop_tasks
from iop.providers import FIRST_BYTE_TIMEOUT, RunGate, Runner
from iop.wire import (
    DEFAULT_LIVENESS,
    DRAINING,
    PROTOCOL_VERSION,
    ClientTls,
    CoalescingWriter,
    DrainProgress,
    Liveness,
    ProviderHealth,
    RunChunk,
    RunEvent,
    RunFailed,
    ServerLoad,
    StreamPump,
    Ticker,
    chunk_to_pieces,
    drain_to_proto,
    event_to_proto,
    grpc_options,
    health_to_proto,
    liveness_from_proto,
    payload_from_proto,
    request_from_proto,
    server_load_to_proto,
    statuses,
)
from iop.wire import runtime_pb2 as pb
from iop.wire.runtime_pb2_grpc import NodeRuntimeStub

from .arbitrating import PayloadArbiter

logger = logging.getLogger(__name__)

#: Items the writer may hold before runs wait for it to catch up (a slow or stalled link).
WRITER_BACKLOG: Final = 4096
#: Bytes of the Edge's message bound a batch leaves free for what its items' declared sizes
#: leave out (framing, ids, small fields beyond `ITEM_OVERHEAD`).
_MESSAGE_MARGIN: Final = 64 * 1024

#: What a first dial's keepalive assumes of the Edge's links, which no welcome told yet:
#: edge.node_link's defaults, quiet links included. A one-way quiet link reads nothing from the
#: Edge, so the Node's pings go every keepalive interval there: at the wire's 5 s they would be
#: twice as many as the Node's own beats on an idle fleet's first links, which are most links.
FIRST_DIAL_LIVENESS: Final = Liveness(0.5, 2.0, idle_interval=10.0, idle_timeout=40.0)

#: Called after every session that ended and every dial that failed, except when leaving:
#: (the connection, whether that session had been welcomed).
LinkDown = Callable[["EdgeConnection", bool], None]


@dataclass(frozen=True, slots=True)
class _Accepted:
    run_id: str


_Outgoing = (
    pb.RunEvent | pb.ProviderHealth | pb.ConfigAck | pb.Heartbeat | pb.DrainProgress | _Accepted
)


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    node_id: str
    token: str = field(repr=False)
    alias: str | None = None
    instance_id: str = ""
    #: When this process started (unix seconds): the newest instance of a node id wins an Edge.
    started_at: float = 0.0


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
    """The Edge ended the stream, never welcomed us, or fell silent."""


def _message(batch: Sequence[_Outgoing]) -> pb.NodeMessage:
    message = pb.NodeMessage()
    for item in batch:
        if isinstance(item, pb.RunEvent):
            message.events.append(item)
        elif isinstance(item, _Accepted):
            message.accepted_runs.append(item.run_id)
        elif isinstance(item, pb.ProviderHealth):
            message.health.append(item)
        elif isinstance(item, pb.ConfigAck):
            message.acks.append(item)
        elif isinstance(item, pb.DrainProgress):
            message.drain.CopyFrom(item)  # several in one batch: the latest is what counts
        else:
            message.heartbeat.CopyFrom(item)
    return message


#: What a heartbeat says that the Edge acts on: in-flight counts, and each server's load but for
#: its age (which grows at every tick, and would make every beat differ from the last).
_Said = tuple[dict[str, int], dict[str, tuple[object, ...]]]


def _says(in_flight: dict[str, int], loads: dict[str, ServerLoad]) -> _Said:
    return in_flight, {
        pid: (
            load.running,
            load.waiting,
            load.kv_cache_usage,
            load.not_ours,
            load.running_adapters,
            load.waiting_adapters,
            load.max_loras,
        )
        for pid, load in loads.items()
    }


def _put_sized(
    writer: CoalescingWriter[_Outgoing],
    item: pb.ConfigAck | pb.Heartbeat | pb.DrainProgress | pb.ProviderHealth,
) -> None:
    """Queue one of the few items whose size nothing tells for free (none is frequent)."""
    writer.put(item, size=item.ByteSize())


class EdgeConnection:
    """Keeps this Node connected to the Edge at `target` until cancelled."""

    def __init__(
        self,
        target: str,
        identity: NodeIdentity,
        runner: Runner,
        *,
        arbiter: PayloadArbiter | None = None,
        backoff: Backoff | None = None,
        tls: ClientTls | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        liveness: Liveness = DEFAULT_LIVENESS,
        on_down: LinkDown | None = None,
    ) -> None:
        self.target = target
        self.identity = identity
        self.runner = runner
        self.arbiter = arbiter if arbiter is not None else PayloadArbiter(runner)
        self.backoff = backoff or Backoff()
        self.tls = tls
        # Read once (not at each dial, inside the event loop); the agent reads them for all.
        if credentials is None and tls is not None:
            credentials = tls.credentials()
        self._credentials = credentials
        #: Used until a welcome brings the Edge's values (and for the handshake itself).
        self.default_liveness = liveness
        #: The liveness of the last welcome: the next dial's keepalive follows it.
        self.link_liveness: Liveness | None = None
        #: The last welcome said this Edge sends no heartbeat on a quiet link (the hello asked):
        #: a quiet link's Edge is judged by the transport and what it sends, with no deadline.
        self.quiet_one_way = False
        self.edge_id: str | None = None
        self.connected = asyncio.Event()
        self.welcomes = 0
        #: Config refreshes received from the Edge on this connection (beyond the welcome's).
        self.refreshes = 0
        self.last_error = ""
        #: Sessions that ended in a refusal, a lost stream or an error (each one is redialed).
        self.failures = 0
        #: Sessions this Node ended because the Edge fell silent past the heartbeat deadline.
        self.silences = 0
        self._writer: CoalescingWriter[_Outgoing] | None = None
        self._runs: dict[str, asyncio.Task[None]] = {}
        #: Runs the Edge cancelled that are still ending here: the Edge no longer counts them,
        #: so they do not make the link busy (its heartbeats may be a quiet link's already).
        self._cancelled: set[str] = set()
        #: provider id -> runs of this Edge's in flight (the heartbeat tells it the others').
        self._mine: dict[str, int] = {}
        self._gates: dict[str, RunGate] = {}
        self._last_heard = 0.0
        #: Chunks larger than this travel in pieces (the Edge's welcome says how large a message
        #: may be); None: an Edge that sets no bound.
        self._piece_bytes: int | None = None
        self._on_down = on_down
        self._leaving = asyncio.Event()

    @property
    def last_heard(self) -> float:
        """When the Edge last sent anything (the loop's clock); 0 before it ever did."""
        return self._last_heard

    @property
    def leaving(self) -> bool:
        return self._leaving.is_set()

    def leave(self) -> None:
        """Leave this Edge for good, losing nothing (docs/reliability.md, "Node drain"). `run()`
        returns once the Edge closed the stream, or at once if no session is up."""
        if self._leaving.is_set():
            return
        self._leaving.set()
        logger.info("leaving edge %s: %d run(s) to finish first", self.target, len(self._runs))
        self._on_health(self.runner.health())

    async def run(self) -> None:
        """Connect, serve, and reconnect after every loss, until cancelled or `leave()`.

        Only cancellation or leaving ends this loop. A refusal or a lost stream is expected and
        logged in a line; anything else is a bug somewhere below (an adapter that fails to build
        from a pushed config, say), logged with its traceback, and the Node reconnects all the
        same: a Node that stays up but disconnected would serve nothing and say nothing.
        """
        while not self._leaving.is_set():
            slowest = permanent = False
            unexpected: Exception | None = None
            welcomes = self.welcomes
            try:
                await self._session()
                self.last_error = "the Edge ended the stream"
            except grpc.aio.AioRpcError as exc:
                refusal = statuses.describe_connection_error(exc.code(), exc.details())
                slowest, permanent = refusal.slowest, refusal.permanent
                self.last_error = refusal.description
            except _StreamEnded as exc:
                self.last_error = str(exc)
            except Exception as exc:
                unexpected = exc
                self.last_error = f"unexpected error: {exc!r}"
            if self._leaving.is_set():
                break
            self.failures += 1
            delay = self.backoff.next_delay(slowest=slowest)
            log = logger.error if permanent or unexpected else logger.warning
            log(
                "edge %s: %s; retrying in %.2fs",
                self.target,
                self.last_error,
                delay,
                exc_info=unexpected,
            )
            self._report_down(welcomed=self.welcomes > welcomes)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._leaving.wait(), delay)
        logger.info("left edge %s", self.target)

    def _report_down(self, *, welcomed: bool) -> None:
        if self._on_down is None:
            return
        try:
            self._on_down(self, welcomed)
        except Exception:
            logger.exception("the link-down callback of edge %s failed", self.target)

    def channel_options(self) -> list[tuple[str, int]]:
        """The options of the next dial's channel: the wire's, with a keepalive that follows
        the liveness the Edge's last welcome gave (the first dial assumes the defaults)."""
        return grpc_options(liveness=self.link_liveness or FIRST_DIAL_LIVENESS)

    def _channel(self) -> grpc.aio.Channel:
        if self.tls is None or self._credentials is None:
            return grpc.aio.insecure_channel(self.target, options=self.channel_options())
        options: list[tuple[str, int | str]] = [
            *self.channel_options(),
            *self.tls.channel_options(),
        ]
        return grpc.aio.secure_channel(self.target, self._credentials, options=options)

    def _hello(self) -> pb.Hello:
        return pb.Hello(
            protocol_version=PROTOCOL_VERSION,
            node_id=self.identity.node_id,
            alias=self.identity.alias or "",
            token=self.identity.token,
            instance_id=self.identity.instance_id,
            started_at=self.identity.started_at,
            health=[health_to_proto(h) for h in self.runner.health()],
            quiet_when_idle=True,
            quiet_one_way=True,
        )

    async def _handshake(
        self, call: grpc.aio.StreamStreamCall[pb.NodeMessage, pb.EdgeMessage]
    ) -> pb.Welcome:
        await call.write(pb.NodeMessage(hello=self._hello()))
        first = await call.read()
        if not isinstance(first, pb.EdgeMessage) or not first.HasField("welcome"):
            raise _StreamEnded("the Edge ended the stream without a welcome")
        return first.welcome

    async def _session(self) -> None:
        async with self._channel() as channel:
            call = NodeRuntimeStub(channel).Connect()
            timeout = self.default_liveness.heartbeat_timeout
            try:
                # Dialing, TLS and the hello/welcome exchange: a frozen Edge would hold them
                # forever. Covered by the Edge's own handshake and not by its heartbeats yet.
                welcome = await asyncio.wait_for(self._handshake(call), max(timeout, 10.0))
            except TimeoutError:
                call.cancel()
                raise _StreamEnded("no welcome from the Edge in time") from None
            liveness = self.default_liveness
            if welcome.HasField("liveness"):
                liveness = liveness_from_proto(welcome.liveness, self.default_liveness)
            self.link_liveness = liveness
            self.quiet_one_way = welcome.quiet_one_way and liveness.quiet
            self._last_heard = asyncio.get_running_loop().time()
            # The Edge's receive limit (0 from an Edge that predates it: no bound to keep). A
            # batch leaves room for what its items' declared sizes leave out; a chunk larger
            # than a piece travels in pieces.
            limit = welcome.max_message_bytes or None
            max_bytes = None if limit is None else max(limit - _MESSAGE_MARGIN, limit // 2)
            self._piece_bytes = None if limit is None else max(limit // 4, 1024)

            async def send(batch: Sequence[_Outgoing]) -> None:
                await call.write(_message(batch))

            async def read(writer: CoalescingWriter[_Outgoing]) -> Exception | None:
                return await self._read(call, writer)

            pump = StreamPump(send, read, side="node", peer=self.target, max_bytes=max_bytes)
            async with pump:
                await self._serve_link(call, pump, welcome, liveness)

    async def _serve_link(
        self,
        call: grpc.aio.StreamStreamCall[pb.NodeMessage, pb.EdgeMessage],
        pump: StreamPump[_Outgoing, Exception | None],
        welcome: pb.Welcome,
        liveness: Liveness,
    ) -> None:
        """The link once welcomed: until the Edge or the stream ends it, the keep-alive finds
        the Edge silent, or this Node leaves (a goodbye); raises how it ended, but a goodbye."""
        writer, reader = pump.writer, pump.reader
        self._writer = writer
        # Health and drain progress reach the Edge through this session's writer: listen only
        # while it lives, so connections that come and go leave no listener behind.
        self.runner.add_health_listener(self._on_health)
        self.runner.add_drain_listener(self._on_drain)
        keeper = guarded_task(
            self._keep_alive(writer, liveness, one_way=self.quiet_one_way),
            name=f"node-keepalive-{self.target}",
            logger=logger,
        )
        leaving = guarded_task(
            self._leaving.wait(), name=f"node-leaving-{self.target}", logger=logger
        )
        try:
            _put_sized(writer, self._apply(welcome.config))
            self._on_health(self.runner.health())
            progress = self.runner.drain_progress()
            if progress.draining:
                self._on_drain(progress)
            self.edge_id = welcome.edge_id
            self.welcomes += 1
            self.backoff.reset()
            self.connected.set()
            logger.info("connected to edge %s at %s", welcome.edge_id, self.target)
            await pump.wait(keeper, leaving)
            if leaving.done() and not (reader.done() or writer.task.done()):
                await self._goodbye(call, writer, reader, keeper)
                return
            if keeper.done() and not keeper.cancelled():
                self.silences += 1
                raise _StreamEnded(f"the Edge sent nothing for {liveness.heartbeat_timeout:g}s")
            if reader.done():
                ended = reader.result()
                if ended is not None:
                    raise ended
            if writer.error is not None:
                raise writer.error
        finally:
            self.runner.remove_health_listener(self._on_health)
            self.runner.remove_drain_listener(self._on_drain)
            self.arbiter.withdraw(self.target)
            self.connected.clear()
            self._writer = None
            await stop_tasks([reader, keeper, leaving, *self._runs.values()])
            call.cancel()  # nothing left to cut after a goodbye: the call is over

    async def _goodbye(
        self,
        call: grpc.aio.StreamStreamCall[pb.NodeMessage, pb.EdgeMessage],
        writer: CoalescingWriter[_Outgoing],
        reader: asyncio.Task[Exception | None],
        keeper: asyncio.Task[None],
    ) -> None:
        """Let this link's runs finish, end our half of the stream after our last message, and
        wait until the Edge closes the stream (it has read everything then). Returns early when
        the link breaks meanwhile (the reader, the writer or the keep-alive ends): nothing more
        can be said then."""
        broken: list[asyncio.Future[Any]] = [reader, writer.task, keeper]
        while self._runs:
            await asyncio.wait([*self._runs.values(), *broken], return_when=asyncio.FIRST_COMPLETED)
            if any(task.done() for task in broken):
                return
        await writer.finish()
        if writer.error is not None:
            return
        await call.done_writing()
        # Heartbeats stop with the writer; the keep-alive still judges a silent Edge.
        await asyncio.wait([reader, keeper], return_when=asyncio.FIRST_COMPLETED)
        if reader.done():
            logger.info("edge %s closed the stream after our last message", self.target)

    async def _read(
        self,
        call: grpc.aio.StreamStreamCall[pb.NodeMessage, pb.EdgeMessage],
        writer: CoalescingWriter[_Outgoing],
    ) -> Exception | None:
        """Serve what the Edge sends until the stream ends; returns how it ended (the owner
        raises it), so an Edge going away is one line in the owner's log, not a task's death."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                message = await call.read()
                self._last_heard = loop.time()
                if not isinstance(message, pb.EdgeMessage):
                    return _StreamEnded("the Edge ended the stream")
                for request in message.runs:
                    self._start(request, writer)
                for cancel in message.cancels:
                    task = self._runs.get(cancel.run_id)
                    if task is not None:
                        self._cancelled.add(cancel.run_id)
                        task.cancel(FIRST_BYTE_TIMEOUT if cancel.first_byte_timeout else None)
                for run_id in message.pause_runs:
                    gate = self._gates.get(run_id)
                    if gate is not None:
                        gate.pause()
                for run_id in message.resume_runs:
                    gate = self._gates.get(run_id)
                    if gate is not None:
                        gate.resume()
                if message.HasField("refresh"):
                    self.refreshes += 1
                    _put_sized(writer, self._apply(message.refresh.config))
        except (grpc.aio.AioRpcError, _StreamEnded) as exc:
            return exc

    async def _keep_alive(
        self, writer: CoalescingWriter[_Outgoing], liveness: Liveness, *, one_way: bool
    ) -> None:
        """Heartbeat every interval; return when the Edge has been silent past the deadline.

        On a quiet link (no run of this Edge in flight, when the Edge offered quiet links) the
        heartbeat goes every idle interval, or at the next tick when what it says changed, and
        the Edge's deadline is the idle one; when its beats go `one_way` (the welcome said so)
        there is none: the Edge sends no heartbeat there, and the transport's keepalive finds
        an Edge process that stopped, while an Edge whose loop is held but whose transport
        answers pings is not left (docs/reliability.md, "Quiet links"). A tick that comes late
        (this Node's own loop stalled) judges nothing: the Edge's messages may be waiting
        unread, and the reader catches up first. A failing heartbeat is logged with its
        traceback and the loop carries on: it must not pass for silence.
        """
        ticker = Ticker(liveness.heartbeat_interval)
        loop = asyncio.get_running_loop()
        early = liveness.heartbeat_interval / 2  # a beat is due a little early, not a tick late
        said: _Said | None = None
        beat_at = loop.time()
        runner = self.runner
        while True:
            on_time = await ticker.tick()
            now = loop.time()
            quiet = len(self._runs) == len(self._cancelled)
            try:
                in_flight, loads = runner.in_flight(), runner.server_loads()
                says = _says(in_flight, loads)
                if says != said or not quiet or now - beat_at >= liveness.interval(quiet) - early:
                    said, beat_at = says, now
                    _put_sized(writer, self._heartbeat(in_flight, loads))
            except Exception:
                logger.exception("a heartbeat to edge %s failed; carrying on", self.target)
            judged = not (quiet and one_way)
            if on_time and judged and now - self._last_heard > liveness.timeout(quiet):
                logger.warning(
                    "edge %s sent nothing for %.1fs: leaving it",
                    self.target,
                    now - self._last_heard,
                )
                return

    def _heartbeat(self, in_flight: dict[str, int], loads: dict[str, ServerLoad]) -> pb.Heartbeat:
        """The heartbeat that says `in_flight` and `loads` (the runner's), sent now."""
        mine = self._mine
        return pb.Heartbeat(
            in_flight=in_flight,
            server_load={pid: server_load_to_proto(load) for pid, load in loads.items()},
            in_flight_elsewhere={
                pid: n - mine.get(pid, 0) for pid, n in in_flight.items() if n > mine.get(pid, 0)
            },
            sent_at=time.time(),
        )

    def _start(self, message: pb.RunRequest, writer: CoalescingWriter[_Outgoing]) -> None:
        run_id = message.run_id
        try:
            request = request_from_proto(message)
        except ValueError as exc:
            writer.put(event_to_proto(run_id, statuses.failure(statuses.BAD_REQUEST, str(exc))))
            return
        if self._leaving.is_set():
            busy = statuses.failure(statuses.PROVIDER_BUSY, "the node is leaving this Edge")
            writer.put(event_to_proto(run_id, busy))
            return
        admitted = self.runner.admit(request)
        if isinstance(admitted, RunFailed):
            writer.put(event_to_proto(run_id, admitted))
            return
        # No message of its own: it rides with the run's first event, or at the latest with
        # the next heartbeat (an interval, well inside the Edge's first-event deadline).
        writer.put(_Accepted(run_id), wake=False)

        piece_bytes = self._piece_bytes

        def emit(event: RunEvent) -> None:
            if type(event) is RunChunk:
                size = len(event.data)
                if piece_bytes is not None and size > piece_bytes:
                    for piece in chunk_to_pieces(run_id, event, piece_bytes):
                        writer.put(piece, size=len(piece.chunk.data))
                    return
                writer.put(event_to_proto(run_id, event), size=size)
            elif type(event) is RunFailed:
                writer.put(event_to_proto(run_id, event), size=4 * len(event.message))
            else:
                writer.put(event_to_proto(run_id, event))

        def room() -> Awaitable[None] | None:
            if writer.backlog < WRITER_BACKLOG:
                return None
            return writer.wait_for_room(WRITER_BACKLOG)

        gate = RunGate() if request.stream else None
        events = self.runner.run_events(request, admitted)
        task = guarded_task(
            self.runner.execute(events, emit, gate, room),
            name=f"run-{run_id}",
            logger=logger,
        )
        self._runs[run_id] = task
        provider_id = request.provider_id
        self._mine[provider_id] = self._mine.get(provider_id, 0) + 1
        if gate is not None:
            self._gates[run_id] = gate

        def done(_: object) -> None:
            # Cancelled before its first step (the link ended just after the run came), the
            # task never ran `execute`, which frees the slot: it is freed here then.
            events.abandon()
            self._runs.pop(run_id, None)
            self._cancelled.discard(run_id)
            self._gates.pop(run_id, None)
            self._mine[provider_id] -= 1

        task.add_done_callback(done)

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
        in_use = self.arbiter.offer(self.target, payload, digest)
        return pb.ConfigAck(
            generation=generation,
            config_hash=digest,
            ok=True,
            pending=not in_use,
            in_use_hash=self.arbiter.in_use,
        )

    def _on_drain(self, progress: DrainProgress) -> None:
        writer = self._writer
        if writer is not None:
            _put_sized(writer, drain_to_proto(progress))

    def _on_health(self, health: list[ProviderHealth]) -> None:
        writer = self._writer
        if writer is None:
            return
        leaving = self._leaving.is_set()
        for item in health:
            if leaving and item.reason != DRAINING:
                item = ProviderHealth(
                    item.provider_id, False, "the node is leaving this Edge", DRAINING
                )
            _put_sized(writer, health_to_proto(item))
