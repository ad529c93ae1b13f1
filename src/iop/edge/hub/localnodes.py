"""Nodes placed on the Edge (`nodes[].placement: edge`): their providers run in this process.

Each such node runs the Node's own machinery (an `iop.providers.Runner`: adapters, capacity,
probes and outlier detection, drain on swap) inside every Edge replica, and the hub hands its
runs to the runner directly: the request path (`relaying.py`) sees the same `RunEvents`
(`LocalRun`) as from a Node. Each replica takes its share of a provider's capacity
(`edge_share`); `set_replicas` re-applies every payload when the count of peers changes. A run
pulls its next event only when its client took the last; `expire_stalled`, called from the
hub's tick, stops one whose client stalls. docs/edge.md, "Nodes placed on the Edge", says why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType

from iop.aiokits import guarded_task
from iop.edgeconfig import NodePayload, ProviderPayload, UpstreamPolicy, edge_share
from iop.providers import AdmittedRun, Provision, Runner
from iop.wire import (
    TERMINAL_EVENTS,
    UNSPECIFIED,
    ConfigAck,
    ProviderHealth,
    RunEvent,
    RunFailed,
    RunRequest,
    statuses,
)

from .protocol import NodeStatus, ProviderLink, ProviderLoad

logger = logging.getLogger(__name__)

#: What the admin API and the status show as the "peer" of a node placed on the Edge.
LOCAL_PEER = "edge-local"


class LocalRun:
    """One run on a node placed on this Edge: the `RunEvents` of `hub/protocol.py`, pulled from the
    runner as the consumer asks for them."""

    __slots__ = (
        "_ended",
        "_events",
        "_local",
        "_on_end",
        "_pending",
        "_provision",
        "_pulling",
        "_runner",
        "idle_since",
        "request",
    )

    def __init__(self, local: LocalNodes, runner: Runner, request: RunRequest) -> None:
        self.request = request
        self._local = local
        self._runner = runner
        self._events: AdmittedRun | None = None
        self._provision: Provision | None = None
        #: An event to hand out before pulling more (a refusal, or the stall's failure).
        self._pending: RunEvent | None = None
        self._pulling = False
        self._ended = False
        self._on_end: list[Callable[[], object]] = []
        #: Loop time since when the run has waited for its consumer (None: it is pulling).
        self.idle_since: float | None = None

    async def __aenter__(self) -> LocalRun:
        admitted = self._runner.admit(self.request)
        if isinstance(admitted, RunFailed):
            self._pending = admitted
            self._end()
        else:
            self._provision = admitted
            self._events = self._runner.run_events(self.request, admitted)
            self._local.runs.add(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the run unless it has ended (the upstream request is aborted at once)."""
        events, self._events = self._events, None
        if events is not None:
            await events.aclose()
        self._end()

    def __aiter__(self) -> LocalRun:
        return self

    async def __anext__(self) -> RunEvent:
        pending = self._pending
        if pending is not None:
            self._pending = None
            return pending
        events = self._events
        if events is None:
            raise StopAsyncIteration
        self._pulling = True
        self.idle_since = None
        try:
            event = await anext(events)
        except StopAsyncIteration:
            self._events = None
            self._end()
            raise
        finally:
            self._pulling = False
        if self._events is not events:  # stopped while the pull was under way
            await events.aclose()
            return await self.__anext__()
        if isinstance(event, TERMINAL_EVENTS):
            self._events = None
            # The runner's slot is free before the dispatcher's is (`_end` calls it), which
            # may hand it on at once: a generator left suspended would hold it until collected.
            await events.aclose()
            self._end()
        else:
            self.idle_since = asyncio.get_running_loop().time()
        return event

    def on_end(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once the run has ended (its terminal event was pulled, it was
        refused, stopped or closed); at once if it has."""
        if self._ended:
            callback()
        else:
            self._on_end.append(callback)

    def take_ready(self) -> list[RunEvent]:
        return []  # nothing waits here: an event is read from the upstream when asked for

    def cancel(self, *, first_byte_timeout: bool = False) -> None:
        """Stop the run now unless it has ended; `first_byte_timeout`: it counts against its
        provider's health as an upstream timeout (the Edge gave up waiting for a first byte)."""
        if self._ended:
            return
        provision = self._provision
        if first_byte_timeout and provision is not None:
            self._runner.judge_late(self.request, provision)
        self._close_soon()

    def stall(self, seconds: float) -> None:
        """The client took nothing for `seconds`: stop the run (its slot is free at once); the
        client gets the `stream_stalled` error if it ever reads again."""
        if self._ended or self._pulling:
            return  # a pull under way waits for the upstream, not for the client
        self._pending = statuses.failure(
            statuses.STREAM_STALLED,
            f"the client read too little of this stream for {seconds:g}s "
            "(openai.stream_stall_timeout_ms): it was stopped to free its provider",
        )
        self._close_soon()

    def _close_soon(self) -> None:
        events, self._events = self._events, None
        self._end()
        if events is not None and not self._pulling:
            # Not running (no pull is under way, or it was cancelled): closing it aborts the
            # adapter and releases the slot.
            guarded_task(events.aclose(), name=f"close-{self.request.run_id}", logger=logger)

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.idle_since = None
        self._local.runs.discard(self)
        callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("an end callback of run %s failed", self.request.run_id)


class LocalNodes:
    """The runners of the nodes placed on this Edge, one per node, and their runs."""

    def __init__(
        self,
        on_change: Callable[[], None],
        *,
        drain_timeout: float = 30.0,
        policy: UpstreamPolicy | None = None,
    ) -> None:
        self._on_change = on_change
        self._drain_timeout = drain_timeout
        #: What the placed nodes' providers may reach and which keys they may read.
        self._policy = policy
        self._runners: dict[str, Runner] = {}
        #: node id -> the payload as configured (before the replica share).
        self._payloads: dict[str, NodePayload] = {}
        #: node id -> (generation, digest) of the payload in use.
        self._applied: dict[str, tuple[int, str]] = {}
        self._aliases: dict[str, str] = {}
        self._started = time.time()
        self._health: dict[str, ProviderHealth] = {}
        self._provider_nodes: dict[str, str] = {}
        self.replicas = 1
        #: provider id -> its load, as a Node's heartbeat would say it (refreshed each tick).
        self.loads: dict[str, ProviderLoad] = {}
        #: Runs not ended yet.
        self.runs: set[LocalRun] = set()

    @property
    def node_ids(self) -> Iterable[str]:
        return self._runners.keys()

    def apply(
        self, payloads: Mapping[str, NodePayload], digests: Mapping[str, str], generation: int
    ) -> dict[str, ConfigAck]:
        """Make `payloads` (node id -> payload, the nodes placed on the Edge) current: a new
        runner for a new node, a swap with drain for a changed one; node id -> its ack, for
        those two only (a node whose payload did not change is not applied to, as a remote
        node whose payload did not change is not pushed to)."""
        acks: dict[str, ConfigAck] = {}
        for node_id, payload in payloads.items():
            digest = digests[node_id]
            runner = self._runners.get(node_id)
            if runner is not None and self._applied.get(node_id, (0, ""))[1] == digest:
                self._payloads[node_id] = payload  # the same digest: only its alias may differ
                self._aliases[node_id] = payload.alias or ""
                continue
            if runner is None:
                runner = Runner(drain_timeout=self._drain_timeout, policy=self._policy)
                self._runners[node_id] = runner
                runner.add_health_listener(self._health_changed)
            self._payloads[node_id] = payload
            self._aliases[node_id] = payload.alias or ""
            self._apply(runner, payload, digest)
            self._applied[node_id] = (generation, digest)
            acks[node_id] = ConfigAck(generation, digest, ok=True, in_use_hash=digest)
        self._provider_nodes = {
            provider.id: node_id
            for node_id, payload in self._payloads.items()
            if node_id in payloads
            for provider in payload.providers
        }
        for node_id in [n for n in self._runners if n not in payloads]:
            self._retire(node_id)
        self._on_change()
        return acks

    def set_replicas(self, replicas: int) -> bool:
        """Share capacity among `replicas` Edges from now on; whether the share changed."""
        replicas = max(1, replicas)
        if replicas == self.replicas:
            return False
        self.replicas = replicas
        for node_id, runner in self._runners.items():
            self._apply(runner, self._payloads[node_id], self._applied[node_id][1])
        return True

    def _apply(self, runner: Runner, payload: NodePayload, digest: str) -> None:
        """Swap `runner` to `payload` with this replica's share of each capacity."""
        replicas = self.replicas
        if replicas == 1:
            runner.apply(payload, digest)
            return
        shared = payload.model_copy(
            update={"providers": tuple(_share(p, replicas) for p in payload.providers)}
        )
        runner.apply(shared)  # its own digest: a new share is a new registry

    def _retire(self, node_id: str) -> None:
        runner = self._runners.pop(node_id)
        runner.remove_health_listener(self._health_changed)
        self._payloads.pop(node_id, None)
        self._applied.pop(node_id, None)
        for pid in [p for p, h in self._health.items() if p not in self._provider_nodes]:
            del self._health[pid]
            self.loads.pop(pid, None)
        guarded_task(runner.aclose(), name=f"retire-{node_id}", logger=logger)

    def _health_changed(self, health: list[ProviderHealth]) -> None:
        for item in health:
            self._health[item.provider_id] = item
        self._on_change()

    def links(self) -> dict[str, ProviderLink]:
        """provider id -> its link, for the providers of every node placed here."""
        found: dict[str, ProviderLink] = {}
        for provider_id, node_id in self._provider_nodes.items():
            health = self._health.get(provider_id)
            if health is None:
                continue  # its runner has not judged it yet (it reports right after a swap)
            reason = health.reason or ("" if health.healthy else UNSPECIFIED)
            found[provider_id] = ProviderLink(
                provider_id, node_id, health.healthy, health.detail, reason
            )
        return found

    def run(self, request: RunRequest) -> LocalRun | None:
        """The run's events on the runner of its provider's node (None: not placed here)."""
        node_id = self._provider_nodes.get(request.provider_id)
        if node_id is None:
            return None
        return LocalRun(self, self._runners[node_id], request)

    def paused(self, now: float, longer_than: float) -> int:
        """How many runs' clients have pulled nothing for `longer_than` seconds."""
        return sum(
            1
            for run in self.runs
            if run.idle_since is not None and now - run.idle_since > longer_than
        )

    def tick(self, now: float, stall_timeout: float) -> int:
        """The hub's heartbeat tick: refresh the loads; stop the runs whose client stalled
        longer than `stall_timeout` (how many)."""
        reported_at = time.monotonic()
        loads: dict[str, ProviderLoad] = {}
        for runner in self._runners.values():
            in_flight = runner.in_flight()
            servers = runner.server_loads()
            for provider_id in runner.registry.provisions:
                loads[provider_id] = ProviderLoad(
                    in_flight.get(provider_id, 0), servers.get(provider_id), reported_at
                )
        self.loads = loads
        stalled = [
            run
            for run in self.runs
            if run.idle_since is not None and now - run.idle_since > stall_timeout
        ]
        for run in stalled:
            run.stall(stall_timeout)
        return len(stalled)

    def nodes(self) -> dict[str, NodeStatus]:
        """The nodes placed here, as the admin API lists connected nodes."""
        running: dict[str, int] = {}
        for run in self.runs:
            node_id = self._provider_nodes.get(run.request.provider_id, "")
            running[node_id] = running.get(node_id, 0) + 1
        return {
            node_id: NodeStatus(
                node_id,
                self._aliases.get(node_id, ""),
                LOCAL_PEER,
                LOCAL_PEER,
                True,
                self._applied[node_id][0],
                self._applied[node_id][1],
                running.get(node_id, 0),
                self._started,
                runner.drain_progress(),
            )
            for node_id, runner in self._runners.items()
        }

    async def aclose(self) -> None:
        """Stop probing and close every adapter (after the runs using them end)."""
        runners, self._runners = list(self._runners.values()), {}
        self._provider_nodes = {}
        await asyncio.gather(*(runner.aclose() for runner in runners))


def _share(provider: ProviderPayload, replicas: int) -> ProviderPayload:
    slots = provider.long_context_slots
    return provider.model_copy(
        update={
            "capacity": edge_share(provider.capacity, replicas),
            "long_context_slots": None if slots is None else edge_share(slots, replicas),
        }
    )
