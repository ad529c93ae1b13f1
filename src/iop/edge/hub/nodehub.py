"""The node hub: the Edge's gRPC server that Nodes dial, and the one call dispatch uses to run.

`NodeHub` is the `Hub` of `hub/protocol.py`: the request path calls `connected_providers`,
`add_listener`, `provider_loads` and `run` (a `RunStream`: `runstreams.py`, or a `LocalRun` for
a node placed on the Edge: `localnodes.py`), the refresher `prepare` (in a worker thread),
`swap_config`, `nodes` and `payload_digests`. It holds the sessions of the connected Nodes
(`nodesessions.py`) and the parts that own the rest: `Admission` (`admission.py`) says which
calls it serves, `KeepAlive` (`keepalive.py`) ticks over the sessions that are due, `Changes`
(`changes.py`) tells its listeners, and a swap's `HubSnapshot` (`snapshots.py`) says which
Nodes get a push.

docs/reliability.md says what it guarantees: "Node sessions" (authentication, placing a run,
the snapshot), "Liveness of the Node links", "One node id, two processes", "Slow stream
clients", and "Hostile peers" for what is refused before a node is authenticated (`caps.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import grpc
import grpc.aio

from iop.aiokits import AsyncService
from iop.edgeconfig import EdgeConfig, NodePayload, UpstreamPolicy, is_loopback_listener
from iop.wire import (
    MAX_ID_CHARS,
    NOT_REPORTED,
    PROTOCOL_VERSION,
    UNSPECIFIED,
    CoalescingWriter,
    ConfigAck,
    Liveness,
    RunRequest,
    ServerTls,
    StreamPump,
    bounded,
    liveness_to_proto,
    payload_to_proto,
    statuses,
)
from iop.wire import runtime_pb2 as pb
from iop.wire.runtime_pb2_grpc import NodeRuntimeServicer, add_NodeRuntimeServicer_to_server

from ..authfailures import AuthFailures
from .admission import Admission
from .caps import NODE_MESSAGE_BYTES, CapRefusals, HubCaps
from .changes import Changes
from .keepalive import KeepAlive, stall_timeout_of
from .localnodes import LocalNodes, LocalRun
from .nodesessions import EdgeItem, NodeSession, edge_message
from .protocol import InstanceDrain, NodeStatus, PreparedSwap, ProviderLink, ProviderLoad
from .runstreams import RunStream
from .snapshots import HubSnapshot, needs_push, refresh_request

logger = logging.getLogger(__name__)

_NO_HOLD: Mapping[str, Collection[str]] = MappingProxyType({})


class _Servicer(NodeRuntimeServicer):
    def __init__(self, hub: NodeHub) -> None:
        self._hub = hub

    # grpc.aio runs a coroutine handler that writes through `context`; the generated stub only
    # knows the iterator style, hence the ignore.
    async def Connect(  # type: ignore[override]
        self,
        request_iterator: Any,
        context: grpc.aio.ServicerContext[pb.NodeMessage, pb.EdgeMessage],
    ) -> None:
        await self._hub._serve(context)


class NodeHub(AsyncService):
    """The Edge's side of the runtime wire: the `Hub` of `hub/protocol.py`, and its lifecycle."""

    def __init__(
        self,
        config: EdgeConfig,
        *,
        listen: str | None = None,
        policy: UpstreamPolicy | None = None,
    ) -> None:
        self._snapshot = HubSnapshot.of(config, generation=1)
        self._listen = listen or config.edge.listen
        link = config.edge.node_link
        idle_ms, idle_timeout_ms = link.quiet_link_ms()
        self.liveness = Liveness(
            link.heartbeat_interval_ms / 1000,
            link.heartbeat_timeout_ms / 1000,
            idle_ms / 1000,
            idle_timeout_ms / 1000,
        )
        self.first_event_timeout = link.first_event_timeout_ms / 1000
        self.stream_buffer_bytes = config.openai.stream_buffer_bytes
        tls = config.edge.tls
        self._tls = (
            ServerTls(tls.cert_file, tls.key_file, tls.client_ca_file) if tls is not None else None
        )
        # Read now, before anything listens: a missing file stops the Edge at once (TlsError).
        self._credentials = self._tls.credentials() if self._tls is not None else None
        self._server: grpc.aio.Server | None = None
        self._sessions: dict[str, NodeSession] = {}
        #: Sessions of older instances that finish their runs before they end.
        self._superseded: set[NodeSession] = set()
        self._stopping = False
        #: What changed, told to the listeners once per turn of the loop (`changes.py`).
        self._changes = Changes(logger)
        #: The nodes placed on this Edge (`nodes[].placement: edge`): run here, no session.
        self._local = LocalNodes(self._changes.changed, policy=policy)
        #: Who may open a session (`admission.py`): the caps, the hello check, their counters.
        self._admission = Admission(link, lambda: self._snapshot.token_hashes, logger)
        #: The liveness tick (`keepalive.py`): the sessions due a visit, judged alive or dead.
        self._keepalive = KeepAlive(
            self.liveness,
            self.first_event_timeout,
            stall_timeout_of(config),
            self._local,
            logger,
        )
        self.port: int | None = None
        #: Sessions opened since start (a node flapping between two processes shows here).
        self.sessions_opened = 0

    def streams_paused(self) -> int:
        """Streams whose run waits for its client to read: paused on its Node, or on this Edge
        not pulled for a heartbeat interval; each is stopped once it has waited
        `openai.stream_stall_timeout_ms`. (The loop's clock is `time.monotonic`: a scrape may
        ask from another thread.)"""
        now = time.monotonic()
        on_nodes = sum(len(session.paused) for session in self._sessions.values())
        return on_nodes + self._local.paused(now, self.liveness.heartbeat_interval)

    # The counters and bounds of the parts, as the metrics and the tests read them.

    @property
    def caps(self) -> HubCaps:
        """What the hub refuses before a Node is authenticated (`hub/caps.py`)."""
        return self._admission.caps

    @property
    def cap_refusals(self) -> CapRefusals:
        """Connections turned away for a cap, by reason (`CAP_SETTINGS`), logged throttled."""
        return self._admission.cap_refusals

    @property
    def auth_failures(self) -> AuthFailures:
        """Failed node authentications per address, throttled."""
        return self._admission.auth_failures

    @property
    def hellos_refused(self) -> int:
        """Connections refused because too many were waiting for their hello to be checked."""
        return self._admission.hellos_refused

    @property
    def silent_nodes(self) -> int:
        """Sessions the hub ended because their node fell silent past the heartbeat deadline."""
        return self._keepalive.silent_nodes

    @property
    def runs_not_accepted(self) -> int:
        """Runs failed because their node never accepted them in time."""
        return self._keepalive.runs_not_accepted

    @property
    def streams_stalled(self) -> int:
        """Streams stopped because their client read too little for too long (slots freed)."""
        return self._keepalive.streams_stalled

    @property
    def snapshot(self) -> HubSnapshot:
        return self._snapshot

    async def start(self) -> int:
        """Listen on the configured address; returns the bound port."""
        credentials = self._credentials
        caps = self.caps
        server = grpc.aio.server(
            options=[*caps.server_options(self.liveness), ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=caps.connection_bound,
        )
        add_NodeRuntimeServicer_to_server(_Servicer(self), server)
        try:
            if credentials is not None:
                port = server.add_secure_port(self._listen, credentials)
            else:
                port = server.add_insecure_port(self._listen)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {self._listen} for nodes: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot listen on {self._listen} for nodes")
        await server.start()
        self._server = server
        self.port = port
        self._apply_local(self._snapshot)
        self._keepalive.start()
        security = "plaintext"
        if self._tls is not None:
            security = "mutual TLS" if self._tls.client_ca_file else "TLS"
        logger.info("node hub listening on %s (port %d, %s)", self._listen, port, security)
        if self._tls is None and not is_loopback_listener(self._listen):
            logger.warning(
                "nodes dial %s in plaintext: their tokens and every prompt cross the network "
                "in clear; set edge.tls off a trusted network",
                self._listen,
            )
        self._admission.warn_if_capped(self._snapshot.config)
        return port

    async def stop(self, grace: float = 5.0) -> None:
        """Take no new runs, let in-flight runs finish for up to `grace` seconds, then close."""
        if self._server is None:
            return
        self._stopping = True
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        while (
            any(s.runs for s in self._every_session()) or self._local.runs
        ) and loop.time() < until:
            await asyncio.sleep(0.02)
        for session in list(self._every_session()):
            session.close(statuses.REFUSED_STOPPING, "the Edge is stopping")
        await self._keepalive.stop()
        await self._server.stop(grace=0.5)
        self._server = None
        await self._local.aclose()

    # -- what dispatch uses ----------------------------------------------------------------------

    def connected_providers(self) -> Mapping[str, ProviderLink]:
        """provider id -> link, for the providers of every connected (and configured) node."""
        links = self._changes.links
        if links is None:
            found: dict[str, ProviderLink] = {}
            payloads = self._snapshot.payloads
            for node_id, session in self._sessions.items():
                payload = payloads.get(node_id)
                if not session.ready or payload is None:
                    continue
                for provider in payload.providers:
                    health = session.health.get(provider.id)
                    if health is None:
                        link = ProviderLink(
                            provider.id, node_id, False, "no health reported", NOT_REPORTED
                        )
                    else:
                        reason = health.reason or ("" if health.healthy else UNSPECIFIED)
                        link = ProviderLink(
                            provider.id, node_id, health.healthy, health.detail, reason
                        )
                    found[provider.id] = link
            found.update(self._local.links())
            links = self._changes.links = MappingProxyType(found)
        return links

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever nodes connect or disconnect or a provider's health changes."""
        self._changes.add_listener(callback)

    def provider_loads(self) -> Mapping[str, ProviderLoad]:
        """provider id -> what its Node's last heartbeat said of its load: a live view of the
        sessions in use (an older instance's heartbeats count for nothing)."""
        return _LoadView(self)

    def run(self, request: RunRequest) -> RunStream | LocalRun:
        """The run's stream; the request goes to the node when the stream is entered/iterated
        (or to the runner of a node placed on this Edge)."""
        if not self._stopping and (local := self._local.run(request)) is not None:
            return local
        return RunStream(request, self.stream_buffer_bytes, self._start_run)

    def nodes(self) -> Mapping[str, NodeStatus]:
        superseded: dict[str, list[InstanceDrain]] = {}
        for older in self._superseded:
            superseded.setdefault(older.node_id, []).append(older.instance_drain())
        return self._local.nodes() | {
            node_id: session.status(superseded.get(node_id, ()))
            for node_id, session in self._sessions.items()
        }

    def payload_digests(self) -> Mapping[str, str]:
        """node id -> digest of the payload the config in use gives that node."""
        return self._snapshot.digests

    def prepare(self, config: EdgeConfig, generation: int) -> PreparedSwap:
        """The snapshot `swap_config` would build for `config`, built now: in a worker thread,
        it keeps the event loop free of a walk of every node (at thousands of nodes, long
        enough to hold the heartbeats). A pure function of `config` and the snapshot in use,
        whose payloads it reuses for the nodes whose spec did not change."""
        previous = self._snapshot
        snapshot = HubSnapshot.of(config, generation, previous)
        return PreparedSwap(
            config, generation, previous.config, snapshot.payloads, previous.payloads, snapshot
        )

    async def swap_config(
        self,
        config: EdgeConfig,
        *,
        generation: int | None = None,
        ack_timeout: float = 10.0,
        hold: Mapping[str, Collection[str]] = _NO_HOLD,
        prepared: PreparedSwap | None = None,
    ) -> dict[str, ConfigAck | None]:
        """Make `config` current and push each connected node's payload if it changed.

        A node gets a `NodeConfigRefreshRequest` only when its payload differs from the last one
        it was sent (on welcome or by a push) or from the last one it acknowledged, so a swap
        that changes no payload pushes nothing. Nodes in `hold` get no push: they are about to
        restart and take the new payload on welcome. `hold` maps each to the instance ids of the
        processes its restart replaces (empty: not known); a process not among them, or one that
        runs the new payload already (another Edge welcomed it with it), is past its restart and
        gets the push, or it would wait for a restart that already happened. `generation`
        defaults to the next one; `prepared` (`prepare`'s) is used when it is of this config and
        generation.
        Returns node id -> its ack (None when it did not answer within `ack_timeout` or
        disconnected first). Runs in flight are unaffected; nodes no longer in `config` keep
        their connection until restart.
        """
        number = self._snapshot.generation + 1 if generation is None else generation
        ready = prepared.snapshot if prepared is not None else None
        if isinstance(ready, HubSnapshot) and ready.config is config and ready.generation == number:
            snapshot = ready
        else:
            snapshot = HubSnapshot.of(config, number, self._snapshot)
        self._snapshot = snapshot
        self._keepalive.stall_timeout = stall_timeout_of(config)
        if self._server is not None:
            self._admission.warn_if_capped(config)
        local = self._apply_local(snapshot) if self._server is not None else {}
        waits: dict[str, asyncio.Future[ConfigAck]] = {}
        loop = asyncio.get_running_loop()
        for node_id, session in self._sessions.items():
            payload = snapshot.payloads.get(node_id)
            digest = snapshot.digests.get(node_id, "")
            if payload is None or not needs_push(session, digest, hold):
                continue
            future: asyncio.Future[ConfigAck] = loop.create_future()
            session.acks[snapshot.generation] = future
            session.payload, session.payload_digest = payload, digest
            session.payload_generation = snapshot.generation
            # No writer yet (its welcome is being written): `_serve` sends it right after.
            session.writer_put(refresh_request(session))
            waits[node_id] = future
        self._changes.changed()
        results: dict[str, ConfigAck | None] = {**local, **dict.fromkeys(waits)}
        if waits:
            await asyncio.wait(waits.values(), timeout=ack_timeout)
            for node_id, future in waits.items():
                if future.done() and not future.cancelled():
                    results[node_id] = future.result()
                else:
                    future.cancel()
        return results

    # -- internals -------------------------------------------------------------------------------

    def _every_session(self) -> Iterator[NodeSession]:
        yield from self._sessions.values()
        yield from self._superseded

    def _apply_local(self, snapshot: HubSnapshot) -> dict[str, ConfigAck]:
        """Give the nodes placed on this Edge their payloads (their acks, at once)."""
        placed = {node.id for node in snapshot.config.nodes if node.on_edge}
        if not placed and not self._local.node_ids:
            return {}
        payloads = {n: p for n, p in snapshot.payloads.items() if n in placed}
        return self._local.apply(payloads, snapshot.digests, snapshot.generation)

    def set_edge_replicas(self, replicas: int) -> None:
        """How many Edge replicas share the nodes placed on the Edge (their capacity)."""
        if self._local.set_replicas(replicas):
            self._changes.changed()

    def _start_run(self, stream: RunStream) -> None:
        request = stream.request
        if self._stopping:
            stream.fail(statuses.EDGE_STOPPING, "the Edge is stopping")
            return
        node_id = self._snapshot.provider_nodes.get(request.provider_id)
        session = self._sessions.get(node_id) if node_id is not None else None
        if session is None or not session.ready:
            where = f"node {node_id}" if node_id else "no node"
            stream.fail(
                statuses.NODE_UNAVAILABLE,
                f"provider {request.provider_id} is on {where}, which is not connected",
            )
            return
        session.send_run(stream)
        self._keepalive.visits.busy(session)

    async def _serve(
        self, context: grpc.aio.ServicerContext[pb.NodeMessage, pb.EdgeMessage]
    ) -> None:
        """One Node's stream: admitted (or refused), then served until either side ends it."""
        peer = context.peer()
        if self._stopping:
            await context.abort(statuses.REFUSED_STOPPING, "the Edge is stopping")
        hello = await self._admission.admit(context, peer, self._sessions)
        payload = self._snapshot.payloads[hello.node_id]
        code: grpc.StatusCode | None = None
        reason = "the node went away"
        with self._admission.seat():
            session = self._open(hello, peer, payload)
            try:
                code, reason = await self._pump(context, session, payload)
            finally:
                self._close(session, reason)
        if code is not None:
            context.set_code(code)
            context.set_details(reason)

    def _open(self, hello: pb.Hello, peer: str, payload: NodePayload) -> NodeSession:
        """The session of an admitted Node, in place of the one it replaces or supersedes."""
        snapshot = self._snapshot
        node_id = hello.node_id
        session = NodeSession(
            node_id=node_id,
            alias=bounded(hello.alias, MAX_ID_CHARS),
            instance_id=bounded(hello.instance_id, MAX_ID_CHARS),
            started_at=hello.started_at,
            peer=peer,
            payload=payload,
            generation=snapshot.generation,
            on_change=self._changes.changed,
            quiet_when_idle=hello.quiet_when_idle and self.liveness.quiet,
            quiet_one_way=hello.quiet_one_way,
        )
        session.receive_health(hello.health)
        previous = self._sessions.get(node_id)
        if previous is not None:
            if previous.instance_id == hello.instance_id:
                previous.close(statuses.REPLACED, "replaced by a newer connection of this process")
            else:
                logger.info(
                    "node %s: instance %s supersedes %s, which finishes its %d run(s)",
                    node_id,
                    hello.instance_id,
                    previous.instance_id,
                    len(previous.runs),
                )
                self._superseded.add(previous)
                self._keepalive.visits.busy(previous)
                previous.supersede(hello.instance_id)
        self._sessions[node_id] = session
        self._keepalive.visits.later(session, asyncio.get_running_loop().time())
        self.sessions_opened += 1
        if previous is not None and previous.ready:
            self._changes.changed()  # its providers wait for the new session to be ready
        logger.info("node %s connected from %s (instance %s)", node_id, peer, hello.instance_id)
        return session

    async def _pump(
        self,
        context: grpc.aio.ServicerContext[pb.NodeMessage, pb.EdgeMessage],
        session: NodeSession,
        payload: NodePayload,
    ) -> tuple[grpc.StatusCode | None, str]:
        """Welcome the Node, then serve its stream until it ends: the status to end it with
        (None: the Node ended it) and why."""
        snapshot = self._snapshot
        node_id = session.node_id
        welcome = pb.Welcome(
            protocol_version=PROTOCOL_VERSION,
            edge_id=snapshot.config.edge.id,
            config=payload_to_proto(payload, snapshot.generation, snapshot.digests[node_id]),
            liveness=liveness_to_proto(self.liveness),
            max_message_bytes=NODE_MESSAGE_BYTES,
            quiet_one_way=session.quiet_one_way,
        )
        await context.write(pb.EdgeMessage(welcome=welcome))

        loop = asyncio.get_running_loop()

        async def send(batch: Sequence[EdgeItem]) -> None:
            # A run, a push or a cancel tells the Node this Edge is alive as well as a heartbeat
            # does: the next heartbeat is due an interval after it (it rides with the run).
            session.last_sent = loop.time()
            await context.write(edge_message(batch))

        async def read(_: CoalescingWriter[EdgeItem]) -> None:
            await self._read(context, session)

        async with StreamPump(send, read, side="hub", peer=node_id) as pump:
            session.writer = pump.writer
            try:
                if session.payload is not payload:  # a swap pushed while the welcome was written
                    pump.writer.put(refresh_request(session))
                await pump.wait(session.closing)
            finally:
                session.writer = None
            if session.closing.done():
                return session.closing.result()
            if pump.read_to_its_end:
                return None, "the node ended its stream"
            return None, "the node went away"

    def _close(self, session: NodeSession, reason: str) -> None:
        """A session that ended: out of dispatch, its runs failed."""
        node_id = session.node_id
        was_ready = session.ready
        session.ready = False
        if self._sessions.get(node_id) is session:
            del self._sessions[node_id]
        else:
            was_ready = False  # superseded or replaced: dispatch moved on already
        self._superseded.discard(session)
        self._keepalive.visits.forget(session)
        code_name = statuses.EDGE_STOPPING if self._stopping else statuses.NODE_DISCONNECTED
        session.fail_runs(code_name, f"node {node_id} disconnected: {reason}")
        logger.info("node %s disconnected: %s", node_id, reason)
        if was_ready:
            self._changes.changed()

    async def _read(
        self,
        context: grpc.aio.ServicerContext[pb.NodeMessage, pb.EdgeMessage],
        session: NodeSession,
    ) -> None:
        was_ready = False
        while True:
            message: object = await context.read()
            if not isinstance(message, pb.NodeMessage):
                return
            session.receive(message)
            if session.ready and not was_ready:
                was_ready = True
                logger.info(
                    "node %s ready (config generation %d)",
                    session.node_id,
                    session.applied_generation,
                )
                self._changes.changed()


class _LoadView(Mapping[str, ProviderLoad]):
    """`NodeHub.provider_loads()`: read through to the session of each provider's node."""

    __slots__ = ("_hub",)

    def __init__(self, hub: NodeHub) -> None:
        self._hub = hub

    def __getitem__(self, provider_id: str) -> ProviderLoad:
        hub = self._hub
        local = hub._local.loads.get(provider_id)
        if local is not None:
            return local
        node_id = hub._snapshot.provider_nodes.get(provider_id)
        session = hub._sessions.get(node_id) if node_id is not None else None
        if session is None:
            raise KeyError(provider_id)
        return session.loads[provider_id]

    def __iter__(self) -> Iterator[str]:
        yield from list(self._hub._local.loads)
        for session in list(self._hub._sessions.values()):
            yield from session.loads

    def __len__(self) -> int:
        sessions = self._hub._sessions.values()
        return len(self._hub._local.loads) + sum(len(session.loads) for session in sessions)
