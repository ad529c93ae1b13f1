"""A model's waiting requests: strict order between priority classes, fair share between
principals within one (docs/edge.md, "Dispatch" and "Priority classes").

`FairQueue` holds the waiters of one queue of the dispatcher (`waiters.py`) by priority level,
each level a `Band`: FIFO per principal, the principals in the order of their virtual start tags
(start-time fair queuing; `Waiters` keeps the clocks and stamps each waiter's `tag`).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from .priorities import Priority


class Queued(Protocol):
    """What a queue needs of a waiting request."""

    @property
    def priority(self) -> Priority: ...

    @property
    def principal(self) -> str: ...

    @property
    def seq(self) -> int: ...

    @property
    def order(self) -> tuple[float, int]: ...


W = TypeVar("W", bound=Queued)


class Band(Generic[W]):
    """The waiters of one priority in a queue: FIFO per principal, principals in tag order."""

    __slots__ = ("by_principal", "size")

    def __init__(self) -> None:
        self.by_principal: dict[str, OrderedDict[int, W]] = {}
        self.size = 0

    def push(self, waiter: W) -> None:
        fifo = self.by_principal.get(waiter.principal)
        if fifo is None:
            fifo = self.by_principal[waiter.principal] = OrderedDict()
        fifo[waiter.seq] = waiter
        self.size += 1

    def remove(self, waiter: W) -> bool:
        fifo = self.by_principal.get(waiter.principal)
        if fifo is None or fifo.pop(waiter.seq, None) is None:
            return False
        if not fifo:
            del self.by_principal[waiter.principal]
        self.size -= 1
        return True

    def head(self) -> W | None:
        """The waiter to serve first: the lowest tag among each principal's oldest."""
        best: W | None = None
        for fifo in self.by_principal.values():
            first = next(iter(fifo.values()))
            if best is None or first.order < best.order:
                best = first
        return best

    def in_order(self) -> list[W]:
        return sorted(
            (waiter for fifo in self.by_principal.values() for waiter in fifo.values()),
            key=lambda waiter: waiter.order,
        )

    def latest(self) -> W:
        """The waiter that arrived last (the band is not empty)."""
        return max(
            (next(reversed(fifo.values())) for fifo in self.by_principal.values()),
            key=lambda waiter: waiter.seq,
        )


class FairQueue(Generic[W]):
    """The waiters of one (model, long, view) queue: the priorities in strict order, highest
    first, each a `Band`."""

    __slots__ = ("bands", "levels", "size")

    def __init__(self) -> None:
        self.bands: dict[int, Band[W]] = {}
        #: The levels that have waiters, lowest first.
        self.levels: list[int] = []
        self.size = 0

    def push(self, waiter: W) -> None:
        level = waiter.priority.level
        band = self.bands.get(level)
        if band is None:
            band = self.bands[level] = Band[W]()
            bisect.insort(self.levels, level)
        band.push(waiter)
        self.size += 1

    def remove(self, waiter: W) -> bool:
        level = waiter.priority.level
        band = self.bands.get(level)
        if band is None or not band.remove(waiter):
            return False
        if not band.size:
            del self.bands[level]
            self.levels.remove(level)
        self.size -= 1
        return True

    def head(self) -> W | None:
        """The waiter to serve first: the fair head of the highest priority."""
        return self.bands[self.levels[-1]].head() if self.levels else None

    def in_bands(self) -> list[tuple[int, list[W]]]:
        """(level, its waiters in fair order) for each level, highest first."""
        return [(level, self.bands[level].in_order()) for level in reversed(self.levels)]

    def in_order(self) -> list[W]:
        return [waiter for _, waiters in self.in_bands() for waiter in waiters]

    def lowest(self) -> W | None:
        """The latest waiter of the lowest priority: the first to give its place up."""
        return self.bands[self.levels[0]].latest() if self.levels else None

    def principals(self) -> dict[str, int]:
        """principal_ref -> its waiters here."""
        counts: dict[str, int] = {}
        for band in self.bands.values():
            for principal, fifo in band.by_principal.items():
                counts[principal] = counts.get(principal, 0) + len(fifo)
        return counts
