"""Who may open a session on the node hub: the checks a Node's call passes before it is served.

A call waits for its hello behind the hello gate (`caps.py`: overall and per address), the hello
is checked against the node tokens of the config in use (an address that keeps failing is
throttled, `authfailures.py`), a newer instance of the node keeps its place, and an Edge with as
many Nodes as `max_connections` admits no new one. `Admission` owns those checks and their
counters; what it needs of the hub (the tokens in use, the connected sessions) it is given.
docs/reliability.md, "Node sessions" and "Hostile peers", says why each check is so.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from math import ceil

import grpc
import grpc.aio

from iop.aiokits import LogThrottle, open_file_limit
from iop.edgeconfig import EdgeConfig, NodeLinkSection, token_sha256
from iop.wire import PROTOCOL_VERSION, statuses
from iop.wire import runtime_pb2 as pb

from ..authfailures import AuthFailures, source_of
from .caps import (
    AUTH_FAILURES_PER_MINUTE,
    CapRefusal,
    CapRefusals,
    HelloGate,
    HubCaps,
    peer_address,
)
from .nodesessions import NodeSession

#: Hash compared for an unknown node id, so both refusals cost the same.
_NO_HASH = "0" * 64


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


class Admission:
    """Which calls the hub serves: its caps and their refusals, the hello check, and the count
    of calls admitted. `token_hashes()`: node id -> token SHA-256 of the config in use."""

    def __init__(
        self,
        link: NodeLinkSection,
        token_hashes: Callable[[], Mapping[str, str]],
        logger: logging.Logger,
    ) -> None:
        self._token_hashes = token_hashes
        self._logger = logger
        #: What the hub refuses before a Node is authenticated (`hub/caps.py`).
        self.caps = HubCaps.of(link).fitted()
        self._gate = HelloGate(self.caps)
        #: Connections turned away for a cap, by reason (`CAP_SETTINGS`), logged throttled.
        self.cap_refusals = CapRefusals(logger)
        #: Failed node authentications per address, throttled.
        self.auth_failures = AuthFailures(
            "the node hub", logger, per_minute=AUTH_FAILURES_PER_MINUTE
        )
        self._refusals = LogThrottle(logger, interval=60.0)
        #: Calls admitted and not ended yet: one per connected Node (two while one supersedes).
        self._admitted = 0

    @property
    def hellos_refused(self) -> int:
        """Connections refused because too many were waiting for their hello to be checked."""
        return self._gate.refused

    @contextmanager
    def seat(self) -> Iterator[None]:
        """An admitted call, counted (against `max_connections`) until it ends."""
        self._admitted += 1
        try:
            yield
        finally:
            self._admitted -= 1

    def warn_if_capped(self, config: EdgeConfig) -> None:
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
        self._logger.warning(
            "%d nodes dial this Edge but its node hub admits %d at once: %s; the rest are "
            'refused (iop_edge_hub_connections_refused_total{reason="connections"})',
            dialing,
            admitted,
            why,
        )

    async def admit(
        self,
        context: grpc.aio.ServicerContext[pb.NodeMessage, pb.EdgeMessage],
        peer: str,
        sessions: Mapping[str, NodeSession],
    ) -> pb.Hello:
        """The call's hello, authenticated; a refusal aborts the call with its status.
        `sessions`: node id -> the session of each connected node."""
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
            previous = sessions.get(hello.node_id)
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
        full = self._full(hello.node_id, sessions)
        if full is not None:
            self.cap_refusals.refused(full, peer)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this Edge admits {full.cap} nodes at once (edge.node_link.max_connections) "
                "and has as many; retry later",
            )
        return hello

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
        expected = self._token_hashes().get(hello.node_id)
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

    def _full(self, node_id: str, sessions: Mapping[str, NodeSession]) -> CapRefusal | None:
        """Why an authenticated Node finds no room, or None. A Node connected already (a redial,
        a newer instance) is let in: it takes its own place, not a new one."""
        cap = self.caps.max_connections
        if self._admitted < cap or node_id in sessions:
            return None
        return CapRefusal("connections", f"{self._admitted} nodes are connected", cap)
