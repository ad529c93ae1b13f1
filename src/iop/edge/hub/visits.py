"""Which Node sessions the hub's liveness tick visits: a busy one every tick, a quiet one when due.

A quiet link (no run in flight) has nothing for the tick to do between its heartbeats but wait
for its deadline, so a tick that looked at every session twice a second spent most of its time
on links with nothing due. A session with a run in flight (or whose Node keeps no link quiet)
is visited on every tick, as before; a quiet one waits in a heap for its next heartbeat or its
silence deadline, whichever comes first (only the deadline when its beats go one way, from the
Node), and a run sent on it makes it busy at once.
docs/architecture.md (the table of the Edge's modules) says where this sits.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Generic, TypeVar

S = TypeVar("S")


class Visits(Generic[S]):
    """The sessions a tick visits: every busy one, and each quiet one once its time came."""

    def __init__(self) -> None:
        self._busy: set[S] = set()
        #: Quiet sessions: when each is next visited (a heap entry of another time is stale).
        self._when: dict[S, float] = {}
        self._heap: list[tuple[float, int, S]] = []
        self._order = itertools.count()

    def busy(self, session: S) -> None:
        """Visit `session` on every tick from now on (a run went to it)."""
        self._busy.add(session)
        self._when.pop(session, None)

    def later(self, session: S, when: float) -> None:
        """Visit `session` on the first tick at or after `when`, and not before."""
        self._busy.discard(session)
        self._when[session] = when
        heapq.heappush(self._heap, (when, next(self._order), session))

    def forget(self, session: S) -> None:
        """`session` ended: never visited again."""
        self._busy.discard(session)
        self._when.pop(session, None)

    def due(self, now: float) -> list[S]:
        """The sessions a tick at `now` visits; a quiet one is taken off the heap (the visit
        calls `busy` or `later` for it again)."""
        due = list(self._busy)
        heap, when_of = self._heap, self._when
        while heap and heap[0][0] <= now:
            when, _, session = heapq.heappop(heap)
            if when_of.get(session) != when:
                continue  # rescheduled, busy or gone since
            del when_of[session]
            due.append(session)
        if len(heap) > 2 * len(when_of) + 64:  # stale entries of busy or ended sessions
            self._heap = [entry for entry in heap if when_of.get(entry[2]) == entry[0]]
            heapq.heapify(self._heap)
        return due

    def __len__(self) -> int:
        return len(self._busy) + len(self._when)
