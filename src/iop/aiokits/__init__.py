"""Small asyncio building blocks every long-lived part of the product uses (after kopf's aiokits).

- `aiotasks`: `guarded_task`, `stop_tasks`: background tasks named, owned, never dying silently;
  `lifecycles`: `AsyncService`, the `start()` and `stop()` (or `async with`) lifecycle of servers;
- `throttling`: `LogThrottle`, one log line per interval for what outsiders can cause at will;
- `listening`: `bind_listener` (a server's socket, bound before it starts), `split_listener`
  (`host:port`), `resolve_service` (the addresses a headless Service's name lists now),
  `open_file_room` (the open files left for connections under the process's limit);
- `asgiserving`: `AsgiServer`, an ASGI app on uvicorn on such a socket (imported from its module,
  so that parts serving no HTTP never load uvicorn).
Nothing here knows about the wire, the Edge or the Node; everything above may import it.
"""

from .aiotasks import guarded_task, stop_tasks
from .lifecycles import AsyncService
from .listening import (
    FD_RESERVE,
    Resolve,
    bind_listener,
    open_file_limit,
    open_file_room,
    resolve_service,
    split_listener,
)
from .throttling import LogThrottle

__all__ = [
    "FD_RESERVE",
    "AsyncService",
    "LogThrottle",
    "Resolve",
    "bind_listener",
    "guarded_task",
    "open_file_limit",
    "open_file_room",
    "resolve_service",
    "split_listener",
    "stop_tasks",
]
