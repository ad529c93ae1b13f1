"""How many Edge replicas there are, for the capacity of the nodes placed on the Edge.

Every Edge replica runs the providers of a node placed on the Edge (`localnodes.py`) and takes
an equal share of each one's capacity, so it must know how many replicas share it. The Edge
looks up the headless Service that lists the Edge pods (the hub Service the Nodes resolve too,
`iop edge run --peers-service NAME:PORT`) at start and every `interval` seconds, and reports
the count whenever it changes. The chart's hub Service lists pods that are not ready yet (or
are stopping) too, so the Nodes find a new Edge that waits for them: counting those makes each
share smaller for a while, never larger, so the replicas stay within the capacity together.
When the name lists nothing or does not resolve, the count stays what it was (1 at start).
Without a Service, an Edge counts itself alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from iop.aiokits import (
    AsyncService,
    LogThrottle,
    Resolve,
    guarded_task,
    resolve_service,
    split_listener,
    stop_tasks,
)

logger = logging.getLogger(__name__)

#: Seconds between two lookups of the Edge replicas.
PEER_LOOKUP_S: Final = 5.0


class PeerCount(AsyncService):
    """`on_change(count)` whenever the number of addresses `service` lists changes."""

    def __init__(
        self,
        service: str,
        on_change: Callable[[int], None],
        *,
        interval: float | None = None,
        resolve: Resolve = resolve_service,
    ) -> None:
        self._host, self._port = split_listener(service)
        self._service = service
        self._on_change = on_change
        self._interval = PEER_LOOKUP_S if interval is None else interval
        self._resolve = resolve
        self._task: asyncio.Task[None] | None = None
        self._failures = LogThrottle(logger, interval=60.0)
        self.count = 1

    async def start(self) -> None:
        await self._look()
        self._task = guarded_task(self._look_forever(), name="edge-peers", logger=logger)

    async def stop(self) -> None:
        if self._task is not None:
            await stop_tasks([self._task])
            self._task = None

    async def _look_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._look()

    async def _look(self) -> None:
        try:
            count = len(await self._resolve(self._host, self._port))
        except OSError as exc:
            self._failures.warning(
                "cannot look up the Edge replicas at %s (%s): sharing capacity among %d",
                self._service,
                exc,
                self.count,
            )
            return
        if count and count != self.count:
            logger.info(
                "%d Edge replicas at %s (were %d): each takes its share of the capacity of "
                "the nodes placed on the Edge",
                count,
                self._service,
                self.count,
            )
            self.count = count
            self._on_change(count)
