"""Dispatch: which provider runs a request now, and which request a freed slot serves next.

`Dispatcher` keeps the rules docs/edge.md, "Dispatch", gives operators: candidates, capacity and
long slots, the lowest priority, then the model's policy among equals (`selecting.py`, then
`choosing.py`; for a LoRA adapter's request, after the servers most ready for its adapter, and a
wait at the Edge rather than a swap while a server that holds it is busy: docs/edge.md, "LoRA
adapters"); a bounded queue per model (`waiters.py`), in strict order of the requests' priority
classes (`priorities.py`: a higher class always first, a sheddable one refused at a saturated
model rather than queued, the lowest class's latest request displaced from a full queue by a
higher one, each class's wait bounded) and fair between principals by weight within a class; a
freed slot given at once to the waiting request its provider can serve first; `provider_busy`
cool-downs (`BUSY_COOLDOWN_S`); the providers a retry `avoid`s (`relaying.py`); `swap(snapshot)`,
one reference assignment, under which leases keep their snapshot and slot counters (per provider
id, `slots.py`) carry over. While a change is on trial (`splits.py`) a request of a model it
shares runs on the candidate's view of the model or on the stable one's, as its side says; each
view has a queue of its own.

Everything runs on one event loop and nothing here awaits except a waiting request, so the state
needs no lock. A dispatch that finds a free candidate costs O(candidates of the model).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from iop.edgeconfig import ANONYMOUS_PRINCIPAL

from ..errors import Displaced, ModelNotFound, NoProvider, QueueFull, Shed
from ..hub import ProviderLoad
from .choosing import FREED_SLOT, FREED_SLOT_HOME, HOME, PREFIX_AFFINITY, PrefixKey
from .priorities import (
    DEFAULT_PRIORITY,
    DISPLACED,
    QUEUE_FULL,
    SATURATED,
    ClassTally,
    Priority,
)
from .selecting import Selector
from .slots import Drain, Lease
from .snapshots import Candidate, PoolModel, PoolSnapshot
from .splits import STABLE, Side, Split
from .waiters import RETRY_AFTER_S, Waiter, Waiters, queue_timeout

#: How long a provider that refused a run as busy is left out of dispatch.
BUSY_COOLDOWN_S: Final = 0.05
#: How early an event loop's timer may fire against time.monotonic() (a clock tick, and then some).
_TIMER_SLACK_S: Final = 0.005
#: prefix_affinity: the waiters of each principal a freed slot looks at for one whose prefix
#: is cached on its server, when the fair head's is not; and how often one head is passed so.
CACHED_LOOKAHEAD: Final = 8
MAX_PASSED: Final = 4
#: A shed request told when to come back is queued even at a saturated model when it does:
#: from `PROMISE_EARLY_S` before that time until as long after it again (at least
#: `PROMISE_GRACE_S`); the promises kept at most (the oldest forgotten first).
PROMISE_EARLY_S: Final = 0.05
PROMISE_GRACE_S: Final = 1.0
MAX_PROMISES: Final = 65_536
#: The bounds of the Retry-After estimated from a model's queue (a shed or displaced request).
_RETRY_AFTER_MIN_S: Final = 0.05
_RETRY_AFTER_MAX_S: Final = 60.0


def _bounded_wait(seconds: float) -> float:
    return min(_RETRY_AFTER_MAX_S, max(_RETRY_AFTER_MIN_S, seconds))


class Dispatcher:
    """The provider pool's live state over an immutable snapshot."""

    def __init__(self, snapshot: PoolSnapshot) -> None:
        #: The snapshot, the split, the available providers and their slots (`selecting.py`).
        self._selector = Selector(snapshot)
        #: What each priority class's requests came to (`priorities.py`).
        self.classes = ClassTally()
        #: The waiting requests, in their queues (`waiters.py`).
        self._waiters = Waiters(self.classes)
        # How fast each model's slots free, for all its runs and for its sheddable ones, and
        # when the shed requests were told to come back (not yet due): what a shed or
        # displaced request's Retry-After is estimated from.
        self._drains: dict[str, Drain] = {}
        self._shed_drains: dict[str, Drain] = {}
        self._promised: dict[str, deque[float]] = {}
        #: Each shed request's identity -> when its coming back is honoured (loop time):
        #: (from, until).
        self._promises: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self._seq = 0
        self._timers: set[asyncio.TimerHandle] = set()

    # -- the snapshot and the set of available providers ---------------------------------------

    @property
    def snapshot(self) -> PoolSnapshot:
        return self._selector.snapshot

    @property
    def split(self) -> Split | None:
        """The change on trial, if any (`splits.py`)."""
        return self._selector.split

    def swap(self, snapshot: PoolSnapshot, split: Split | None = None) -> None:
        """Dispatch on `snapshot` from now on, with `split` the stable revision's share of the
        models on trial (None: `snapshot` serves everything); waiting requests are re-evaluated
        at once."""
        selector = self._selector
        selector.add_slots(snapshot)
        if split is not None:
            selector.add_slots(split.stable)
        selector.snapshot = snapshot
        self._set_split(split)
        selector.drop_idle_slots()
        selector.chooser.keep_only(
            {
                model_id: pool_model.dispatch.policy
                for model_id, pool_model in snapshot.models.items()
            }
        )
        self._reevaluate()

    def set_share(self, share: int) -> None:
        """The candidate's share of the shared models' requests from now on (in percent)."""
        selector = self._selector
        if selector.split is not None:
            selector.split = selector.split.with_share(share)

    def end_split(self) -> None:
        """The change on trial serves everything now (promoted): the stable view's waiters move
        to the candidate's queues, in their order."""
        self._set_split(None)
        self._selector.drop_idle_slots()
        self._reevaluate()

    def _set_split(self, split: Split | None) -> None:
        self._selector.set_split(split)
        self._waiters.unsplit(split.shared if split is not None else frozenset())

    def model_view(self, model_id: str, side: Side = STABLE) -> PoolModel | None:
        """The model as a request of `side` sees it (`splits.py`), or None."""
        selector = self._selector
        split = selector.split
        if split is not None and side == STABLE and model_id in split.shared:
            return split.stable.models.get(model_id)
        return selector.snapshot.models.get(model_id)

    def _stable_view(self, model_id: str, side: Side) -> bool:
        split = self._selector.split
        return split is not None and side == STABLE and model_id in split.shared

    def set_available(self, provider_ids: Iterable[str]) -> None:
        """The providers of connected nodes that are healthy now (the hub's view)."""
        available = frozenset(provider_ids)
        if available != self._selector.available:
            self._selector.available = available
            self._reevaluate()

    @property
    def available(self) -> frozenset[str]:
        return self._selector.available

    def watch_loads(self, loads: Mapping[str, ProviderLoad]) -> None:
        """Read providers' reported loads from `loads` (the hub's live view) from now on."""
        self._selector.chooser.loads = loads

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
        selector = self._selector
        pool_model = selector.route(model_id, long, self._stable_view(model_id, side))
        if priority.sheddable and self._saturated(pool_model):
            return None
        chosen = selector.select(pool_model, long, prefix=prefix, home=home)
        if chosen is None:
            return None
        self.classes.admit(priority)
        loop_time = asyncio.get_running_loop().time()
        deadline = loop_time + self._wait_s(pool_model, priority)[0]
        return selector.take(pool_model, *chosen, long, deadline, sheddable=priority.sheddable)

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
        promise: bytes = b"",
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
        `promise`: a sheddable request's identity (its principal and body): shed, it is told
        when to come back, and coming back then it is queued even if the model is still
        saturated (`_kept`).
        """
        selector = self._selector
        stable_view = self._stable_view(model_id, side)
        pool_model = selector.route(model_id, long, stable_view)
        loop = asyncio.get_running_loop()
        now = loop.time()
        if avoid and not selector.others_available(pool_model, long, avoid):
            avoid = frozenset()
        first = deadline is None
        if (
            first
            and priority.sheddable
            and self._saturated(pool_model)
            and not self._kept(promise, now, priority)
        ):
            self.classes.refuse(priority, SATURATED)
            shed = self._shed(model_id, priority)
            if promise:
                self._promise(promise, now, shed.retry_after_s)
            raise shed
        chosen = selector.select(pool_model, long, avoid, prefix, home)
        wait_s, by_priority = self._wait_s(pool_model, priority)
        if chosen is not None:
            if first:
                self.classes.admit(priority)
            return selector.take(
                pool_model,
                *chosen,
                long,
                now + wait_s if deadline is None else deadline,
                sheddable=priority.sheddable,
            )
        waiters = self._waiters
        if deadline is None:
            if waiters.by_model.get(model_id, 0) >= pool_model.queue_bound:
                self._displace(model_id, pool_model, priority)
            deadline = now + wait_s
        elif deadline <= now:
            raise queue_timeout(model_id)
        self._seq += 1
        waiter = Waiter(
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
        waiters.enqueue(waiter, selector.snapshot.principal_weights)
        waiter.timer = loop.call_at(deadline, waiters.expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise

    def release(self, lease: Lease) -> None:
        """Give the slot back (idempotent); the oldest request that can use it gets it."""
        slots = self._selector.give_back(lease)
        if slots is None:
            return
        model_id = lease.pool_model.id
        now = time.monotonic()
        drain = self._drains.get(model_id)
        if drain is None:
            drain = self._drains[model_id] = Drain()
        drain.ends.append(now)
        if lease.sheddable:
            drain = self._shed_drains.get(model_id)
            if drain is None:
                drain = self._shed_drains[model_id] = Drain()
            drain.ends.append(now)
        slots.cool_until = 0.0  # one of our runs ended there: the Node has room again
        if self._waiters.total:
            self._serve_freed(lease.provider_id)

    def started(self, lease: Lease) -> None:
        """The lease's run sent its first event: its prompt is prefilled and weighs no more in
        `prefix_affinity`'s choices."""
        if lease.prefill and not lease.released:
            self._selector.slots[lease.provider_id].prefill -= lease.prefill
            lease.prefill = 0

    def refuse(self, lease: Lease) -> None:
        """The Node refused the run as busy: give the slot back and cool the provider down."""
        slots = self._selector.give_back(lease)
        if slots is None:
            return
        slots.cool_until = time.monotonic() + BUSY_COOLDOWN_S
        loop = asyncio.get_running_loop()
        timer = loop.call_later(BUSY_COOLDOWN_S, self._cooled_down, lease.provider_id)
        self._timers.add(timer)

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
        return pool_model is not None and self._selector.others_available(pool_model, long, avoid)

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
        slots = self._selector.slots.get(provider_id)
        return slots.in_flight if slots is not None else 0

    def pending_prefill(self, provider_id: str) -> int:
        """Prompt bytes of this Edge's runs on the provider with no first event yet, as
        `prefix_affinity` weighs them (`Lease.prefill`)."""
        slots = self._selector.slots.get(provider_id)
        return slots.prefill if slots is not None else 0

    def adapter_runs(self, provider_id: str) -> tuple[Mapping[str, int], Sequence[str]]:
        """This Edge's runs on the provider by LoRA adapter, and the adapters it sent there
        lately (latest last)."""
        slots = self._selector.slots.get(provider_id)
        if slots is None:
            return {}, ()
        return dict(slots.adapters), tuple(slots.recent)

    def long_in_flight(self, provider_id: str) -> int:
        slots = self._selector.slots.get(provider_id)
        return slots.long_in_flight if slots is not None else 0

    def in_flight_counts(self) -> Mapping[str, tuple[int, int]]:
        """provider id -> (in flight, long in flight), for every provider the Edge knows."""
        return {pid: (s.in_flight, s.long_in_flight) for pid, s in self._selector.slots.items()}

    def queue_depth(self, model_id: str) -> int:
        return self._waiters.by_model.get(model_id, 0)

    def queue_depths(self) -> Mapping[str, int]:
        """model id -> requests waiting, for every model of the catalog."""
        waiting = self._waiters.by_model
        return {model_id: waiting.get(model_id, 0) for model_id in self._selector.snapshot.models}

    def queue_depths_by_principal(self) -> Mapping[tuple[str, str], int]:
        """(model id, principal_ref) -> requests waiting, for the pairs that have any."""
        return self._waiters.depths_by_principal()

    def queue_depths_by_class(self) -> Mapping[tuple[str, str], int]:
        """(model id, priority class) -> requests waiting, for the pairs that have any."""
        return self._waiters.depths_by_class()

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
        return _bounded_wait((self._waiters.by_model.get(model_id, 0) + 1) / rate)

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
        waiting = self._waiters.sheddable(model_id)
        wait = _bounded_wait((waiting + len(promised) + 1) / rate)
        promised.append(now + wait)
        return wait

    @property
    def waiting(self) -> int:
        return self._waiters.total

    def decisions(self) -> Mapping[tuple[str, str, str], int]:
        """(model, policy, reason) -> choices made since start (`choosing.py` has the reasons)."""
        return self._selector.chooser.decisions

    def load(self, provider_id: str) -> int:
        """The provider's load as `least_load` reads it (`choosing.py`)."""
        return self._selector.chooser.load(provider_id, self.in_flight(provider_id))

    def reported_load(self, provider_id: str) -> ProviderLoad | None:
        """What the provider's Node last reported of its load."""
        return self._selector.chooser.loads.get(provider_id)

    def prefix_homes(self, model_id: str) -> int:
        """Prefix points `prefix_affinity` remembers for the model."""
        return self._selector.chooser.prefix_homes(model_id)

    # -- internals ------------------------------------------------------------------------------

    def _server_full(self, provider_id: str) -> bool:
        """The provider's server reports a queue of its own (`saturation.server_waiting`)."""
        selector = self._selector
        threshold = selector.snapshot.priorities.server_waiting
        return threshold is not None and selector.chooser.server_waiting(provider_id) >= threshold

    def _saturated(self, pool_model: PoolModel) -> bool:
        """The model's demand is past what its providers serve now: requests wait for it at
        this Edge (`saturation.queue_depth` of them, any class), or every available candidate's
        server reports a queue of its own (`saturation.server_waiting`)."""
        selector = self._selector
        priorities = selector.snapshot.priorities
        if self._waiters.by_model.get(pool_model.id, 0) >= priorities.queue_depth:
            return True
        if priorities.server_waiting is None:
            return False
        available = [
            c.provider.id for c in pool_model.candidates if c.provider.id in selector.available
        ]
        return bool(available) and all(self._server_full(pid) for pid in available)

    def _wait_s(self, pool_model: PoolModel, priority: Priority) -> tuple[float, bool]:
        """How long a request may wait for the model, and whether its class or its own bound
        (rather than its providers' queue timeout) says so."""
        bound = priority.max_wait_s
        if bound is not None and bound < pool_model.queue_timeout_s:
            return bound, True
        return pool_model.queue_timeout_s, False

    def _promise(self, promise: bytes, now: float, retry_after_s: float) -> None:
        """Remember that the shed request `promise` was told to come back `retry_after_s`
        from `now` (loop time)."""
        promises = self._promises
        due = now + retry_after_s
        promises[promise] = (due - PROMISE_EARLY_S, due + max(PROMISE_GRACE_S, retry_after_s))
        promises.move_to_end(promise)
        while len(promises) > MAX_PROMISES:
            promises.popitem(last=False)

    def _kept(self, promise: bytes, now: float, priority: Priority) -> bool:
        """The request `promise` comes back when a 429 told it to: the promise is used up."""
        if not promise:
            return False
        window = self._promises.get(promise)
        if window is None or now < window[0]:
            return False  # never told, or early: shed again (and told anew)
        del self._promises[promise]
        if now > window[1]:
            return False
        self.classes.come_back(priority)
        return True

    def _shed(self, model_id: str, priority: Priority) -> Shed:
        return Shed(
            f"Model `{model_id}` is saturated and requests of class `{priority.class_name}` "
            f"(priority {priority.level}, sheddable) are not queued; retry later.",
            self._shed_retry_after(model_id),
        )

    def _displace(self, model_id: str, pool_model: PoolModel, priority: Priority) -> None:
        """Make room in the model's full queue for a request of `priority`: the latest waiter
        of the lowest priority below it leaves with `Displaced`; with none, `QueueFull`."""
        victim = self._waiters.lowest(model_id)
        if victim is None or victim.priority.level >= priority.level:
            self.classes.refuse(priority, QUEUE_FULL)
            raise QueueFull(
                f"Too many requests are waiting for model `{model_id}` "
                f"(queue bound {pool_model.queue_bound}); retry later.",
                RETRY_AFTER_S,
            )
        self.classes.refuse(victim.priority, DISPLACED)
        self._waiters.fail(
            victim,
            Displaced(
                f"Model `{model_id}`'s queue is full and a request of a higher priority class "
                f"took this one's place (class `{victim.priority.class_name}`, priority "
                f"{victim.priority.level}); it had not started. Retry later.",
                self.retry_after(model_id),
            ),
        )

    def _grant(
        self, waiter: Waiter, pool_model: PoolModel, candidate: Candidate, prefill: int = 0
    ) -> None:
        self._waiters.dequeue(waiter, served=True)
        if waiter.future.done():
            return  # cancelled; its task has not resumed yet to abandon it
        waited = time.perf_counter() - waiter.enqueued_at
        if waiter.first:
            self.classes.admit(waiter.priority, waited)
        waiter.future.set_result(
            self._selector.take(
                pool_model,
                candidate,
                prefill,
                waiter.long,
                waiter.deadline,
                waited,
                waiter.priority.sheddable,
            )
        )

    def _abandon(self, waiter: Waiter) -> None:
        """The waiting request was cancelled (its client left): leave no slot or entry behind."""
        self._waiters.dequeue(waiter)
        future = waiter.future
        if future.done() and not future.cancelled():
            if future.exception() is None:
                self.release(future.result())  # granted just before the cancellation landed

    def _serve_freed(self, provider_id: str) -> None:
        """Give free slots of `provider_id` to the waiting requests it can serve: the highest
        priority first, the oldest of it first."""
        selector = self._selector
        if provider_id not in selector.available:
            return
        pairs = selector.freed(provider_id)
        slots = selector.slots.get(provider_id)
        if not pairs or slots is None:
            return
        waiters = self._waiters
        queues = waiters.queues
        while waiters.total:
            if slots.cool_until and slots.cool_until > time.monotonic():
                return
            oldest: Waiter | None = None
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
                        queue = queues.get((pool_model.id, long, stable_view, home))
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
                                or not selector.swap_here(pool_model, provider_id)
                            )
                        ):
                            oldest, chosen = head, (pool_model, candidate)
            if oldest is None or chosen is None:
                return
            pool_model = chosen[0]
            prefill = 0
            if not oldest.future.done():
                policy = pool_model.dispatch.policy
                chooser = selector.chooser
                reason = HOME if oldest.home else FREED_SLOT
                if oldest.prefix is not None and policy == PREFIX_AFFINITY:
                    if not oldest.home:
                        cached = self._cached_here(oldest, provider_id)
                        if cached is not oldest:
                            oldest, reason = cached, FREED_SLOT_HOME
                    assert oldest.prefix is not None
                    prefill = chooser.prefill(pool_model.id, oldest.prefix, provider_id)
                    chooser.remember(pool_model.id, oldest.prefix, provider_id)
                chooser.count(pool_model.id, policy, reason)
            self._grant(oldest, *chosen, prefill)

    def _cached_here(self, head: Waiter, provider_id: str) -> Waiter:
        """The waiter a freed slot of `provider_id` serves in place of `head`, its queue's fair
        head (prefix_affinity): when `head`'s prompt is not known there, the waiter of the same
        queue and priority, among the first `CACHED_LOOKAHEAD` of each principal, whose prompt
        is known there the deepest; `head` itself when none is, or when it was passed
        `MAX_PASSED` times already. A queued request would otherwise take whichever server frees
        first and prefill its whole conversation again, while the next slot of its home serves
        another conversation's request anew."""
        assert head.prefix is not None
        chooser = self._selector.chooser
        model_id = head.model_id
        if head.passed >= MAX_PASSED:
            return head
        if chooser.prefill(model_id, head.prefix, provider_id) < head.prefix.size:
            return head  # its own prompt is known there
        queue = self._waiters.queues[(model_id, head.long, head.stable_view, "")]
        band = queue.bands[head.priority.level]
        best, deepest = head, 0
        for fifo in band.by_principal.values():
            for index, waiter in enumerate(fifo.values()):
                if index == CACHED_LOOKAHEAD:
                    break
                prefix = waiter.prefix
                if prefix is None or waiter.future.done():
                    continue
                known = prefix.size - chooser.prefill(model_id, prefix, provider_id)
                if known > deepest:
                    best, deepest = waiter, known
        if best is not head:
            head.passed += 1
        return best

    def _reevaluate(self) -> None:
        """Try every waiting request again (after a swap or a health change): the highest
        priority first; within one, the queues in the order of their oldest waiter, each in its
        fair order."""
        waiters = self._waiters
        if not waiters.total:
            return
        selector = self._selector
        for waiter in waiters.in_order():
            if waiter.future.done():
                continue  # cancelled: its task takes it out of the queue when it resumes
            try:
                pool_model = selector.route(waiter.model_id, waiter.long, waiter.stable_view)
            except (ModelNotFound, NoProvider) as error:
                waiters.fail(waiter, error)  # the new config no longer serves this request
                continue
            avoid = waiter.avoid
            if avoid and not selector.others_available(pool_model, waiter.long, avoid):
                avoid = frozenset()
            chosen = selector.select(pool_model, waiter.long, avoid, waiter.prefix, waiter.home)
            if chosen is not None:
                self._grant(waiter, pool_model, *chosen)

    def _cooled_down(self, provider_id: str) -> None:
        now = asyncio.get_running_loop().time()
        self._timers = {timer for timer in self._timers if timer.when() > now}
        # The timer ends the cool-down it was armed for: the loop's clock (uvloop's is libuv's,
        # in milliseconds) may fire it a hair before time.monotonic() gets there, and requests
        # re-evaluated then would find the provider still cooling and wait for an event that
        # may never come (nothing in flight to free a slot) until their queue timeout.
        slots = self._selector.slots.get(provider_id)
        if slots is not None and slots.cool_until - time.monotonic() < _TIMER_SLACK_S:
            slots.cool_until = 0.0
        if self._waiters.total:
            self._reevaluate()
