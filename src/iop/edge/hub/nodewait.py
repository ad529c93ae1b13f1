"""When the Edge is ready: once the nodes that dial in have connected, or it waited long enough.

A new Edge replica that takes OpenAI traffic before its Nodes have found it can only queue or
fail that traffic, so `NodeWait` holds the Edge's `/readyz` at 503 until every node of its config
that dials in (not those placed on the Edge) is connected and took its config, or until `wait`
seconds after the hub started, whichever comes first (a node that is down never keeps an Edge
unready for good). Once ready, the Edge stays ready: a node that drops later must not take the
replica out of its Service. `judge` is the rule, pure; docs/edge.md, "Readiness", says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from .protocol import NodeStatus

logger = logging.getLogger(__name__)

#: Most node ids a not-ready answer (and the log line of a wait that timed out) names.
MAX_AWAITED_SHOWN: Final = 20


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether the Edge is ready; while it waits for nodes, which ones (sorted, all of them) and
    for how many more seconds at most. `timed_out`: ready because the wait ran out."""

    ready: bool
    awaited: tuple[str, ...] = ()
    wait_left: float = 0.0
    timed_out: bool = False


#: Ready, waiting for nothing.
READY: Final = Readiness(ready=True)


def judge(
    expected: Collection[str], connected: Collection[str], waited: float, wait: float
) -> Readiness:
    """The rule: ready when no node of `expected` is missing from `connected`, or when `waited`
    (seconds since the hub started) reached `wait`; `wait` 0 waits for nothing."""
    if wait <= 0:
        return READY
    awaited = tuple(sorted(set(expected).difference(connected)))
    if not awaited:
        return READY
    if waited >= wait:
        return Readiness(ready=True, awaited=awaited, timed_out=True)
    return Readiness(ready=False, awaited=awaited, wait_left=wait - waited)


class ConnectedNodes(Protocol):
    """What `NodeWait` needs of the hub."""

    def nodes(self) -> Mapping[str, NodeStatus]: ...

    def add_listener(self, callback: Callable[[], None]) -> None: ...


class NodeWait:
    """The Edge's readiness as its nodes make it: `start()` when the hub listens, then
    `readiness()`; it turns ready once (logged) and stays so."""

    def __init__(self, hub: ConnectedNodes, expected: Collection[str], wait: float) -> None:
        self._hub = hub
        self.expected = frozenset(expected)
        self.wait = wait
        self._started_at: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._ready = wait <= 0

    def start(self) -> None:
        """The hub listens: the wait starts now, and ends at the latest `wait` seconds later."""
        loop = asyncio.get_running_loop()
        self._started_at = loop.time()
        if self._ready:
            return
        self._hub.add_listener(self._changed)
        self._timer = loop.call_later(self.wait, self._deadline)
        self.readiness()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def readiness(self) -> Readiness:
        """Ready (for good, once so), or the nodes still awaited and the seconds left."""
        if self._ready:
            return READY
        started_at = self._started_at
        if started_at is None:  # the hub does not listen yet
            return Readiness(ready=False, awaited=tuple(sorted(self.expected)), wait_left=self.wait)
        waited = asyncio.get_running_loop().time() - started_at
        connected = [node_id for node_id, status in self._hub.nodes().items() if status.ready]
        verdict = judge(self.expected, connected, waited, self.wait)
        if verdict.ready:
            self._ready = True
            self.stop()
            self._log(verdict, waited)
        return verdict

    def _changed(self) -> None:
        if not self._ready:
            self.readiness()

    def _deadline(self) -> None:
        # The loop may run a timer a clock tick early: then wait out what is left.
        self._timer = None
        verdict = self.readiness()
        if not verdict.ready:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(verdict.wait_left, self._deadline)

    def _log(self, verdict: Readiness, waited: float) -> None:
        total = len(self.expected)
        if verdict.timed_out:
            missing = len(verdict.awaited)
            shown = ", ".join(verdict.awaited[:MAX_AWAITED_SHOWN])
            more = f" and {missing - MAX_AWAITED_SHOWN} more" if missing > MAX_AWAITED_SHOWN else ""
            logger.warning(
                "edge ready after waiting %.1fs for its nodes: %d of %d connected, still "
                "missing %s%s",
                waited,
                total - missing,
                total,
                shown,
                more,
            )
        else:
            logger.info(
                "edge ready: all %d node(s) that dial in connected, after %.1fs", total, waited
            )
