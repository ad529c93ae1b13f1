"""Dispatch: which provider runs a request now, and which request a freed slot serves next.

`Dispatcher` keeps the rules docs/edge.md, "Dispatch", gives operators: candidates, capacity and
long slots, the lowest priority, then the model's policy among equals (`choosing.py`; for a LoRA
adapter's request, after the servers most ready for its adapter, and a wait at the Edge rather
than a swap while a server that holds it is busy: docs/edge.md, "LoRA adapters"); a bounded
queue per model, in strict order of the requests' priority classes (`priorities.py`: a higher
class always first, a sheddable one refused at a saturated model rather than queued, the lowest
class's latest request displaced from a full queue by a higher one, each class's wait bounded)
and fair between principals by weight within a class; a freed slot given at once to the waiting
request its provider can serve first; `provider_busy` cool-downs (`BUSY_COOLDOWN_S`); the
providers a retry `avoid`s (`relaying.py`); `swap(snapshot)`, one reference assignment, under
which leases keep their snapshot and slot counters (per provider id) carry over. While a change
is on trial (`splits.py`) a request of a model it shares runs on the candidate's view of the
model or on the stable one's, as its side says; each view has a queue of its own.

Everything runs on one event loop and nothing here awaits except a waiting request, so the state
needs no lock. A dispatch that finds a free candidate costs O(candidates of the model).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from iop.edgeconfig import ANONYMOUS_PRINCIPAL

from ..errors import (
    Displaced,
    ModelNotFound,
    NoProvider,
    QueueDeadline,
    QueueFull,
    QueueTimeout,
    Shed,
)
from ..hub import ProviderLoad
from .choosing import FREED_SLOT, HOME, PREFIX_AFFINITY, ROUND_ROBIN, Chooser, PrefixKey
from .priorities import (
    CLASS_WAIT,
    DEFAULT_PRIORITY,
    DISPLACED,
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    REQUEST_WAIT,
    SATURATED,
    ClassTally,
    Priority,
)
from .queues import FairQueue
from .snapshots import Candidate, PoolModel, PoolSnapshot, ProviderLimits
from .splits import STABLE, Side, Split

#: A queue: (model id, long, on the stable revision's view of a model on trial, the one provider
#: its requests must run on, or "": any).
_QueueKey = tuple[str, bool, bool, str]
#: What a freed slot of a provider can serve: (the stable view, the model, its candidate entry).
_Freed = tuple[tuple[bool, PoolModel, Candidate], ...]

#: How long a provider that refused a run as busy is left out of dispatch.
BUSY_COOLDOWN_S: Final = 0.05
#: How early an event loop's timer may fire against time.monotonic() (a clock tick, and then some).
_TIMER_SLACK_S: Final = 0.005
#: The Retry-After the Edge suggests with a 429 (queue full) or a 503 (queue timeout).
RETRY_AFTER_S: Final = 1.0
#: The bounds of the Retry-After estimated from a model's queue (a shed or displaced request).
_RETRY_AFTER_MIN_S: Final = 0.05
_RETRY_AFTER_MAX_S: Final = 60.0
#: LoRA adapters remembered per provider as sent there lately (more than a server holds).
_RECENT_ADAPTERS: Final = 32
#: Runs ended per model that the drain rate is read from, and how old the newest may be.
_DRAIN_SAMPLES: Final = 32
_DRAIN_FRESH_S: Final = 30.0


@dataclass(slots=True, eq=False)
class Lease:
    """A slot held on one provider for one run; give it back with `Dispatcher.release`."""

    provider_id: str
    node_id: str
    served_model: str
    long: bool
    pool_model: PoolModel
    snapshot: PoolSnapshot
    #: Loop time by which the request must have a slot (kept across busy retries).
    deadline: float
    #: Seconds the request waited in the queue for this lease.
    waited_s: float = 0.0
    #: Prompt bytes its server is expected to prefill, until the run's first event
    #: (`Dispatcher.started`); counted for `prefix_affinity` only.
    prefill: int = 0
    #: Its request's class is sheddable (the rate such runs end at times a shed request's
    #: Retry-After).
    sheddable: bool = False
    released: bool = field(default=False, repr=False)


class _Drain:
    """When a model's latest runs ended (time.monotonic()): the rate its slots free at."""

    __slots__ = ("ends",)

    def __init__(self) -> None:
        self.ends: deque[float] = deque(maxlen=_DRAIN_SAMPLES)

    def rate(self, now: float) -> float | None:
        """Runs ended per second lately; None when too few ended lately to say."""
        ends = self.ends
        if len(ends) < 2 or now - ends[-1] > _DRAIN_FRESH_S:
            return None
        span = ends[-1] - ends[0]
        return (len(ends) - 1) / span if span > 0 else None


class _Slots:
    """The mutable counters of one provider, keyed by provider id across snapshots."""

    __slots__ = (
        "adapters",
        "cool_until",
        "in_flight",
        "last_used",
        "long_in_flight",
        "prefill",
        "recent",
    )

    def __init__(self) -> None:
        self.in_flight = 0
        self.long_in_flight = 0
        #: Prompt bytes of runs with no first event yet, as their leases expected.
        self.prefill = 0
        self.last_used = 0  # dispatch stamp of the last run given to this provider
        self.cool_until = 0.0  # time.monotonic() until which a busy provider sits out
        #: Runs in flight by LoRA adapter, and the adapters sent here lately (latest last).
        self.adapters: dict[str, int] = {}
        self.recent: list[str] = []

    @property
    def recent_adapters(self) -> Sequence[str]:
        return self.recent

    def sent(self, adapter: str) -> None:
        """A run of `adapter` goes here: its runs counted, and it is the latest adapter sent."""
        self.adapters[adapter] = self.adapters.get(adapter, 0) + 1
        recent = self.recent
        if recent and recent[-1] == adapter:
            return
        if adapter in recent:
            recent.remove(adapter)
        recent.append(adapter)
        if len(recent) > _RECENT_ADAPTERS:
            del recent[0]

    def ended(self, adapter: str) -> None:
        runs = self.adapters.get(adapter, 0) - 1
        if runs > 0:
            self.adapters[adapter] = runs
        else:
            self.adapters.pop(adapter, None)


class _Waiter:
    __slots__ = (
        "avoid",
        "by_priority",
        "deadline",
        "enqueued_at",
        "first",
        "future",
        "home",
        "long",
        "model_id",
        "prefix",
        "principal",
        "priority",
        "seq",
        "stable_view",
        "tag",
        "timer",
    )

    def __init__(
        self,
        seq: int,
        model_id: str,
        long: bool,
        principal: str,
        deadline: float,
        future: asyncio.Future[Lease],
        avoid: frozenset[str],
        prefix: PrefixKey | None,
        stable_view: bool,
        priority: Priority = DEFAULT_PRIORITY,
        home: str = "",
    ) -> None:
        self.seq = seq
        #: The one provider it may run on (a stored response's holder), or "": any.
        self.home = home
        self.priority = priority
        #: The request's first wait (a retry's is not counted again).
        self.first = True
        #: Its deadline is its class's or its own bound, not its providers' queue timeout.
        self.by_priority = False
        self.stable_view = stable_view
        self.model_id = model_id
        self.long = long
        self.principal = principal
        self.deadline = deadline
        self.future = future
        self.avoid = avoid
        self.prefix = prefix
        self.enqueued_at = time.perf_counter()
        self.timer: asyncio.TimerHandle | None = None
        #: The virtual start tag of fair queuing (docs/edge.md, "Dispatch": fair share).
        self.tag = 0.0

    @property
    def order(self) -> tuple[float, int]:
        return (self.tag, self.seq)


def _bounded_wait(seconds: float) -> float:
    return min(_RETRY_AFTER_MAX_S, max(_RETRY_AFTER_MIN_S, seconds))


def _has_room(limits: ProviderLimits, slots: _Slots, long: bool) -> bool:
    """The provider can take the request now: a free slot (and a long one for a long request),
    and not cooling down after a busy refusal."""
    if slots.in_flight >= limits.capacity:
        return False
    if (
        long
        and limits.long_context_slots is not None
        and slots.long_in_flight >= limits.long_context_slots
    ):
        return False
    return not (slots.cool_until and slots.cool_until > time.monotonic())


class Dispatcher:
    """The provider pool's live state over an immutable snapshot."""

    def __init__(self, snapshot: PoolSnapshot) -> None:
        self._snapshot = snapshot
        self._slots: dict[str, _Slots] = {}
        self._available: frozenset[str] = frozenset()
        #: The change on trial, if any: which requests the stable revision's view serves.
        self._split: Split | None = None
        # Waiting requests by (model, long, stable view), in fair order.
        self._queues: dict[_QueueKey, FairQueue[_Waiter]] = {}
        # What a freed slot of each provider can serve, made when first needed after a swap.
        self._freed: dict[str, _Freed] = {}
        self._waiting: dict[str, int] = {}
        # Fair queuing's clocks, per model and priority while the model has waiters: the
        # virtual time, and each principal's last finish tag (forgotten when its queue empties).
        self._virtual: dict[str, dict[int, float]] = {}
        self._finish: dict[str, dict[int, dict[str, float]]] = {}
        #: What each priority class's requests came to (`priorities.py`).
        self.classes = ClassTally()
        # How fast each model's slots free, for all its runs and for its sheddable ones, and
        # when the shed requests were told to come back (not yet due): what a shed or
        # displaced request's Retry-After is estimated from.
        self._drains: dict[str, _Drain] = {}
        self._shed_drains: dict[str, _Drain] = {}
        self._promised: dict[str, deque[float]] = {}
        self._waiting_total = 0
        self._seq = 0
        self._stamp = 0
        self._timers: set[asyncio.TimerHandle] = set()
        self._chooser = Chooser()
        self._add_slots(snapshot)

    # -- the snapshot and the set of available providers ---------------------------------------

    @property
    def snapshot(self) -> PoolSnapshot:
        return self._snapshot

    @property
    def split(self) -> Split | None:
        """The change on trial, if any (`splits.py`)."""
        return self._split

    def swap(self, snapshot: PoolSnapshot, split: Split | None = None) -> None:
        """Dispatch on `snapshot` from now on, with `split` the stable revision's share of the
        models on trial (None: `snapshot` serves everything); waiting requests are re-evaluated
        at once."""
        self._add_slots(snapshot)
        if split is not None:
            self._add_slots(split.stable)
        self._snapshot = snapshot
        self._set_split(split)
        self._drop_idle_slots()
        self._chooser.keep_only(
            {
                model_id: pool_model.dispatch.policy
                for model_id, pool_model in snapshot.models.items()
            }
        )
        self._reevaluate()

    def set_share(self, share: int) -> None:
        """The candidate's share of the shared models' requests from now on (in percent)."""
        if self._split is not None:
            self._split = self._split.with_share(share)

    def end_split(self) -> None:
        """The change on trial serves everything now (promoted): the stable view's waiters move
        to the candidate's queues, in their order."""
        self._set_split(None)
        self._drop_idle_slots()
        self._reevaluate()

    def _drop_idle_slots(self) -> None:
        """Forget the counters of providers no view has any more, once nothing runs there."""
        current = self._snapshot.providers
        kept = self._split.stable.providers if self._split is not None else {}
        for provider_id in [
            pid
            for pid, slots in self._slots.items()
            if pid not in current and pid not in kept and slots.in_flight == 0
        ]:
            del self._slots[provider_id]

    def _set_split(self, split: Split | None) -> None:
        self._split = split
        self._freed = {}
        shared = split.shared if split is not None else frozenset()
        for key in [key for key in self._queues if key[2] and key[0] not in shared]:
            queue = self._queues.pop(key)
            into_key = (key[0], key[1], False, key[3])
            into = self._queues.get(into_key)
            if into is None:
                into = self._queues[into_key] = FairQueue[_Waiter]()
            for waiter in queue.in_order():
                waiter.stable_view = False
                into.push(waiter)

    def model_view(self, model_id: str, side: Side = STABLE) -> PoolModel | None:
        """The model as a request of `side` sees it (`splits.py`), or None."""
        split = self._split
        if split is not None and side == STABLE and model_id in split.shared:
            return split.stable.models.get(model_id)
        return self._snapshot.models.get(model_id)

    def _stable_view(self, model_id: str, side: Side) -> bool:
        split = self._split
        return split is not None and side == STABLE and model_id in split.shared

    def set_available(self, provider_ids: Iterable[str]) -> None:
        """The providers of connected nodes that are healthy now (the hub's view)."""
        available = frozenset(provider_ids)
        if available != self._available:
            self._available = available
            self._reevaluate()

    @property
    def available(self) -> frozenset[str]:
        return self._available

    def watch_loads(self, loads: Mapping[str, ProviderLoad]) -> None:
        """Read providers' reported loads from `loads` (the hub's live view) from now on."""
        self._chooser.loads = loads

    # -- acquiring and releasing slots ----------------------------------------------------------

    def try_acquire(
        self,
        model_id: str,
        long: bool,
        prefix: PrefixKey | None = None,
        side: Side = STABLE,
        priority: Priority = DEFAULT_PRIORITY,
        home: str = "",
    ) -> Lease | None:
        """A lease on the best free candidate now (`home`'s, when given), or None when every
        candidate is busy (or, for a sheddable `priority`, the model is saturated)."""
        pool_model = self._route(model_id, long, self._stable_view(model_id, side))
        if priority.sheddable and self._saturated(pool_model):
            return None
        chosen = self._select(pool_model, long, prefix=prefix, home=home)
        if chosen is None:
            return None
        self.classes.admit(priority)
        loop_time = asyncio.get_running_loop().time()
        deadline = loop_time + self._wait_s(pool_model, priority)[0]
        return self._take(pool_model, *chosen, long, deadline, sheddable=priority.sheddable)

    async def acquire(
        self,
        model_id: str,
        long: bool,
        *,
        deadline: float | None = None,
        principal: str = ANONYMOUS_PRINCIPAL,
        avoid: frozenset[str] = frozenset(),
        prefix: PrefixKey | None = None,
        side: Side = STABLE,
        priority: Priority = DEFAULT_PRIORITY,
        home: str = "",
    ) -> Lease:
        """A lease on the best free candidate, waiting in the model's queue if none is free.

        `deadline` (loop time) marks a retry: the request keeps its original deadline and does
        not count against the queue bound again. `principal` (a principal_ref) places a waiting
        request in the queue's fair order. `avoid`: providers this request tried already, no
        candidates while another of the model is available (free or not), candidates again when
        none is. `prefix`: the prompt's prefix points, for `prefix_affinity`. `side`: the
        revision the request runs on while a change is on trial (`splits.py`). `priority`: its
        class (`priorities.py`): its order in the queue and its wait; a sheddable request that
        arrives at a saturated model (`_saturated`) gets `Shed`, never a place in the queue.
        `home`: the one provider the request may run on (it holds the stored response the
        request continues); it waits for that provider's slot, in the same order as the rest.
        """
        stable_view = self._stable_view(model_id, side)
        pool_model = self._route(model_id, long, stable_view)
        loop = asyncio.get_running_loop()
        now = loop.time()
        if avoid and not self._others_available(pool_model, long, avoid):
            avoid = frozenset()
        first = deadline is None
        if first and priority.sheddable and self._saturated(pool_model):
            self.classes.refuse(priority, SATURATED)
            raise self._shed(model_id, priority)
        chosen = self._select(pool_model, long, avoid, prefix, home)
        wait_s, by_priority = self._wait_s(pool_model, priority)
        if chosen is not None:
            if first:
                self.classes.admit(priority)
            return self._take(
                pool_model,
                *chosen,
                long,
                now + wait_s if deadline is None else deadline,
                sheddable=priority.sheddable,
            )
        if deadline is None:
            if self._waiting.get(model_id, 0) >= pool_model.queue_bound:
                self._displace(model_id, pool_model, priority)
            deadline = now + wait_s
        elif deadline <= now:
            raise self._timeout(model_id)
        self._seq += 1
        waiter = _Waiter(
            self._seq,
            model_id,
            long,
            principal,
            deadline,
            loop.create_future(),
            avoid,
            prefix,
            stable_view,
            priority,
            home,
        )
        waiter.first = first
        waiter.by_priority = first and by_priority
        if first:
            self.classes.queue(priority)
        self._enqueue(waiter)
        waiter.timer = loop.call_at(deadline, self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def release(self, lease: Lease) -> None:
        """Give the slot back (idempotent); the oldest request that can use it gets it."""
        slots = self._give_back(lease)
        if slots is None:
            return
        model_id = lease.pool_model.id
        now = time.monotonic()
        drain = self._drains.get(model_id)
        if drain is None:
            drain = self._drains[model_id] = _Drain()
        drain.ends.append(now)
        if lease.sheddable:
            drain = self._shed_drains.get(model_id)
            if drain is None:
                drain = self._shed_drains[model_id] = _Drain()
            drain.ends.append(now)
        slots.cool_until = 0.0  # one of our runs ended there: the Node has room again
        if self._waiting_total:
            self._serve_freed(lease.provider_id)

    def started(self, lease: Lease) -> None:
        """The lease's run sent its first event: its prompt is prefilled and weighs no more in
        `prefix_affinity`'s choices."""
        if lease.prefill and not lease.released:
            self._slots[lease.provider_id].prefill -= lease.prefill
            lease.prefill = 0

    def refuse(self, lease: Lease) -> None:
        """The Node refused the run as busy: give the slot back and cool the provider down."""
        slots = self._give_back(lease)
        if slots is None:
            return
        slots.cool_until = time.monotonic() + BUSY_COOLDOWN_S
        loop = asyncio.get_running_loop()
        timer = loop.call_later(BUSY_COOLDOWN_S, self._cooled_down, lease.provider_id)
        self._timers.add(timer)

    def _give_back(self, lease: Lease) -> _Slots | None:
        """Free the lease's slots once; None when it was already given back."""
        if lease.released:
            return None
        lease.released = True
        slots = self._slots[lease.provider_id]
        slots.in_flight -= 1
        slots.prefill -= lease.prefill
        if lease.long:
            slots.long_in_flight -= 1
        if lease.pool_model.base_model is not None:
            slots.ended(lease.pool_model.id)
        return slots

    def close(self) -> None:
        """Cancel pending timers; waiting requests keep their own deadlines."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def available_for(
        self,
        model_id: str,
        long: bool,
        avoid: frozenset[str] = frozenset(),
        side: Side = STABLE,
    ) -> bool:
        """True when a candidate of the model not in `avoid` (and able to take the request)
        is on a connected, healthy node now, free or busy."""
        pool_model = self.model_view(model_id, side)
        return pool_model is not None and self._others_available(pool_model, long, avoid)

    def serves(self, model_id: str, long: bool, side: Side = STABLE) -> bool:
        """True when the model is in the catalog with an enabled provider for the request."""
        pool_model = self.model_view(model_id, side)
        return (
            pool_model is not None
            and bool(pool_model.candidates)
            and (pool_model.takes_long or not long)
        )

    # -- views for metrics and tests ----------------------------------------------------------

    def in_flight(self, provider_id: str) -> int:
        slots = self._slots.get(provider_id)
        return slots.in_flight if slots is not None else 0

    def pending_prefill(self, provider_id: str) -> int:
        """Prompt bytes of this Edge's runs on the provider with no first event yet, as
        `prefix_affinity` weighs them (`Lease.prefill`)."""
        slots = self._slots.get(provider_id)
        return slots.prefill if slots is not None else 0

    def adapter_runs(self, provider_id: str) -> tuple[Mapping[str, int], Sequence[str]]:
        """This Edge's runs on the provider by LoRA adapter, and the adapters it sent there
        lately (latest last)."""
        slots = self._slots.get(provider_id)
        if slots is None:
            return {}, ()
        return dict(slots.adapters), tuple(slots.recent)

    def long_in_flight(self, provider_id: str) -> int:
        slots = self._slots.get(provider_id)
        return slots.long_in_flight if slots is not None else 0

    def in_flight_counts(self) -> Mapping[str, tuple[int, int]]:
        """provider id -> (in flight, long in flight), for every provider the Edge knows."""
        return {pid: (s.in_flight, s.long_in_flight) for pid, s in self._slots.items()}

    def queue_depth(self, model_id: str) -> int:
        return self._waiting.get(model_id, 0)

    def queue_depths(self) -> Mapping[str, int]:
        """model id -> requests waiting, for every model of the catalog."""
        return {model_id: self._waiting.get(model_id, 0) for model_id in self._snapshot.models}

    def queue_depths_by_principal(self) -> Mapping[tuple[str, str], int]:
        """(model id, principal_ref) -> requests waiting, for the pairs that have any."""
        depths: dict[tuple[str, str], int] = {}
        for (model_id, _, _, _), queue in self._queues.items():
            for principal, waiting in queue.principals().items():
                key = (model_id, principal)
                depths[key] = depths.get(key, 0) + waiting
        return depths

    def queue_depths_by_class(self) -> Mapping[tuple[str, str], int]:
        """(model id, priority class) -> requests waiting, for the pairs that have any."""
        depths: dict[tuple[str, str], int] = {}
        for (model_id, _, _, _), queue in self._queues.items():
            for band in queue.bands.values():
                for fifo in band.by_principal.values():
                    for waiter in fifo.values():
                        key = (model_id, waiter.priority.class_name)
                        depths[key] = depths.get(key, 0) + 1
        return depths

    def saturated(self, model_id: str, side: Side = STABLE) -> bool:
        """True when a sheddable request for the model would be shed now (`_saturated`)."""
        pool_model = self.model_view(model_id, side)
        return pool_model is not None and self._saturated(pool_model)

    def retry_after(self, model_id: str) -> float:
        """Seconds until a slot of the model is likely free for one more request: the requests
        waiting for it, and one more, at the rate its runs ended lately."""
        drain = self._drains.get(model_id)
        rate = drain.rate(time.monotonic()) if drain is not None else None
        if rate is None:
            return RETRY_AFTER_S
        return _bounded_wait((self._waiting.get(model_id, 0) + 1) / rate)

    def _shed_retry_after(self, model_id: str) -> float:
        """A shed request's Retry-After: its turn among the sheddable requests, those waiting
        and those told to come back before it (not yet due), at the rate the model's sheddable
        runs ended lately (its runs' rate when none did), so that the shed requests that honour
        it come back about as fast as their class is served rather than all at once."""
        now = time.monotonic()
        promised = self._promised.get(model_id)
        if promised is None:
            promised = self._promised[model_id] = deque()
        while promised and promised[0] <= now:
            promised.popleft()
        drain = self._shed_drains.get(model_id)
        rate = drain.rate(now) if drain is not None else None
        if rate is None:
            drain = self._drains.get(model_id)
            rate = drain.rate(now) if drain is not None else None
        if rate is None:
            return RETRY_AFTER_S
        waiting = sum(
            queue.bands[level].size
            for (queued, _, _, _), queue in self._queues.items()
            if queued == model_id
            for level in queue.levels
            if level < 0
        )
        wait = _bounded_wait((waiting + len(promised) + 1) / rate)
        promised.append(now + wait)
        return wait

    @property
    def waiting(self) -> int:
        return self._waiting_total

    def decisions(self) -> Mapping[tuple[str, str, str], int]:
        """(model, policy, reason) -> choices made since start (`choosing.py` has the reasons)."""
        return self._chooser.decisions

    def load(self, provider_id: str) -> int:
        """The provider's load as `least_load` reads it (`choosing.py`)."""
        return self._chooser.load(provider_id, self.in_flight(provider_id))

    def reported_load(self, provider_id: str) -> ProviderLoad | None:
        """What the provider's Node last reported of its load."""
        return self._chooser.loads.get(provider_id)

    def prefix_homes(self, model_id: str) -> int:
        """Prefix points `prefix_affinity` remembers for the model."""
        return self._chooser.prefix_homes(model_id)

    # -- internals ------------------------------------------------------------------------------

    def _add_slots(self, snapshot: PoolSnapshot) -> None:
        for provider_id in snapshot.providers:
            if provider_id not in self._slots:
                self._slots[provider_id] = _Slots()

    def _route(self, model_id: str, long: bool, stable_view: bool = False) -> PoolModel:
        split = self._split
        if stable_view and split is not None:
            pool_model = split.stable.models.get(model_id)
        else:
            pool_model = self._snapshot.models.get(model_id)
        if pool_model is None:
            raise ModelNotFound(model_id)
        if not pool_model.candidates:
            raise NoProvider(f"No enabled provider serves model `{model_id}` now.")
        if long and not pool_model.takes_long:
            raise NoProvider(
                f"No enabled provider of model `{model_id}` takes long-context requests "
                f"(estimated input tokens >= {self._snapshot.long_context_threshold_tokens})."
            )
        return pool_model

    def _others_available(self, pool_model: PoolModel, long: bool, avoid: frozenset[str]) -> bool:
        available = self._available
        for candidate in pool_model.candidates:
            limits = candidate.provider
            if (
                limits.id in available
                and limits.id not in avoid
                and (not long or limits.takes_long)
            ):
                return True
        return False

    def _swap_here(self, pool_model: PoolModel, provider_id: str) -> bool:
        """A request of the adapter `pool_model` would wait for a swap at `provider_id`, while
        another available candidate of it, busy, has the adapter loaded or room for it."""
        adapter = pool_model.adapter
        assert adapter is not None
        chooser, all_slots = self._chooser, self._slots
        if chooser.adapter_tier(adapter, provider_id, all_slots[provider_id]) < 3:
            return False
        return any(
            c.provider.id != provider_id
            and c.provider.id in self._available
            and all_slots[c.provider.id].in_flight > 0
            and chooser.adapter_tier(adapter, c.provider.id, all_slots[c.provider.id]) < 3
            for c in pool_model.candidates
        )

    def _server_full(self, provider_id: str) -> bool:
        """The provider's server reports a queue of its own (`saturation.server_waiting`)."""
        threshold = self._snapshot.priorities.server_waiting
        return threshold is not None and self._chooser.server_waiting(provider_id) >= threshold

    def _saturated(self, pool_model: PoolModel) -> bool:
        """The model's demand is past what its providers serve now: requests wait for it at
        this Edge (`saturation.queue_depth` of them, any class), or every available candidate's
        server reports a queue of its own (`saturation.server_waiting`)."""
        priorities = self._snapshot.priorities
        if self._waiting.get(pool_model.id, 0) >= priorities.queue_depth:
            return True
        if priorities.server_waiting is None:
            return False
        available = [
            c.provider.id for c in pool_model.candidates if c.provider.id in self._available
        ]
        return bool(available) and all(self._server_full(pid) for pid in available)

    def _select(
        self,
        pool_model: PoolModel,
        long: bool,
        avoid: frozenset[str] = frozenset(),
        prefix: PrefixKey | None = None,
        home: str = "",
    ) -> tuple[Candidate, int] | None:
        """The candidate that takes the request now (counted as chosen) and the prompt bytes it
        is expected to prefill (`Lease.prefill`), or None; only `home` when one is given."""
        if home:
            return self._at_home(pool_model, long, home)
        if pool_model.dispatch.policy != ROUND_ROBIN or pool_model.base_model is not None:
            return self._choose(pool_model, long, avoid, prefix)
        available = self._available
        all_slots = self._slots
        best: Candidate | None = None
        best_used = 0
        best_priority = 0
        for candidate in pool_model.candidates:
            limits = candidate.provider
            if best is not None and limits.priority != best_priority:
                break  # candidates are sorted by priority: a free one was found above
            if limits.id not in available or (avoid and limits.id in avoid):
                continue
            slots = all_slots[limits.id]
            if not _has_room(limits, slots, long):
                continue
            if best is None or slots.last_used < best_used:
                best, best_used, best_priority = candidate, slots.last_used, limits.priority
        if best is None:
            return None
        self._chooser.count(pool_model.id, ROUND_ROBIN, ROUND_ROBIN)
        return best, 0

    def _at_home(
        self, pool_model: PoolModel, long: bool, home: str
    ) -> tuple[Candidate, int] | None:
        """`home`, the one candidate a request may run on, when it can take it now."""
        if home not in self._available:
            return None
        for candidate in pool_model.candidates:
            limits = candidate.provider
            if limits.id == home:
                if (long and not limits.takes_long) or not _has_room(
                    limits, self._slots[home], long
                ):
                    return None
                self._chooser.count(pool_model.id, pool_model.dispatch.policy, HOME)
                return candidate, 0
        return None

    def _choose(
        self,
        pool_model: PoolModel,
        long: bool,
        avoid: frozenset[str],
        prefix: PrefixKey | None,
    ) -> tuple[Candidate, int] | None:
        """`_select` for the policies of `choosing.py`: the same filter and priority, then the
        policy picks among the free candidates of the best priority."""
        available = self._available
        all_slots = self._slots
        group: list[Candidate] = []
        free: list[Candidate] = []
        priority: int | None = None
        for candidate in pool_model.candidates:
            limits = candidate.provider
            if limits.priority != priority:
                if free:
                    break  # candidates are sorted by priority: this level has a free one
                group = []
                priority = limits.priority
            if limits.id not in available or (avoid and limits.id in avoid):
                continue
            if long and not limits.takes_long:
                continue
            group.append(candidate)
            if _has_room(limits, all_slots[limits.id], long):
                free.append(candidate)
        if not free:
            return None
        adapter = pool_model.adapter
        if adapter is not None and self._chooser.only_swaps(adapter, group, free, all_slots):
            return None  # it waits for a slot of a server that holds its adapter, or has room
        return self._chooser.choose(pool_model, group, free, prefix, all_slots)

    def _take(
        self,
        pool_model: PoolModel,
        candidate: Candidate,
        prefill: int,
        long: bool,
        deadline: float,
        waited_s: float = 0.0,
        sheddable: bool = False,
    ) -> Lease:
        limits = candidate.provider
        slots = self._slots[limits.id]
        slots.in_flight += 1
        slots.prefill += prefill
        if long:
            slots.long_in_flight += 1
        if pool_model.base_model is not None:
            slots.sent(pool_model.id)
        self._stamp += 1
        slots.last_used = self._stamp
        return Lease(
            provider_id=limits.id,
            node_id=limits.node_id,
            served_model=candidate.served_model,
            long=long,
            pool_model=pool_model,
            snapshot=self._snapshot,
            deadline=deadline,
            waited_s=waited_s,
            prefill=prefill,
            sheddable=sheddable,
        )

    def _wait_s(self, pool_model: PoolModel, priority: Priority) -> tuple[float, bool]:
        """How long a request may wait for the model, and whether its class or its own bound
        (rather than its providers' queue timeout) says so."""
        bound = priority.max_wait_s
        if bound is not None and bound < pool_model.queue_timeout_s:
            return bound, True
        return pool_model.queue_timeout_s, False

    def _shed(self, model_id: str, priority: Priority) -> Shed:
        return Shed(
            f"Model `{model_id}` is saturated and requests of class `{priority.class_name}` "
            f"(priority {priority.level}, sheddable) are not queued; retry later.",
            self._shed_retry_after(model_id),
        )

    def _displace(self, model_id: str, pool_model: PoolModel, priority: Priority) -> None:
        """Make room in the model's full queue for a request of `priority`: the latest waiter
        of the lowest priority below it leaves with `Displaced`; with none, `QueueFull`."""
        victim: _Waiter | None = None
        for (queued_model, _, _, _), queue in self._queues.items():
            if queued_model != model_id:
                continue
            lowest = queue.lowest()
            if lowest is not None and (
                victim is None
                or (lowest.priority.level, -lowest.seq) < (victim.priority.level, -victim.seq)
            ):
                victim = lowest
        if victim is None or victim.priority.level >= priority.level:
            self.classes.refuse(priority, QUEUE_FULL)
            raise QueueFull(
                f"Too many requests are waiting for model `{model_id}` "
                f"(queue bound {pool_model.queue_bound}); retry later.",
                RETRY_AFTER_S,
            )
        self.classes.refuse(victim.priority, DISPLACED)
        self._fail(
            victim,
            Displaced(
                f"Model `{model_id}`'s queue is full and a request of a higher priority class "
                f"took this one's place (class `{victim.priority.class_name}`, priority "
                f"{victim.priority.level}); it had not started. Retry later.",
                self.retry_after(model_id),
            ),
        )

    def _enqueue(self, waiter: _Waiter) -> None:
        model_id = waiter.model_id
        level = waiter.priority.level
        finishes = self._finish.setdefault(model_id, {})
        finish = finishes.get(level)
        if finish is None:
            finish = finishes[level] = {}
        virtual = self._virtual.get(model_id)
        start = max(virtual.get(level, 0.0) if virtual else 0.0, finish.get(waiter.principal, 0.0))
        weight = self._snapshot.principal_weights.get(waiter.principal, 1)
        finish[waiter.principal] = start + 1.0 / weight
        waiter.tag = start
        key = (model_id, waiter.long, waiter.stable_view, waiter.home)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = FairQueue[_Waiter]()
        queue.push(waiter)
        self._waiting[model_id] = self._waiting.get(model_id, 0) + 1
        self._waiting_total += 1

    def _dequeue(self, waiter: _Waiter) -> bool:
        """Take `waiter` out of its queue; False when it was not queued any more."""
        model_id = waiter.model_id
        key = (model_id, waiter.long, waiter.stable_view, waiter.home)
        queue = self._queues.get(key)
        if queue is None or not queue.remove(waiter):
            return False
        if not queue.size:
            del self._queues[key]
        remaining = self._waiting[model_id] - 1
        if remaining:
            self._waiting[model_id] = remaining
        else:
            del self._waiting[model_id]
            # Idle: the clocks start again from zero for the next backlog.
            self._virtual.pop(model_id, None)
            self._finish.pop(model_id, None)
        self._waiting_total -= 1
        if waiter.timer is not None:
            waiter.timer.cancel()
        return True

    def _grant(
        self, waiter: _Waiter, pool_model: PoolModel, candidate: Candidate, prefill: int = 0
    ) -> None:
        model_id = waiter.model_id
        level = waiter.priority.level
        virtual = self._virtual.setdefault(model_id, {})
        if waiter.tag > virtual.get(level, 0.0):
            virtual[level] = waiter.tag
        self._dequeue(waiter)
        if waiter.future.done():
            return  # cancelled; its task has not resumed yet to abandon it
        waited = time.perf_counter() - waiter.enqueued_at
        if waiter.first:
            self.classes.admit(waiter.priority, waited)
        waiter.future.set_result(
            self._take(
                pool_model,
                candidate,
                prefill,
                waiter.long,
                waiter.deadline,
                waited,
                waiter.priority.sheddable,
            )
        )

    def _fail(self, waiter: _Waiter, error: Exception) -> None:
        self._dequeue(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(error)

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        priority = waiter.priority
        if not waiter.by_priority:
            if waiter.first:
                self.classes.refuse(priority, QUEUE_TIMEOUT)
            self._fail(waiter, self._timeout(waiter.model_id))
            return
        own = priority.wait_source.startswith("the request's")
        self.classes.refuse(priority, REQUEST_WAIT if own else CLASS_WAIT)
        self._fail(
            waiter,
            QueueDeadline(
                f"No provider of model `{waiter.model_id}` became free within "
                f"{priority.wait_source}; the request left the queue before reaching a server."
            ),
        )

    def _timeout(self, model_id: str) -> QueueTimeout:
        return QueueTimeout(
            f"No provider of model `{model_id}` became free within the queue timeout; retry later.",
            RETRY_AFTER_S,
        )

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiting request was cancelled (its client left): leave no slot or entry behind."""
        self._dequeue(waiter)
        future = waiter.future
        if future.done() and not future.cancelled():
            if future.exception() is None:
                self.release(future.result())  # granted just before the cancellation landed

    def _freed_pairs(self, provider_id: str) -> _Freed:
        """What a freed slot of `provider_id` can serve: the models it is an enabled candidate
        of, in the snapshot's view, and in the stable one's for the models shared by a split."""
        pairs = self._freed.get(provider_id)
        if pairs is None:
            pairs = tuple(
                (False, pool_model, candidate)
                for pool_model, candidate in self._snapshot.models_by_provider.get(provider_id, ())
            )
            split = self._split
            if split is not None:
                pairs += tuple(
                    (True, pool_model, candidate)
                    for pool_model, candidate in split.stable.models_by_provider.get(
                        provider_id, ()
                    )
                    if pool_model.id in split.shared
                )
            self._freed[provider_id] = pairs
        return pairs

    def _serve_freed(self, provider_id: str) -> None:
        """Give free slots of `provider_id` to the waiting requests it can serve: the highest
        priority first, the oldest of it first."""
        if provider_id not in self._available:
            return
        pairs = self._freed_pairs(provider_id)
        slots = self._slots.get(provider_id)
        if not pairs or slots is None:
            return
        while self._waiting_total:
            if slots.cool_until and slots.cool_until > time.monotonic():
                return
            oldest: _Waiter | None = None
            chosen: tuple[PoolModel, Candidate] | None = None
            for stable_view, pool_model, candidate in pairs:
                limits = candidate.provider
                if slots.in_flight >= limits.capacity:
                    continue
                long_ok = (
                    limits.long_context_slots is None
                    or slots.long_in_flight < limits.long_context_slots
                )
                for long in (False, True) if long_ok else (False,):
                    for home in ("", provider_id):
                        queue = self._queues.get((pool_model.id, long, stable_view, home))
                        head = queue.head() if queue is not None else None
                        if (
                            head is not None
                            and (
                                oldest is None
                                or (-head.priority.level, head.seq)
                                < (-oldest.priority.level, oldest.seq)
                            )
                            # An adapter's requests wait for a server that holds it, not a swap.
                            and (
                                pool_model.adapter is None
                                or not self._swap_here(pool_model, provider_id)
                            )
                        ):
                            oldest, chosen = head, (pool_model, candidate)
            if oldest is None or chosen is None:
                return
            pool_model = chosen[0]
            prefill = 0
            if not oldest.future.done():
                policy = pool_model.dispatch.policy
                self._chooser.count(pool_model.id, policy, HOME if oldest.home else FREED_SLOT)
                if oldest.prefix is not None and policy == PREFIX_AFFINITY:
                    prefill = self._chooser.prefill(pool_model.id, oldest.prefix, provider_id)
                    self._chooser.remember(pool_model.id, oldest.prefix, provider_id)
            self._grant(oldest, *chosen, prefill)

    def _reevaluate(self) -> None:
        """Try every waiting request again (after a swap or a health change): the highest
        priority first; within one, the queues in the order of their oldest waiter, each in its
        fair order."""
        if not self._waiting_total:
            return
        bands = sorted(
            (
                (level, waiters)
                for queue in self._queues.values()
                for level, waiters in queue.in_bands()
            ),
            key=lambda band: (-band[0], min(waiter.seq for waiter in band[1])),
        )
        for waiter in (waiter for _, waiters in bands for waiter in waiters):
            if waiter.future.done():
                continue  # cancelled: its task takes it out of the queue when it resumes
            try:
                pool_model = self._route(waiter.model_id, waiter.long, waiter.stable_view)
            except (ModelNotFound, NoProvider) as error:
                self._fail(waiter, error)  # the new config no longer serves this request
                continue
            avoid = waiter.avoid
            if avoid and not self._others_available(pool_model, waiter.long, avoid):
                avoid = frozenset()
            chosen = self._select(pool_model, waiter.long, avoid, waiter.prefix, waiter.home)
            if chosen is not None:
                self._grant(waiter, pool_model, *chosen)

    def _cooled_down(self, provider_id: str) -> None:
        now = asyncio.get_running_loop().time()
        self._timers = {timer for timer in self._timers if timer.when() > now}
        # The timer ends the cool-down it was armed for: the loop's clock (uvloop's is libuv's,
        # in milliseconds) may fire it a hair before time.monotonic() gets there, and requests
        # re-evaluated then would find the provider still cooling and wait for an event that
        # may never come (nothing in flight to free a slot) until their queue timeout.
        slots = self._slots.get(provider_id)
        if slots is not None and slots.cool_until - time.monotonic() < _TIMER_SLACK_S:
            slots.cool_until = 0.0
        if self._waiting_total:
            self._reevaluate()
