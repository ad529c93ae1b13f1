"""Background tasks that are named, owned and never die silently (after kopf's aiotasks).

`asyncio` keeps only a weak reference to a task, and an exception in a task nobody awaits is
reported late or never. Every background task here is created through `guarded_task`, kept by
its owner and logged when it ends with an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def guarded_task(
    coro: Coroutine[Any, Any, T], *, name: str, logger: logging.Logger
) -> asyncio.Task[T]:
    """Start `coro` as a named task that logs its death; the caller must keep the task."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(lambda t: _log_death(t, logger))
    return task


def _log_death(task: asyncio.Task[Any], logger: logging.Logger) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("task %s died: %r", task.get_name(), exc, exc_info=exc)


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait until they have ended; their own errors were logged already.

    A cancellation of the caller itself still propagates (asyncio.wait raises it).
    """
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
