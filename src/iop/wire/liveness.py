"""Liveness on the Node-Edge link: heartbeats both ways, and a deadline for a silent peer.

A frozen peer keeps its TCP connection open, so only what its *application* sends can say it is
alive: each side sends a heartbeat every `heartbeat_interval` and counts a peer it heard nothing
from for `heartbeat_timeout` as dead; the Edge's values (`edge.node_link`) travel in the
welcome. On a quiet link (no run in flight) the beats are slower, and one way when both sides
say so: the Node beats, and judges the Edge there by the transport's keepalive instead. A side
whose own ticker woke late by more than a tick judges nobody on that tick: the peer's messages
may still sit unread. docs/reliability.md, "Liveness of the Node links", says why.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class Liveness:
    """How often each side sends a heartbeat, and how long a silent peer counts as alive; on a
    quiet link (no run in flight on it, when both sides keep such links quiet: the protocol's
    "Quiet links"), `idle_interval` and `idle_timeout` instead (0: no quiet links)."""

    heartbeat_interval: float
    heartbeat_timeout: float
    idle_interval: float = 0.0
    idle_timeout: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise ValueError("the heartbeat interval must be positive and below the timeout")
        if self.idle_interval and not (
            self.heartbeat_interval <= self.idle_interval < self.idle_timeout
            and self.idle_timeout >= self.heartbeat_timeout
        ):
            raise ValueError(
                "the idle interval must be at least the heartbeat interval and below the idle "
                "timeout, which must be at least the heartbeat timeout"
            )

    @property
    def quiet(self) -> bool:
        """Links with no run in flight may be quiet."""
        return self.idle_interval > 0

    def interval(self, quiet: bool) -> float:
        """Seconds between heartbeats on a link that is `quiet` or not."""
        return self.idle_interval if quiet and self.quiet else self.heartbeat_interval

    def timeout(self, quiet: bool) -> float:
        """Seconds of silence after which the peer of a link that is `quiet` or not is dead."""
        return self.idle_timeout if quiet and self.quiet else self.heartbeat_timeout


#: What a Node uses until an Edge's welcome says otherwise (and what edge.node_link defaults to).
DEFAULT_LIVENESS: Final = Liveness(heartbeat_interval=0.5, heartbeat_timeout=2.0)


class Ticker:
    """Wakes every `interval` seconds and says whether this side's own event loop kept time."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._loop = asyncio.get_running_loop()
        self._next = self._loop.time() + interval

    async def tick(self) -> bool:
        """Sleep until the next tick; False when it came more than a tick late (a stall here)."""
        await asyncio.sleep(max(0.0, self._next - self._loop.time()))
        now = self._loop.time()
        on_time = now - self._next <= self.interval
        self._next = now + self.interval
        return on_time
