"""Watches of single objects, by name: what the operator owns or reads for an EdgeConfig.

The Edge ConfigMap, the applied record and the token Secrets it generated come back within
seconds when someone deletes or edits them, and a Secret it reads is read again the moment it
changes. One watch per object, with a `metadata.name` field selector (what RBAC can grant by
`resourceNames`); each lists its object, reports it, then follows it, starting over on a 410 Gone
or a dropped stream and backing off (1 s doubling to 30 s) while the API refuses.
docs/operator.md, "Level-based for what it owns", says why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from iop.aiokits import guarded_task, stop_tasks

from .errors import KubeApiError
from .kubeapi import KubeApi, resource_path

logger = logging.getLogger(__name__)

_BACKOFF_FIRST_S: Final = 1.0
_BACKOFF_MAX_S: Final = 30.0
_WATCH_SECONDS: Final = 300

#: What a listener hears: the object as it now is (`MODIFIED`, `ADDED`) or that it is gone
#: (`DELETED`, with the last object seen, or None when it never existed).
WatchEventType = Literal["ADDED", "MODIFIED", "DELETED"]
#: Called with each event of a watched object (from the watch's task: it must not block).
WatchListener = Callable[[WatchEventType, Mapping[str, Any] | None], None]


@dataclass(frozen=True, slots=True)
class NamedObject:
    """One object to watch: its API version, plural, namespace (None: cluster-scoped), name."""

    api_version: str
    plural: str
    namespace: str | None
    name: str

    def __str__(self) -> str:
        where = f"{self.namespace}/" if self.namespace else ""
        return f"{self.plural}/{where}{self.name}"


class NamedWatches:
    """The watches of one owner (an EdgeConfig's reconciler, the webhook's configuration):
    `keep` says which objects to follow now; the others stop."""

    def __init__(self, api: KubeApi, listener: Callable[[NamedObject], WatchListener]) -> None:
        self._api = api
        self._listener = listener
        self._tasks: dict[NamedObject, asyncio.Task[None]] = {}

    def keep(self, objects: Collection[NamedObject]) -> None:
        """Follow exactly `objects` from now on."""
        for target in set(self._tasks) - set(objects):
            self._tasks.pop(target).cancel()
        for target in objects:
            if target not in self._tasks:
                self._tasks[target] = guarded_task(
                    _follow(self._api, target, self._listener(target)),
                    name=f"watch {target}",
                    logger=logger,
                )

    @property
    def watched(self) -> frozenset[NamedObject]:
        return frozenset(self._tasks)

    async def stop(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        await stop_tasks(tasks)


async def _follow(api: KubeApi, target: NamedObject, listener: WatchListener) -> None:
    collection = resource_path(target.api_version, target.plural, target.namespace)
    selector = f"metadata.name={target.name}"
    delay = _BACKOFF_FIRST_S
    last: Mapping[str, Any] | None = None
    while True:
        try:
            listed = await api.request(
                "GET", collection, params={"fieldSelector": selector}, what=f"list {target}"
            )
            items = listed.get("items") or []
            version = str((listed.get("metadata") or {}).get("resourceVersion") or "")
            if items:
                last = items[0]
                listener("ADDED", last)
            else:
                listener("DELETED", last)
                last = None
            params = {
                "fieldSelector": selector,
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(_WATCH_SECONDS),
            }
            async for event in api.watch(collection, params=params, what=f"watch {target}"):
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind in ("ADDED", "MODIFIED"):
                    last = obj
                    listener(kind, obj)
                elif kind == "DELETED":
                    last = None
                    listener("DELETED", obj)
                elif kind == "ERROR":  # 410 Gone: the version is too old; list again
                    break
            delay = _BACKOFF_FIRST_S
        except KubeApiError as error:
            logger.warning("cannot watch %s (again in %.0fs): %s", target, delay, error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)
