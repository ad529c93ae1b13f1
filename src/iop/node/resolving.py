"""Where the Edge replicas are: the addresses a service name lists, and when to look again.

A headless Service lists the Edge pods by pod IP (the chart's lists them before they are ready:
a new Edge waits for its Nodes), so its answer changes whenever a replica starts, stops or is
replaced at a new IP; the Node must look again soon after, or it keeps dialing an address where
no Edge listens, and a new Edge waits for it. `ResolvePacing` decides when (pure, so a unit
test drives it with numbers): every `interval` (`iop node run --resolve-interval`) while every
address listed has welcomed the Node, every `fast` second while none has, or after a link is
`lost` until as many Edges as before and every address listed welcome it (for at most
`fast_for`); the agent also looks at once when a link drops or a dial fails, at most every
`fast` seconds (`spacing`). docs/reliability.md, "Following the Edge replicas", has the figures
and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

#: Seconds between two lookups while the Node misses an Edge (see the module docstring).
FAST_RESOLVE_S: Final = 1.0
#: Seconds the fast pace lasts after a lost link, at most.
FAST_RESOLVE_FOR_S: Final = 60.0


@dataclass(slots=True)
class ResolvePacing:
    """When the Node looks its Edge services up again; times are the event loop's clock."""

    interval: float
    fast: float = FAST_RESOLVE_S
    fast_for: float = FAST_RESOLVE_FOR_S
    #: The fast pace lasts until then, unless the Node is back where it was before.
    _fast_until: float = field(default=0.0, init=False)
    #: How many Edges welcomed the Node before its last losses.
    _wanted: int = field(default=0, init=False)

    @property
    def spacing(self) -> float:
        """The shortest time between two lookups."""
        return min(self.fast, self.interval)

    def started(self, now: float) -> None:
        """The Node starts: look fast until every address listed has welcomed it (bounded)."""
        self._fast_until = now + self.fast_for

    def lost(self, now: float, *, welcomed_before: int) -> None:
        """A link that had been welcomed dropped; `welcomed_before` links were up with it."""
        self._fast_until = now + self.fast_for
        self._wanted = max(self._wanted, welcomed_before)

    def delay(self, now: float, *, welcomed: int, listed: int) -> float:
        """Seconds until the next lookup, given how many links are welcomed, of how many."""
        if welcomed == 0:
            return self.spacing
        if welcomed >= max(listed, self._wanted):
            self._fast_until, self._wanted = 0.0, 0  # back where it was: slow until a loss
            return self.interval
        if now < self._fast_until:
            return self.spacing
        self._wanted = 0  # the fast pace is over: what is missing may be gone for good
        return self.interval
