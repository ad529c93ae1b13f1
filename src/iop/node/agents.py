"""The Node agent: one runner shared by connections to every Edge replica.

Every Edge replica must be able to dispatch to every Node, so the agent keeps one
`EdgeConnection` per Edge address: the addresses given (`edges`), plus every address a service
name resolves to (`services`, a headless Service), looked up again as `resolving.py` says. An
address no longer listed is left without losing anything (`EdgeConnection.leave`). All
connections share one `Runner` (capacity holds across all Edges) and one `PayloadArbiter`
(replicas that disagree never flip the Node). `drain(grace)` is how a Node leaves (SIGTERM).
docs/reliability.md ("Following the Edge replicas", "Node drain") says how and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence

from iop.aiokits import (
    AsyncService,
    LogThrottle,
    Resolve,
    guarded_task,
    resolve_service,
    split_listener,
    stop_tasks,
)
from iop.edgeconfig import UpstreamPolicy
from iop.providers import Runner
from iop.wire import DEFAULT_LIVENESS, ClientTls, Liveness

from .arbitrating import PayloadArbiter
from .connecting import Backoff, EdgeConnection, NodeIdentity
from .resolving import ResolvePacing

logger = logging.getLogger(__name__)

#: Seconds a drained Node gives its links to say goodbye when the grace is (nearly) over.
LEAVE_TIMEOUT_S = 1.0
#: Most characters of the readiness reason that names the providers which cannot run here.
MAX_REASON_CHARS = 1000


def _config_problems_reason(problems: Sequence[tuple[str, str]]) -> str:
    """`provider ID: PROBLEM; ...` for `(provider id, problem)` pairs, at most
    `MAX_REASON_CHARS` long: the providers that do not fit are counted (`; and 3 more`)."""
    entries = [f"provider {pid}: {problem}" for pid, problem in problems]
    reason = "; ".join(entries)
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    room = MAX_REASON_CHARS - len(f"; and {len(entries)} more")
    shown: list[str] = []
    length = 0
    for entry in entries:
        length += len(entry) + (2 if shown else 0)
        if length > room:
            break
        shown.append(entry)
    if not shown:  # the first alone is too long: cut it
        shown = [entries[0][: room - 1] + "…"]
    left = len(entries) - len(shown)
    return "; ".join(shown) + (f"; and {left} more" if left else "")


class NodeAgent(AsyncService):
    """`async with NodeAgent(edges=[...], node_id=..., token=...) as agent:` runs the Node."""

    def __init__(
        self,
        *,
        node_id: str,
        token: str,
        edges: Sequence[str] = (),
        services: Sequence[str] = (),
        alias: str | None = None,
        drain_timeout: float = 60.0,
        backoff_initial: float = 0.1,
        backoff_max: float = 10.0,
        liveness: Liveness = DEFAULT_LIVENESS,
        resolve_interval: float = 30.0,
        resolve: Resolve = resolve_service,
        tls: ClientTls | None = None,
        policy: UpstreamPolicy | None = None,
    ) -> None:
        if not edges and not services:
            raise ValueError("a node needs at least one Edge address or service name")
        for address in (*edges, *services):
            split_listener(address)
        self.identity = NodeIdentity(
            node_id, token, alias, instance_id=uuid.uuid4().hex[:12], started_at=time.time()
        )
        self.runner = Runner(drain_timeout=drain_timeout, policy=policy)
        self.arbiter = PayloadArbiter(self.runner)
        self._edges = tuple(edges)
        self._services = tuple(services)
        self._backoff = (backoff_initial, backoff_max)
        self._liveness = liveness
        self._tls = tls
        # Read here, once for every connection: a missing or empty file fails at once.
        self._credentials = tls.credentials() if tls is not None else None
        self._resolve = resolve
        self._pacing = ResolvePacing(resolve_interval)
        self._resolve_now = asyncio.Event()
        self._unresolved = LogThrottle(logger, interval=60.0)
        self.connections: dict[str, EdgeConnection] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Links to addresses the Service no longer lists, finishing their runs before they end.
        self._leaving: dict[str, asyncio.Task[None]] = {}
        self._resolver: asyncio.Task[None] | None = None

    @property
    def resolve_interval(self) -> float:
        """Seconds between two lookups of the Edge services while every Edge listed welcomed
        this Node (`ResolvePacing.interval`)."""
        return self._pacing.interval

    async def start(self) -> None:
        for address in self._edges:
            self._connect(address)
        if self._services:
            self._pacing.started(asyncio.get_running_loop().time())
            await self._resolve_once()
            self._resolver = guarded_task(
                self._resolve_forever(), name="node-resolver", logger=logger
            )

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): ready once an Edge has welcomed this Node, not while it drains, and
        not while a provider of the config in use cannot run on this Node (adapter settings it
        cannot build, an API key variable unset or malformed in its environment: the reason
        names each, `Runner.config_problems`). A provider whose model server is down or fails
        its probes leaves the Node ready: that is the server's health, which the Node reports
        to the Edges, not a fault of its config; a restart would not mend it."""
        if self.runner.draining:
            return False, "draining: the node is leaving"
        welcomed = sum(1 for c in self.connections.values() if c.connected.is_set())
        if not welcomed:
            return False, "no Edge has welcomed this node yet"
        if problems := self.runner.config_problems():
            return False, _config_problems_reason(problems)
        return True, f"welcomed by {welcomed} of {len(self.connections)} Edge(s)"

    async def drain(self, grace: float) -> bool:
        """Stop taking runs, tell every Edge, and wait up to `grace` seconds for the runs in
        flight to end; True when they all did. Call `stop()` after it."""
        self.runner.drain()
        running = self.runner.running
        logger.info("draining: %d run(s) in flight, up to %.0fs", running, grace)
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        try:
            await asyncio.wait_for(self.runner.wait_idle(), grace)
        except TimeoutError:
            logger.warning(
                "drain grace of %.0fs over: %d run(s) still in flight are cut",
                grace,
                self.runner.running,
            )
            return False
        # The runs' last events and the drain's end are queued for every Edge. Each link says
        # goodbye: an Edge closes the stream only once it has read them. Cut by `stop()`
        # instead, the stream would lose what a busy Edge had received but not yet read.
        if self._resolver is not None:
            await stop_tasks([self._resolver])  # no new link now
            self._resolver = None
        for connection in self.connections.values():
            connection.leave()
        links = [*self._tasks.values(), *self._leaving.values()]
        if links:
            await asyncio.wait(links, timeout=max(until - loop.time(), LEAVE_TIMEOUT_S))
        return True  # the runner logged the end of the drain

    async def stop(self) -> None:
        """Drop every connection (their runs are cancelled), then close the adapters."""
        tasks = [*self._tasks.values(), *self._leaving.values()]
        if self._resolver is not None:
            tasks.append(self._resolver)
        await stop_tasks(tasks)
        self._tasks.clear()
        self._leaving.clear()
        await self.runner.aclose()

    async def wait_connected(self, count: int | None = None) -> None:
        """Until `count` connections (default: all current) have been welcomed."""
        connections = list(self.connections.values())
        waits = [c.connected.wait() for c in connections]
        if count is None or count >= len(waits):
            await asyncio.gather(*waits)
            return
        while sum(c.connected.is_set() for c in connections) < count:
            await asyncio.sleep(0.01)

    def _connect(self, address: str) -> None:
        if address in self.connections or address in self._leaving:
            return  # a link that is leaving ends first; the next lookup brings it back
        connection = EdgeConnection(
            address,
            self.identity,
            self.runner,
            arbiter=self.arbiter,
            backoff=Backoff(*self._backoff),
            tls=self._tls,
            credentials=self._credentials,
            liveness=self._liveness,
            on_down=self._link_down,
        )
        self.connections[address] = connection
        self._tasks[address] = guarded_task(
            connection.run(), name=f"edge-connection-{address}", logger=logger
        )

    async def _disconnect(self, address: str) -> None:
        """The Service no longer lists `address`: a link that is up leaves once its runs are
        done (the Edge may be draining them before it exits); any other is dropped now."""
        task = self._tasks.pop(address, None)
        connection = self.connections.pop(address, None)
        if task is None or connection is None:
            return
        if not connection.connected.is_set():
            await stop_tasks([task])
            return
        connection.leave()
        self._leaving[address] = task

        def left(_: object) -> None:
            self._leaving.pop(address, None)
            self._resolve_now.set()  # if it is listed again, connect it again

        task.add_done_callback(left)

    def _welcomed(self) -> int:
        return sum(1 for c in self.connections.values() if c.connected.is_set())

    def _link_down(self, connection: EdgeConnection, welcomed: bool) -> None:
        """A link dropped or a dial failed: where the Edges are may have changed."""
        if not self._services or connection.target in self._edges:
            return
        if welcomed:
            now = asyncio.get_running_loop().time()
            self._pacing.lost(now, welcomed_before=self._welcomed() + 1)
        self._resolve_now.set()

    async def _resolve_once(self) -> None:
        wanted = set(self._edges)
        for service in self._services:
            host, port = split_listener(service)
            try:
                wanted.update(await self._resolve(host, port))
            except OSError as exc:
                # A headless Service with no ready Edge may not resolve at all (NXDOMAIN).
                self._unresolved.warning("cannot resolve %s: %s", service, exc)
                wanted |= {a for a in self.connections if a not in self._edges}
        for address in sorted(wanted - set(self.connections)):
            logger.info("new Edge address %s", address)
            self._connect(address)
        for address in sorted(set(self.connections) - wanted):
            logger.info("Edge address %s is gone", address)
            await self._disconnect(address)

    async def _resolve_forever(self) -> None:
        """Look again when `ResolvePacing` says so, or at once when a link drops (spaced)."""
        loop = asyncio.get_running_loop()
        pacing = self._pacing
        last = loop.time()
        while True:
            delay = pacing.delay(
                loop.time(), welcomed=self._welcomed(), listed=len(self.connections)
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resolve_now.wait(), delay)
            await asyncio.sleep(max(0.0, last + pacing.spacing - loop.time()))
            self._resolve_now.clear()
            last = loop.time()
            await self._resolve_once()
