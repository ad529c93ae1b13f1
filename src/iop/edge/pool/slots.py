"""A provider's slots as the dispatcher counts them, and the lease a run holds on one.

`Slots` holds the mutable counters of one provider (runs in flight, long ones, prompt bytes not
yet prefilled, the LoRA adapters sent there lately, a busy cool-down), kept by provider id across
snapshots; `has_room` says whether it takes a request now. A `Lease` is one run's slot, given back
once. `Drain` remembers when a model's runs ended: the rate its slots free at, which a shed or
displaced request's Retry-After is estimated from (`dispatching.py`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from .snapshots import PoolModel, PoolSnapshot, ProviderLimits

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


class Drain:
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


class Slots:
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


def has_room(limits: ProviderLimits, slots: Slots, long: bool) -> bool:
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
