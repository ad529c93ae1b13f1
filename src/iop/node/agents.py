"""The Node agent: one router shared by connections to every Edge replica.

In production the Edge runs as several replicas behind a Service, and every replica must be able
to dispatch to every Node. The agent keeps one `EdgeConnection` per Edge address: the addresses
given (`edges`), plus every address a service name resolves to (`services`, for a headless
Service), re-resolved periodically so replicas that come and go are followed. All connections
share one `Router`, so a provider's capacity holds across all Edges, and one `PayloadArbiter`,
so replicas that disagree on the config mid-rollout never flip the Node between two.

`drain(grace)` is how a Node leaves (SIGTERM in `iop node run`): every Edge hears at once that
its providers are draining and stops dispatching here, runs that still arrive are refused with
the retryable `provider_busy`, and the runs in flight get up to `grace` seconds to finish. Then
every link says goodbye (it ends its half of the stream after its last message and waits for the
Edge to close the stream), so no Edge loses the end of a run that finished here; `stop()` closes
what is left.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Sequence

from iop.aiokits import AsyncService, guarded_task, stop_tasks
from iop.edgeconfig import split_listener
from iop.wire import DEFAULT_LIVENESS, ClientTls, Liveness

from .arbitrating import PayloadArbiter
from .connecting import Backoff, EdgeConnection, NodeIdentity
from .routing import Router

__all__ = ["NodeAgent"]

logger = logging.getLogger(__name__)

#: Seconds a drained Node gives its links to say goodbye when the grace is (nearly) over.
LEAVE_TIMEOUT_S = 1.0
#: Seconds between two resolutions of the Edge services while no Edge has welcomed this Node.
_UNWELCOMED_RESOLVE_S = 1.0


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
        tls: ClientTls | None = None,
    ) -> None:
        if not edges and not services:
            raise ValueError("a node needs at least one Edge address or service name")
        for address in (*edges, *services):
            split_listener(address)
        self.identity = NodeIdentity(
            node_id, token, alias, instance_id=uuid.uuid4().hex[:12], started_at=time.time()
        )
        self.router = Router(drain_timeout=drain_timeout)
        self.arbiter = PayloadArbiter(self.router)
        self._edges = tuple(edges)
        self._services = tuple(services)
        self._backoff = (backoff_initial, backoff_max)
        self._liveness = liveness
        self._tls = tls
        # Read here, once for every connection: a missing or empty file fails at once.
        self._credentials = tls.credentials() if tls is not None else None
        self._resolve_interval = resolve_interval
        self.connections: dict[str, EdgeConnection] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._resolver: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for address in self._edges:
            self._connect(address)
        if self._services:
            await self._resolve_once()
            self._resolver = guarded_task(
                self._resolve_forever(), name="node-resolver", logger=logger
            )

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): ready once an Edge has welcomed this Node, and not while it drains."""
        if self.router.draining:
            return False, "draining: the node is leaving"
        welcomed = sum(1 for c in self.connections.values() if c.connected.is_set())
        if not welcomed:
            return False, "no Edge has welcomed this node yet"
        return True, f"welcomed by {welcomed} of {len(self.connections)} Edge(s)"

    async def drain(self, grace: float) -> bool:
        """Stop taking runs, tell every Edge, and wait up to `grace` seconds for the runs in
        flight to end; True when they all did. Call `stop()` after it."""
        self.router.drain()
        running = self.router.running
        logger.info("draining: %d run(s) in flight, up to %.0fs", running, grace)
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        try:
            await asyncio.wait_for(self.router.wait_idle(), grace)
        except TimeoutError:
            logger.warning(
                "drain grace of %.0fs over: %d run(s) still in flight are cut",
                grace,
                self.router.running,
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
        links = list(self._tasks.values())
        if links:
            await asyncio.wait(links, timeout=max(until - loop.time(), LEAVE_TIMEOUT_S))
        return True  # the router logged the end of the drain

    async def stop(self) -> None:
        """Drop every connection (their runs are cancelled), then close the adapters."""
        tasks = list(self._tasks.values())
        if self._resolver is not None:
            tasks.append(self._resolver)
        await stop_tasks(tasks)
        self._tasks.clear()
        await self.router.aclose()

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
        if address in self.connections:
            return
        connection = EdgeConnection(
            address,
            self.identity,
            self.router,
            arbiter=self.arbiter,
            backoff=Backoff(*self._backoff),
            tls=self._tls,
            credentials=self._credentials,
            liveness=self._liveness,
        )
        self.connections[address] = connection
        self._tasks[address] = guarded_task(
            connection.run(), name=f"edge-connection-{address}", logger=logger
        )

    async def _disconnect(self, address: str) -> None:
        task = self._tasks.pop(address, None)
        self.connections.pop(address, None)
        if task is not None:
            await stop_tasks([task])

    async def _resolve_once(self) -> None:
        wanted = set(self._edges)
        loop = asyncio.get_running_loop()
        for service in self._services:
            host, port = split_listener(service)
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                logger.warning("cannot resolve %s: %s", service, exc)
                wanted |= {a for a in self.connections if a not in self._edges}
                continue
            for family, _, _, _, sockaddr in infos:
                ip = str(sockaddr[0])
                wanted.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
        for address in sorted(wanted - set(self.connections)):
            logger.info("new Edge address %s", address)
            self._connect(address)
        for address in sorted(set(self.connections) - wanted):
            logger.info("Edge address %s is gone", address)
            await self._disconnect(address)

    async def _resolve_forever(self) -> None:
        while True:
            # Until an Edge has welcomed this Node, look again every second: at start no Edge
            # replica may be ready yet, and a headless Service lists only ready pods.
            welcomed = any(c.connected.is_set() for c in self.connections.values())
            interval = self._resolve_interval
            await asyncio.sleep(interval if welcomed else min(_UNWELCOMED_RESOLVE_S, interval))
            await self._resolve_once()
