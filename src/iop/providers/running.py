"""The runner of one node's providers: the adapter registry, capacity, swap with drain, health.

A `Runner` runs in a Node agent (`iop.node`, shared by its links to every Edge) or in the Edge,
for a node placed there (`iop.edge.hub.localnodes`). `apply` swaps in the registry built from a
payload (`provisions.py`; unchanged adapters carried over, replaced ones closed once their runs
end); `execute` pushes a run's events to a Node's stream and `run_events` hands them over
in-process (`admittedruns.py`); a run beyond a provider's capacity is refused as the retryable
`provider_busy`; `drain` reports every provider draining; each provider's health comes from
`probing.py` and `healthstates.py`. docs/architecture.md, "The providers", says how and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from types import MappingProxyType

import orjson

from iop.aiokits import guarded_task, stop_tasks
from iop.edgeconfig import NodePayload, UpstreamPolicy
from iop.wire import (
    DRAINING,
    RESPONSE_LOOKUPS,
    TERMINAL_EVENTS,
    DrainProgress,
    ProviderHealth,
    RunDone,
    RunEvent,
    RunFailed,
    RunRequest,
    ServerLoad,
    statuses,
)

from .adapters import AdapterError, build_adapter
from .admittedruns import AdmittedRun
from .probing import Prober
from .provisions import Provision, Registry

logger = logging.getLogger(__name__)

#: Seconds between two drain progress lines in the log (the end of a drain is always logged).
DRAIN_LOG_INTERVAL_S = 1.0
#: A run that ends this close to its deadline ended because of it (clocks tick unevenly).
_DEADLINE_SLACK_S = 0.05
#: The message of a run task's cancellation when the Edge gave up on its first byte: the run
#: then counts as its provider's upstream timeout (outlier detection).
FIRST_BYTE_TIMEOUT = "first_byte_timeout"

#: Called with the health of providers whose verdict may have changed (every one after a swap).
HealthListener = Callable[[list[ProviderHealth]], None]
#: Called with the drain progress whenever it changes.
DrainListener = Callable[[DrainProgress], None]


@dataclass(frozen=True, slots=True)
class DrainReport:
    """How closing the adapters a swap replaced went."""

    provider_ids: tuple[str, ...]
    waited_s: float
    #: Runs still in flight when the drain timeout ran out (their adapter was closed anyway).
    cut_runs: int


class RunGate:
    """Open unless the Edge paused the run; a paused run waits here between two events."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()


class Runner:
    """Admits, runs and counts runs; swaps registries. One per Node process, shared by all its
    Edges, or one per node placed on an Edge, in each Edge replica."""

    def __init__(
        self, *, drain_timeout: float = 60.0, policy: UpstreamPolicy | None = None
    ) -> None:
        self._registry = Registry.empty()
        #: What the providers may reach and which keys they may read (None: anything).
        self._policy = policy
        self._drain_timeout = drain_timeout
        self._in_flight: dict[str, int] = {}
        self._long_in_flight: dict[str, int] = {}
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self._drains: set[asyncio.Task[DrainReport]] = set()
        self.drain_reports: deque[DrainReport] = deque(maxlen=32)
        self._listeners: list[HealthListener] = []
        self._drain_listeners: list[DrainListener] = []
        #: Replaced provisions whose runs a swap's drain still waits for.
        self._retiring: set[Provision] = set()
        self._drain_started = 0.0
        self._drain_logged = 0.0
        #: provider id -> what its server's /metrics said of its load, and when (monotonic).
        self._server_loads: dict[str, tuple[ServerLoad, float]] = {}
        self.prober = Prober(self._probed, self._loaded, policy=policy)

    @property
    def registry(self) -> Registry:
        return self._registry

    def in_flight(self) -> dict[str, int]:
        return {pid: n for pid, n in self._in_flight.items() if n}

    def server_loads(self) -> dict[str, ServerLoad]:
        """provider id -> its model server's last reported load, aged to now (the providers of
        the registry in use whose server exposes vLLM's metrics)."""
        now = time.monotonic()
        provisions = self._registry.provisions
        return {
            pid: replace(load, age_s=now - read_at)
            for pid, (load, read_at) in self._server_loads.items()
            if pid in provisions
        }

    def config_problems(self) -> list[tuple[str, str]]:
        """(provider id, problem) for each provider of the config in use that cannot run on
        this node (`Provision.problem`), in the config's order: what the node's readiness
        names. A provider whose server is down or failing is not listed."""
        provisions = self._registry.provisions
        return [(pid, p.problem) for pid, p in provisions.items() if p.problem]

    def health(self, provider_ids: Iterable[str] | None = None) -> list[ProviderHealth]:
        """The health of every provider (or of `provider_ids`, those of the registry in use)."""
        provisions = self._registry.provisions
        ids = provisions if provider_ids is None else [p for p in provider_ids if p in provisions]
        if self.draining:
            return [ProviderHealth(pid, False, "the node is draining", DRAINING) for pid in ids]
        return [provisions[pid].health for pid in ids]

    @property
    def running(self) -> int:
        """Runs in flight on this node, across every Edge."""
        return self._running

    def drain(self) -> None:
        """Take no new runs from now on and tell every Edge (health: unhealthy, draining)."""
        if self.draining:
            return
        self.draining = True
        self._drain_started = time.monotonic()
        self._report_health(self.health())
        self._report_drain()

    async def wait_idle(self) -> None:
        """Until no run is in flight."""
        await self._idle.wait()

    def add_health_listener(self, callback: HealthListener) -> None:
        """`callback(health)` after every swap, with the health of every provider, and whenever
        a provider's verdict changes, with its health."""
        self._listeners.append(callback)

    def remove_health_listener(self, callback: HealthListener) -> None:
        """Stop calling `callback` (one registration of it; absent is fine)."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    @property
    def health_listeners(self) -> int:
        """How many listeners are registered (one per live Edge session)."""
        return len(self._listeners)

    def add_drain_listener(self, callback: DrainListener) -> None:
        """`callback(progress)` when a drain starts, whenever a run it waits for ends, and when
        it is over."""
        self._drain_listeners.append(callback)

    def remove_drain_listener(self, callback: DrainListener) -> None:
        """Stop calling `callback` (one registration of it; absent is fine)."""
        with contextlib.suppress(ValueError):
            self._drain_listeners.remove(callback)

    def drain_progress(self) -> DrainProgress:
        """The runs each provider still has to finish before the drains under way are done."""
        if self.draining:
            return DrainProgress(True, self.in_flight())
        left: dict[str, int] = {}
        for provision in self._retiring:
            if provision.active:
                pid = provision.payload.id
                left[pid] = left.get(pid, 0) + provision.active
        return DrainProgress(False, left)

    def _report_health(self, health: list[ProviderHealth]) -> None:
        for listener in list(self._listeners):
            listener(health)

    def _report_drain(self) -> None:
        progress = self.drain_progress()
        for listener in list(self._drain_listeners):
            listener(progress)
        now = time.monotonic()
        if progress.total and now - self._drain_logged < DRAIN_LOG_INTERVAL_S:
            return
        self._drain_logged = now
        what = "shutdown drain" if progress.shutting_down else "swap drain"
        if progress.total:
            per_provider = ", ".join(f"{pid}: {n}" for pid, n in sorted(progress.runs_left.items()))
            logger.info("%s: %d run(s) left (%s)", what, progress.total, per_provider)
        else:
            logger.info("%s: every run ended after %.3fs", what, now - self._drain_started)

    def _probed(self, provider_id: str, failure: str | None) -> None:
        """A probe's result: judged by the provider's state; a new verdict goes to every Edge."""
        provision = self._registry.provisions.get(provider_id)
        if provision is None or provision.state is None:
            return
        if provision.state.record_probe(failure):
            self._verdict(provision)

    def _loaded(self, provider_id: str, load: ServerLoad) -> None:
        """What a provider's server said of its load (probing.py), for the heartbeats, with the
        requests at the server that were not this runner's runs then (other clients)."""
        ours = self._in_flight.get(provider_id, 0)
        load = replace(load, not_ours=max(0, load.running + load.waiting - ours))
        self._server_loads[provider_id] = (load, time.monotonic())

    def _verdict(self, provision: Provision) -> None:
        health = provision.health
        if health.healthy:
            logger.info("provider %s is healthy", health.provider_id)
        else:
            logger.warning(
                "provider %s is unhealthy (%s): %s",
                health.provider_id,
                health.reason,
                health.detail,
            )
        self._report_health(self.health([health.provider_id]))

    # -- swapping ----------------------------------------------------------------------------------

    def apply(self, payload: NodePayload, digest: str | None = None) -> bool:
        """Make `payload` the config in use; False when it is the one in use already.

        `digest` is `payload.digest` when the caller has it already. Never raises for a bad
        provider: that provider gets no adapter and reports itself unhealthy with the reason,
        the others run.
        """
        digest = payload.digest if digest is None else digest
        if digest == self._registry.digest:
            return False
        old = self._registry
        provisions: dict[str, Provision] = {}
        carried: set[int] = set()
        for provider in payload.providers:
            previous = old.provisions.get(provider.id)
            key = orjson.dumps(provider.adapter, option=orjson.OPT_SORT_KEYS)
            if (
                previous is not None
                and previous.adapter is not None
                and previous.settings_key == key
            ):
                provision = Provision(provider, previous.adapter, runs=previous.runs)
                provision.judge(previous.state)
                carried.add(id(previous))
            else:
                try:
                    provision = Provision(provider, build_adapter(provider, self._policy))
                except AdapterError as exc:
                    logger.error("%s", exc)
                    provision = Provision(provider, None, build_error=exc.problem)
                provision.judge(None)
            provisions[provider.id] = provision
        self._registry = Registry(MappingProxyType(provisions), payload, digest)
        self.prober.watch(
            {pid: probe for pid, p in provisions.items() if (probe := p.probe) is not None}
        )
        retired = [p for p in old.provisions.values() if id(p) not in carried]
        logger.info(
            "config %s applied: %d provider(s), %d adapter(s) retired",
            digest[:12],
            len(provisions),
            len(retired),
        )
        if retired:
            busy = [p for p in retired if p.active]
            for provision in busy:
                provision.retired = True
                self._retiring.add(provision)
            task = guarded_task(self._drain(retired), name=f"drain-{digest[:12]}", logger=logger)
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
            if busy and not self.draining:
                self._drain_started = time.monotonic()
                self._report_drain()
        self._report_health(self.health())
        return True

    async def _drain(self, retired: list[Provision]) -> DrainReport:
        start = time.monotonic()
        busy = [p for p in retired if p.active]
        if busy:
            waits = [asyncio.ensure_future(p.runs.idle.wait()) for p in busy]
            try:
                await asyncio.wait(waits, timeout=self._drain_timeout)
            finally:
                for wait in waits:
                    wait.cancel()
        cut = sum(p.active for p in retired)
        if self._retiring.intersection(retired):
            self._retiring.difference_update(retired)
            if cut and not self.draining:  # the runs cut no longer count: progress says so
                self._report_drain()
        for provision in retired:
            if provision.adapter is not None:
                try:
                    await provision.adapter.aclose()
                except Exception:
                    logger.exception("closing the adapter of %s failed", provision.payload.id)
        report = DrainReport(
            tuple(p.payload.id for p in retired), round(time.monotonic() - start, 3), cut
        )
        self.drain_reports.append(report)
        if cut:
            logger.warning(
                "drain timed out after %.0fs: %d run(s) cut on %s",
                self._drain_timeout,
                cut,
                ", ".join(report.provider_ids),
            )
        else:
            logger.info(
                "retired adapters of %s closed after %.3fs",
                ", ".join(report.provider_ids),
                report.waited_s,
            )
        return report

    async def aclose(self) -> None:
        """Stop probing; close every adapter: the current ones (after their runs end) and any
        still draining."""
        await self.prober.aclose()
        retired = list(self._registry.provisions.values())
        self._registry = Registry.empty()
        if retired:
            await self._drain(retired)
        await stop_tasks(self._drains)

    # -- running -----------------------------------------------------------------------------------

    def admit(self, request: RunRequest) -> Provision | RunFailed:
        """Take a capacity slot for `request`, or say why not (retryable: `provider_busy`)."""
        if self.draining:
            return statuses.failure(
                statuses.PROVIDER_BUSY, "the node is draining before it exits: try another"
            )
        provision = self._registry.provisions.get(request.provider_id)
        if provision is None:
            return statuses.failure(
                statuses.UNKNOWN_PROVIDER,
                f"this node has no provider {request.provider_id!r} in its current config",
            )
        if provision.adapter is None:
            return statuses.failure(
                statuses.PROVIDER_UNHEALTHY, f"provider {request.provider_id}: {provision.problem}"
            )
        pid = request.provider_id
        payload = provision.payload
        # A stored response's retrieve, delete or cancel is a lookup, not a generation: it
        # takes no slot (a busy server still answers it), though it is counted while it runs.
        busy = self._in_flight.get(pid, 0) >= payload.capacity
        if busy and request.kind not in RESPONSE_LOOKUPS:
            return statuses.failure(
                statuses.PROVIDER_BUSY,
                f"provider {pid} is at capacity ({payload.capacity} runs, across all Edges)",
            )
        if request.long_context:
            slots = payload.long_context_slots
            if slots is not None and self._long_in_flight.get(pid, 0) >= slots:
                return statuses.failure(
                    statuses.PROVIDER_BUSY,
                    f"provider {pid} has no free long-context slot ({slots}, across all Edges)",
                )
            self._long_in_flight[pid] = self._long_in_flight.get(pid, 0) + 1
        self._in_flight[pid] = self._in_flight.get(pid, 0) + 1
        self._running += 1
        self._idle.clear()
        provision.runs.active += 1
        provision.runs.idle.clear()
        return provision

    def judge_run(
        self, request: RunRequest, provision: Provision, end: RunDone | RunFailed
    ) -> None:
        """Outlier detection: how a real run ended counts toward its provider's health (an
        `AdmittedRun` calls it with its terminal event)."""
        state = provision.state
        if state is None or provision.retired:
            return
        deadline = request.deadline
        past = deadline is not None and time.time() >= deadline - _DEADLINE_SLACK_S
        if state.record_run(end, past_deadline=past):
            self._verdict(provision)

    def release(self, request: RunRequest, provision: Provision) -> None:
        pid = request.provider_id
        self._in_flight[pid] -= 1
        if request.long_context:
            self._long_in_flight[pid] -= 1
        self._running -= 1
        if not self._running:
            self._idle.set()
        runs = provision.runs
        runs.active -= 1
        if not runs.active:
            runs.idle.set()
        if self.draining or provision.retired:
            self._report_drain()

    def run_events(self, request: RunRequest, provision: Provision) -> AdmittedRun:
        """An admitted run's events, pulled one by one: the run ends after its terminal event
        (`RunDone` or `RunFailed`), which counts toward its provider's health, and releases its
        slot then, however it ends: the caller must close it (`aclose`) if it stops early,
        which aborts the adapter's work at once."""
        return AdmittedRun(self, request, provision)

    def judge_late(self, request: RunRequest, provision: Provision) -> None:
        """Count a run its Edge cancelled for want of a first byte against its provider."""
        late = "the Edge cancelled the run: no first byte within the model's deadline"
        self.judge_run(request, provision, statuses.failure(statuses.UPSTREAM_TIMEOUT, late))

    async def execute(
        self,
        events: AdmittedRun,
        emit: Callable[[RunEvent], object],
        gate: RunGate | None = None,
        room: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        """Run an admitted request's `events` (`run_events`), `emit`ting them; releases the slot
        however it ends (a task of it cancelled before its first step never runs this: its
        owner calls `events.abandon()` when the task is done).

        Between two events the run waits while `gate` is paused, and for what `room()` returns
        when it returns something (the connection's writer bounding what it holds): the next
        event is pulled from the adapter only then. Cancellation (the Edge's Cancel, a lost
        connection) aborts the adapter's work at once and emits nothing more.
        """
        try:
            async for event in events:
                emit(event)
                if isinstance(event, TERMINAL_EVENTS):
                    return
                if gate is not None and gate.paused:
                    await gate.wait_open()
                if room is not None and (wait := room()) is not None:
                    await wait
        except asyncio.CancelledError as cancelled:
            if cancelled.args == (FIRST_BYTE_TIMEOUT,):
                self.judge_late(events.request, events.provision)
            raise
        finally:
            await events.aclose()
