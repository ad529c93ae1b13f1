"""The explicit lifecycle every long-lived part shares: `start()`/`stop()`, or `async with`.

The Edge server, the node hub, the Node agent and the fake upstream each start listeners and
background tasks; each is used either with explicit calls or as `async with part:` (after httpx's
client lifecycle), and this base class gives them the second form from the first.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self


class AsyncService:
    """`async with service:` calls `start()` on entry and `stop()` on exit."""

    async def start(self) -> object:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
