"""The node hub: the Edge's gRPC server that Nodes dial, and the one call dispatch uses to run.

`NodeHub` is the `Hub` of `hub/protocol.py`: the request path calls `connected_providers`,
`add_listener`, `provider_loads` and `run` (a `RunStream`, or a `LocalRun` for a node placed on
the Edge: `localnodes.py`), the refresher `prepare` (in a worker thread), `swap_config`, `nodes`
and `payload_digests`. Its tick sends heartbeats, ends silent sessions, fails runs never
accepted and stops stalled streams, visiting the busy sessions and the quiet ones that are due
(`visits.py`).

docs/reliability.md says what it guarantees: "Node sessions" (authentication, placing a run,
the snapshot), "Liveness of the Node links", "One node id, two processes", "Slow stream
clients", and "Hostile peers" for what is refused before a node is authenticated (`caps.py`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import ceil
from types import MappingProxyType
from typing import Any

import grpc
import grpc.aio

from iop.aiokits import AsyncService, LogThrottle, guarded_task, open_file_limit, stop_tasks
from iop.edgeconfig import (
    EdgeConfig,
    NodePayload,
    UpstreamPolicy,
    is_loopback_listener,
    token_sha256,
)
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
    Ticker,
    bounded,
    liveness_to_proto,
    payload_to_proto,
    statuses,
)
from iop.wire import runtime_pb2 as pb
from iop.wire.runtime_pb2_grpc import NodeRuntimeServicer, add_NodeRuntimeServicer_to_server

from ..authfailures import AuthFailures, source_of
from .caps import (
    AUTH_FAILURES_PER_MINUTE,
    NODE_MESSAGE_BYTES,
    CapRefusal,
    CapRefusals,
    HelloGate,
    HubCaps,
    peer_address,
)
from .localnodes import LocalNodes, LocalRun
from .nodesessions import EdgeItem, NodeSession, RunStream, edge_message
from .protocol import InstanceDrain, NodeStatus, PreparedSwap, ProviderLink, ProviderLoad
from .visits import Visits

logger = logging.getLogger(__name__)

#: Hash compared for an unknown node id, so both refusals cost the same.
_NO_HASH = "0" * 64
_NO_HOLD: Mapping[str, Collection[str]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class HubSnapshot:
    """Everything the hub reads from the config, swapped as one reference."""

    config: EdgeConfig
    generation: int
    payloads: Mapping[str, NodePayload]
    #: node id -> `payloads[node].digest`, computed once per payload (hashing is not free).
    digests: Mapping[str, str]
    provider_nodes: Mapping[str, str]
    token_hashes: Mapping[str, str]

    @classmethod
    def of(
        cls, config: EdgeConfig, generation: int, previous: HubSnapshot | None = None
    ) -> HubSnapshot:
        """The snapshot of `config`; a node whose spec is the same as in `previous` keeps its
        payload and digest (a live change to one node of thousands builds one payload)."""
        specs = {n.id: n for n in previous.config.nodes} if previous is not None else {}
        payloads: dict[str, NodePayload] = {}
        digests: dict[str, str] = {}
        for node in config.nodes:
            node_id = node.id
            if previous is not None and specs.get(node_id) == node:
                payloads[node_id] = previous.payloads[node_id]
                digests[node_id] = previous.digests[node_id]
                continue
            payload = NodePayload.of(node)
            before = previous.payloads.get(node_id) if previous is not None else None
            if previous is not None and before is not None and before == payload:
                payloads[node_id], digests[node_id] = before, previous.digests[node_id]
            else:
                payloads[node_id], digests[node_id] = payload, payload.digest
        return cls(
            config=config,
            generation=generation,
            payloads=MappingProxyType(payloads),
            digests=MappingProxyType(digests),
            provider_nodes=MappingProxyType(
                {p.id: node.id for node in config.nodes for p in node.providers}
            ),
            token_hashes=MappingProxyType(
                {n.id: n.token_hash_sha256 for n in config.nodes if n.token_hash_sha256}
            ),
        )


class _Refused(Exception):
    """A connection the hub turns away: the status and details the node gets, and (for the log
    only) what exactly was wrong. `failure`: the reason it counts as a failed authentication
    of its address (a metric label), or "" when it does not count."""

    def __init__(
        self, code: grpc.StatusCode, details: str, why: str = "", *, failure: str = ""
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.why = why or details
        self.failure = failure


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
        #: Which sessions the liveness tick visits (`visits.py`): busy ones, quiet ones when due.
        self._visits: Visits[NodeSession] = Visits()
        self._listeners: list[Callable[[], None]] = []
        self._links: Mapping[str, ProviderLink] | None = None
        #: The listeners are to be told of a change on the loop's next turn (`_changed`).
        self._telling = False
        self._stopping = False
        #: The nodes placed on this Edge (`nodes[].placement: edge`): run here, no session.
        self._local = LocalNodes(self._changed, policy=policy)
        self._liveness_task: asyncio.Task[None] | None = None
        self._refusals = LogThrottle(logger, interval=60.0)
        #: What the hub refuses before a Node is authenticated (`hub/caps.py`).
        self.caps = HubCaps.of(link).fitted()
        self._gate = HelloGate(self.caps)
        #: Connections turned away for a cap, by reason (`CAP_SETTINGS`), logged throttled.
        self.cap_refusals = CapRefusals(logger)
        #: Calls admitted and not ended yet: one per connected Node (two while one supersedes).
        self._admitted = 0
        #: Failed node authentications per address, throttled.
        self.auth_failures = AuthFailures(
            "the node hub", logger, per_minute=AUTH_FAILURES_PER_MINUTE
        )
        self.port: int | None = None
        #: Sessions opened since start (a node flapping between two processes shows here).
        self.sessions_opened = 0
        #: Sessions the hub ended because their node fell silent past the heartbeat deadline.
        self.silent_nodes = 0
        #: Runs failed because their node never accepted them in time.
        self.runs_not_accepted = 0
        #: Streams stopped because their client read too little for too long (their slots freed).
        self.streams_stalled = 0

    def streams_paused(self) -> int:
        """Streams whose run waits for its client to read: paused on its Node, or on this Edge
        not pulled for a heartbeat interval; each is stopped once it has waited
        `openai.stream_stall_timeout_ms`. (The loop's clock is `time.monotonic`: a scrape may
        ask from another thread.)"""
        now = time.monotonic()
        on_nodes = sum(len(session.paused) for session in self._sessions.values())
        return on_nodes + self._local.paused(now, self.liveness.heartbeat_interval)

    @property
    def hellos_refused(self) -> int:
        """Connections refused because too many were waiting for their hello to be checked."""
        return self._gate.refused

    def _warn_if_capped(self, config: EdgeConfig) -> None:
        """Say so when more nodes dial in than this Edge admits: the config's check holds them
        against `max_connections`, but only the running Edge knows its open-file limit."""
        dialing = sum(1 for node in config.nodes if not node.on_edge)
        admitted = self.caps.max_connections
        if dialing <= admitted:
            return
        configured = config.edge.node_link.max_connections
        if admitted < configured:
            why = (
                f"edge.node_link.max_connections ({configured}) lowered to fit the process's "
                f"open-file limit ({open_file_limit()}, ulimit -n)"
            )
        else:
            why = (
                f"edge.node_link.max_connections is {admitted} since this Edge started "
                f"(now {configured}, applied at restart)"
            )
        logger.warning(
            "%d nodes dial this Edge but its node hub admits %d at once: %s; the rest are "
            'refused (iop_edge_hub_connections_refused_total{reason="connections"})',
            dialing,
            admitted,
            why,
        )

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
        self._liveness_task = guarded_task(self._keep_alive(), name="hub-liveness", logger=logger)
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
        self._warn_if_capped(self._snapshot.config)
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
        if self._liveness_task is not None:
            await stop_tasks([self._liveness_task])
            self._liveness_task = None
        await self._server.stop(grace=0.5)
        self._server = None
        await self._local.aclose()

    # -- what dispatch uses ----------------------------------------------------------------------

    def connected_providers(self) -> Mapping[str, ProviderLink]:
        """provider id -> link, for the providers of every connected (and configured) node."""
        links = self._links
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
            links = self._links = MappingProxyType(found)
        return links

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever nodes connect or disconnect or a provider's health changes."""
        self._listeners.append(callback)

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
            node_id: NodeStatus(
                node_id,
                s.alias,
                s.instance_id,
                s.peer,
                s.ready,
                s.applied_generation,
                s.applied_hash,
                len(s.runs),
                s.connected_at,
                s.drain,
                tuple(sorted(superseded.get(node_id, ()), key=lambda d: d.instance_id)),
            )
            for node_id, s in self._sessions.items()
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
        if self._server is not None:
            self._warn_if_capped(config)
        local = self._apply_local(snapshot) if self._server is not None else {}
        waits: dict[str, asyncio.Future[ConfigAck]] = {}
        loop = asyncio.get_running_loop()
        for node_id, session in self._sessions.items():
            payload = snapshot.payloads.get(node_id)
            digest = snapshot.digests.get(node_id, "")
            if payload is None or _held(session, digest, hold) or _holds(session, digest):
                continue
            future: asyncio.Future[ConfigAck] = loop.create_future()
            session.acks[snapshot.generation] = future
            session.payload, session.payload_digest = payload, digest
            session.payload_generation = snapshot.generation
            # No writer yet (its welcome is being written): `_serve` sends it right after.
            session.writer_put(_refresh(session))
            waits[node_id] = future
        self._changed()
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

    async def _keep_alive(self) -> None:
        """Heartbeats to every node; ends silent sessions; fails runs never accepted in time.

        A tick that comes late (this Edge's own loop stalled) judges nobody: what the nodes sent
        meanwhile may still wait unread, and the readers catch up before the next tick. Only
        cancellation ends the loop: a failing tick is logged with its traceback and the next
        one runs, since an Edge without this loop would never notice a frozen node again.
        """
        ticker = Ticker(self.liveness.heartbeat_interval)
        while True:
            on_time = await ticker.tick()
            try:
                self._tick(on_time)
            except Exception:
                logger.exception("the hub's liveness tick failed; carrying on")

    def _tick(self, on_time: bool) -> None:
        liveness = self.liveness
        beat = pb.Heartbeat(sent_at=time.time())
        now = asyncio.get_running_loop().time()
        stall_timeout = self._snapshot.config.openai.stream_stall_timeout_ms / 1000
        self.streams_stalled += self._local.tick(now, stall_timeout)
        # A beat is due a little early rather than a whole tick late.
        early = liveness.heartbeat_interval / 2
        visits = self._visits
        for session in visits.due(now):
            quiet = session.quiet_when_idle
            idle = quiet and not session.runs
            # A quiet link whose beats go one way gets none from this side: its Node needs none.
            beats = not (idle and session.quiet_one_way)
            if beats and now - session.last_sent >= liveness.interval(idle) - early:
                session.writer_put(beat)
                session.last_sent = now
            if session.paused:
                self.streams_stalled += session.expire_stalled(now, stall_timeout)
            if on_time:
                self._judge(session, now, quiet)
            if session.runs or not quiet:
                visits.busy(session)
            else:  # a quiet link: next visited for its next beat (if it beats) or its deadline
                when = session.last_heard + liveness.idle_timeout
                if not session.quiet_one_way:
                    when = min(when, session.last_sent + liveness.idle_interval - early)
                visits.later(session, max(when, now + early))

    def _judge(self, session: NodeSession, now: float, quiet: bool) -> None:
        """End `session` if its Node fell silent past its deadline; fail its runs not accepted
        in time."""
        liveness = self.liveness
        # The Node keeps the link quiet until it has a run: until it accepted one (its message
        # saying so is heard), a run sent is its first-event deadline's to judge.
        silent = now - session.last_heard
        if silent > liveness.timeout(quiet and len(session.runs) == len(session.unaccepted)):
            if not session.closing.done():
                self.silent_nodes += 1
                logger.warning(
                    "node %s (instance %s) sent nothing for %.1fs: ending its session",
                    session.node_id,
                    session.instance_id,
                    silent,
                )
            session.close(statuses.SILENT, f"no message from the node for {silent:.1f}s")
        elif session.unaccepted:
            self.runs_not_accepted += session.expire_unaccepted(now, self.first_event_timeout)

    def _changed(self) -> None:
        """A node connected or left, or a provider's health changed: the listeners are told once
        per turn of the event loop however many changed in it, since each of them reads every
        provider (a thousand Nodes reconnecting at once would otherwise cost a million reads)."""
        self._links = None
        if self._telling:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (a hub built and changed outside a loop: tell at once)
            self._tell()
            return
        self._telling = True
        loop.call_soon(self._tell)

    def _tell(self) -> None:
        self._telling = False
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:
                logger.exception("node hub listener %r failed", callback)

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
            self._changed()

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
        self._visits.busy(session)

    async def _first_message(
        self, context: grpc.aio.ServicerContext[pb.NodeMessage, pb.EdgeMessage]
    ) -> object:
        """The call's first message (its hello, unchecked), read within the hello timeout."""
        timeout = self.caps.hello_timeout
        try:
            return await asyncio.wait_for(context.read(), timeout)
        except TimeoutError:
            raise _Refused(
                statuses.REFUSED_NO_HELLO,
                f"no hello within {timeout:g}s",
                failure="hello_timeout",
            ) from None

    def _authenticate(self, first: object) -> pb.Hello:
        if not isinstance(first, pb.NodeMessage) or not first.HasField("hello"):
            raise _Refused(
                statuses.REFUSED_NO_HELLO,
                "the first message must carry a hello",
                failure="no_hello",
            )
        hello = first.hello
        if hello.protocol_version != PROTOCOL_VERSION:
            raise _Refused(
                statuses.REFUSED_VERSION,
                f"this Edge speaks runtime protocol {PROTOCOL_VERSION}, the node "
                f"{hello.protocol_version}",
            )
        expected = self._snapshot.token_hashes.get(hello.node_id)
        given = token_sha256(hello.token)
        matches = hmac.compare_digest(given, expected or _NO_HASH)
        if expected is None or not matches:
            # One answer for both, so a caller cannot probe which node ids exist; the log (an
            # operator's surface) says which it was.
            why = "unknown node id" if expected is None else "wrong token"
            raise _Refused(
                statuses.REFUSED_CREDENTIALS,
                statuses.REFUSED_CREDENTIALS_DETAILS,
                f"{why} (node id {hello.node_id[:64]!r}, token sha256 {given[:8]}...)",
                failure="unknown_node" if expected is None else "wrong_token",
            )
        return hello

    async def _serve(
        self, context: grpc.aio.ServicerContext[pb.NodeMessage, pb.EdgeMessage]
    ) -> None:
        """One Node's stream: admitted (or refused), then served until either side ends it."""
        peer = context.peer()
        hello = await self._admit(context, peer)
        payload = self._snapshot.payloads[hello.node_id]
        self._admitted += 1
        code: grpc.StatusCode | None = None
        reason = "the node went away"
        try:
            session = self._open(hello, peer, payload)
            try:
                code, reason = await self._pump(context, session, payload)
            finally:
                self._close(session, reason)
        finally:
            self._admitted -= 1
        if code is not None:
            context.set_code(code)
            context.set_details(reason)

    async def _admit(
        self, context: grpc.aio.ServicerContext[pb.NodeMessage, pb.EdgeMessage], peer: str
    ) -> pb.Hello:
        """The call's hello, authenticated; a refusal aborts the call with its status."""
        if self._stopping:
            await context.abort(statuses.REFUSED_STOPPING, "the Edge is stopping")
        source = source_of(peer_address(peer))
        crowded = self._gate.enter(source)
        if crowded is not None:
            self.cap_refusals.refused(crowded, peer)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too many connections are waiting for their hello; retry shortly",
            )
        try:
            try:
                # Every refusal waits for the call's first message: ending a call while the
                # client's write of its hello is in flight makes a grpc.aio client report its
                # own INTERNAL instead of the refusal (its failed write overrides the status).
                first = await self._first_message(context)
            finally:
                self._gate.leave(source)
            wait = self.auth_failures.retry_after(source)
            if wait is not None:  # throttled: refused without looking at the token
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many failed authentications from this address; retry in {ceil(wait)}s",
                )
            hello = self._authenticate(first)
            previous = self._sessions.get(hello.node_id)
            if (
                previous is not None
                and previous.instance_id != hello.instance_id
                and previous.rank > (hello.started_at, hello.instance_id)
            ):
                raise _Refused(
                    statuses.SUPERSEDED,
                    f"a newer instance ({previous.instance_id}) of node {hello.node_id} is "
                    "connected",
                )
        except _Refused as refused:
            if refused.failure:
                self.auth_failures.failed(source, refused.failure, refused.why)
            else:
                self._refusals.warning("refused a node from %s: %s", peer, refused.why)
            await context.abort(refused.code, refused.details)
        full = self._full(hello.node_id)
        if full is not None:
            self.cap_refusals.refused(full, peer)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this Edge admits {full.cap} nodes at once (edge.node_link.max_connections) "
                "and has as many; retry later",
            )
        return hello

    def _full(self, node_id: str) -> CapRefusal | None:
        """Why an authenticated Node finds no room, or None. A Node connected already (a redial,
        a newer instance) is let in: it takes its own place, not a new one."""
        cap = self.caps.max_connections
        if self._admitted < cap or node_id in self._sessions:
            return None
        return CapRefusal("connections", f"{self._admitted} nodes are connected", cap)

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
            on_change=self._changed,
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
                self._visits.busy(previous)
                previous.supersede(hello.instance_id)
        self._sessions[node_id] = session
        self._visits.later(session, asyncio.get_running_loop().time())
        self.sessions_opened += 1
        if previous is not None and previous.ready:
            self._changed()  # its providers wait for the new session to be ready
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
                    pump.writer.put(_refresh(session))
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
        self._visits.forget(session)
        code_name = statuses.EDGE_STOPPING if self._stopping else statuses.NODE_DISCONNECTED
        session.fail_runs(code_name, f"node {node_id} disconnected: {reason}")
        logger.info("node %s disconnected: %s", node_id, reason)
        if was_ready:
            self._changed()

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
                self._changed()


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


def _refresh(session: NodeSession) -> pb.NodeConfigRefreshRequest:
    """The refresh carrying the payload last given to `session`."""
    config = payload_to_proto(session.payload, session.payload_generation, session.payload_digest)
    return pb.NodeConfigRefreshRequest(config=config)


def _held(session: NodeSession, digest: str, hold: Mapping[str, Collection[str]]) -> bool:
    """`session`'s process is one the restart in `hold` replaces (see `swap_config`)."""
    replaced = hold.get(session.node_id)
    if replaced is None or session.in_use_hash == digest:
        return False
    return not replaced or session.instance_id in replaced


def _holds(session: NodeSession, digest: str) -> bool:
    """The node was sent the payload of `digest` last and (once welcomed) acknowledged it."""
    if session.payload_digest != digest:
        return False
    return not session.ready or session.applied_hash == digest
