"""Small asyncio building blocks every long-lived part of the product uses (after kopf's aiokits).

- `guarded_task`, `stop_tasks`: background tasks that are named, owned and never die silently.
- `AsyncService`: the `start()`/`stop()` or `async with` lifecycle of servers and agents.

Nothing here knows about the wire, the Edge or the Node; everything above may import it.
"""

from .aiotasks import guarded_task, stop_tasks
from .lifecycles import AsyncService

__all__ = ["AsyncService", "guarded_task", "stop_tasks"]
