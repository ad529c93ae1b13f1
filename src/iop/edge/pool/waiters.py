"""The dispatcher's waiting requests: its queues, fair queuing's clocks, and how a wait ends.

A `Waiter` is one request waiting for a slot. `Waiters` holds them all, a `FairQueue` (`queues.py`)
per (model, long, view, home), stamps each with its virtual start tag as it joins (start-time
fair queuing, per model and priority level, weighted by principal), counts them per model, and
fails one that leaves without a slot: its wait bound passed (`QueueTimeout`, `QueueDeadline`) or
the dispatcher displaced it (`dispatching.py`, which also decides which waiter a freed slot
serves).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from typing import Final

from ..errors import QueueDeadline, QueueTimeout
from .choosing import PrefixKey
from .priorities import (
    CLASS_WAIT,
    DEFAULT_PRIORITY,
    QUEUE_TIMEOUT,
    REQUEST_WAIT,
    ClassTally,
    Priority,
)
from .queues import FairQueue
from .slots import Lease

#: A queue: (model id, long, on the stable revision's view of a model on trial, the one provider
#: its requests must run on, or "": any).
QueueKey = tuple[str, bool, bool, str]

#: The Retry-After the Edge suggests with a 429 (queue full) or a 503 (queue timeout).
RETRY_AFTER_S: Final = 1.0


class Waiter:
    """A request waiting for a slot in its model's queue, until its future holds a lease."""

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
        "passed",
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
        #: Times a freed slot went to a request behind it whose prefix is cached there.
        self.passed = 0
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


def queue_timeout(model_id: str) -> QueueTimeout:
    """The error of a request whose providers' queue timeout passed before it had a slot."""
    return QueueTimeout(
        f"No provider of model `{model_id}` became free within the queue timeout; retry later.",
        RETRY_AFTER_S,
    )


class Waiters:
    """Every waiting request of one dispatcher, in its queues, in fair order."""

    def __init__(self, classes: ClassTally) -> None:
        #: What each priority class's requests came to (the dispatcher's `classes`).
        self.classes = classes
        #: Waiting requests by (model, long, stable view, home), in fair order.
        self.queues: dict[QueueKey, FairQueue[Waiter]] = {}
        #: Requests waiting per model (models with none left out), and in all.
        self.by_model: dict[str, int] = {}
        self.total = 0
        # Fair queuing's clocks, per model and priority while the model has waiters: the
        # virtual time, and each principal's last finish tag (forgotten when its queue empties).
        self._virtual: dict[str, dict[int, float]] = {}
        self._finish: dict[str, dict[int, dict[str, float]]] = {}

    def enqueue(self, waiter: Waiter, weights: Mapping[str, int]) -> None:
        """Queue `waiter` behind its principal's earlier requests, by `weights` (principal_ref
        -> its weight, 1 when absent) among the other principals of its priority."""
        model_id = waiter.model_id
        level = waiter.priority.level
        finishes = self._finish.setdefault(model_id, {})
        finish = finishes.get(level)
        if finish is None:
            finish = finishes[level] = {}
        virtual = self._virtual.get(model_id)
        start = max(virtual.get(level, 0.0) if virtual else 0.0, finish.get(waiter.principal, 0.0))
        weight = weights.get(waiter.principal, 1)
        finish[waiter.principal] = start + 1.0 / weight
        waiter.tag = start
        key = (model_id, waiter.long, waiter.stable_view, waiter.home)
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = FairQueue[Waiter]()
        queue.push(waiter)
        self.by_model[model_id] = self.by_model.get(model_id, 0) + 1
        self.total += 1

    def dequeue(self, waiter: Waiter, served: bool = False) -> bool:
        """Take `waiter` out of its queue; False when it was not queued any more. `served`: it
        leaves with a slot, and its model's virtual time moves up to its tag first."""
        model_id = waiter.model_id
        if served:
            level = waiter.priority.level
            virtual = self._virtual.setdefault(model_id, {})
            if waiter.tag > virtual.get(level, 0.0):
                virtual[level] = waiter.tag
        key = (model_id, waiter.long, waiter.stable_view, waiter.home)
        queue = self.queues.get(key)
        if queue is None or not queue.remove(waiter):
            return False
        if not queue.size:
            del self.queues[key]
        remaining = self.by_model[model_id] - 1
        if remaining:
            self.by_model[model_id] = remaining
        else:
            del self.by_model[model_id]
            # Idle: the clocks start again from zero for the next backlog.
            self._virtual.pop(model_id, None)
            self._finish.pop(model_id, None)
        self.total -= 1
        if waiter.timer is not None:
            waiter.timer.cancel()
        return True

    def fail(self, waiter: Waiter, error: Exception) -> None:
        """`waiter` leaves its queue with `error`, unless its wait ended already."""
        self.dequeue(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(error)

    def expire(self, waiter: Waiter) -> None:
        """`waiter`'s deadline passed (its timer): it leaves with its bound's error."""
        if waiter.future.done():
            return
        priority = waiter.priority
        if not waiter.by_priority:
            if waiter.first:
                self.classes.refuse(priority, QUEUE_TIMEOUT)
            self.fail(waiter, queue_timeout(waiter.model_id))
            return
        own = priority.wait_source.startswith("the request's")
        self.classes.refuse(priority, REQUEST_WAIT if own else CLASS_WAIT)
        self.fail(
            waiter,
            QueueDeadline(
                f"No provider of model `{waiter.model_id}` became free within "
                f"{priority.wait_source}; the request left the queue before reaching a server."
            ),
        )

    def lowest(self, model_id: str) -> Waiter | None:
        """The model's latest waiter of its lowest priority: the first to give its place up."""
        victim: Waiter | None = None
        for (queued_model, _, _, _), queue in self.queues.items():
            if queued_model != model_id:
                continue
            lowest = queue.lowest()
            if lowest is not None and (
                victim is None
                or (lowest.priority.level, -lowest.seq) < (victim.priority.level, -victim.seq)
            ):
                victim = lowest
        return victim

    def sheddable(self, model_id: str) -> int:
        """The model's waiters of sheddable classes (a priority below 0)."""
        return sum(
            queue.bands[level].size
            for (queued, _, _, _), queue in self.queues.items()
            if queued == model_id
            for level in queue.levels
            if level < 0
        )

    def unsplit(self, shared: frozenset[str]) -> None:
        """The stable view's waiters of models not in `shared` (any more) move to the queues of
        the snapshot's view, in their order."""
        for key in [key for key in self.queues if key[2] and key[0] not in shared]:
            queue = self.queues.pop(key)
            into_key = (key[0], key[1], False, key[3])
            into = self.queues.get(into_key)
            if into is None:
                into = self.queues[into_key] = FairQueue[Waiter]()
            for waiter in queue.in_order():
                waiter.stable_view = False
                into.push(waiter)

    def in_order(self) -> Iterator[Waiter]:
        """Every waiter, to be tried again: the highest priority first; within one, the queues
        in the order of their oldest waiter, each in its fair order."""
        bands = sorted(
            (
                (level, waiters)
                for queue in self.queues.values()
                for level, waiters in queue.in_bands()
            ),
            key=lambda band: (-band[0], min(waiter.seq for waiter in band[1])),
        )
        return (waiter for _, waiters in bands for waiter in waiters)

    def depths_by_principal(self) -> Mapping[tuple[str, str], int]:
        """(model id, principal_ref) -> requests waiting, for the pairs that have any."""
        depths: dict[tuple[str, str], int] = {}
        for (model_id, _, _, _), queue in self.queues.items():
            for principal, waiting in queue.principals().items():
                key = (model_id, principal)
                depths[key] = depths.get(key, 0) + waiting
        return depths

    def depths_by_class(self) -> Mapping[tuple[str, str], int]:
        """(model id, priority class) -> requests waiting, for the pairs that have any."""
        depths: dict[tuple[str, str], int] = {}
        for (model_id, _, _, _), queue in self.queues.items():
            for band in queue.bands.values():
                for fifo in band.by_principal.values():
                    for waiter in fifo.values():
                        key = (model_id, waiter.priority.class_name)
                        depths[key] = depths.get(key, 0) + 1
        return depths
