"""Kubernetes Events for the operator's decisions, on the EdgeConfig they are about.

`kubectl describe ec NAME` shows them: validated or refused, applied live, rolled a scope,
rollout done, degraded and why. Posting is off the reconcile's path: `post` queues the Event
(and logs it at once), one background task sends them in order, so a decision is never delayed
by its Event, and a refused Event is only logged: the status still says everything.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from typing import Any, Final

from iop.aiokits import AsyncService, guarded_task, stop_tasks

from .. import conventions
from ..documents import Owner
from ..errors import KubeApiError
from ..kubeapi import KubeApi, resource_path
from ..values import EventType
from .reporting import now

logger = logging.getLogger(__name__)

#: The API server refuses Event messages over 1 KiB.
_MAX_MESSAGE: Final = 1000
#: Events waiting to be sent beyond this are dropped (logged): the API server is not keeping up.
_MAX_QUEUED: Final = 1000


class EventPoster(AsyncService):
    """Posts core/v1 Events (RBAC: `create events`) in the background, and logs each at once."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api
        self._instance = socket.gethostname()
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(_MAX_QUEUED)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = guarded_task(self._send(), name="post-events", logger=logger)

    async def stop(self) -> None:
        """Send what is queued (for up to a few seconds), then stop."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._queue.join(), 5.0)
        except TimeoutError:
            logger.warning("%d event(s) not posted at shutdown", self._queue.qsize())
        await stop_tasks([self._task])
        self._task = None

    def post(self, owner: Owner, kind: EventType, reason: str, message: str) -> None:
        if len(message) > _MAX_MESSAGE:
            message = message[: _MAX_MESSAGE - 1] + "…"
        log = logger.warning if kind == "Warning" else logger.info
        log("%s/%s: %s: %s", owner.namespace, owner.name, reason, message)
        timestamp = now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{owner.name}.{secrets.token_hex(8)}",
                "namespace": owner.namespace,
            },
            "involvedObject": {
                "apiVersion": f"{conventions.GROUP}/{conventions.VERSION}",
                "kind": conventions.KIND,
                "name": owner.name,
                "namespace": owner.namespace,
                "uid": owner.uid,
            },
            "type": kind,
            "reason": reason,
            "message": message,
            "source": {"component": "iop-operator"},
            "reportingComponent": "iop.dev/operator",
            "reportingInstance": self._instance,
            "firstTimestamp": timestamp,
            "lastTimestamp": timestamp,
            "count": 1,
        }
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            logger.warning("event queue full; not posting %s for %s", reason, owner.name)

    async def _send(self) -> None:
        while True:
            event = await self._queue.get()
            namespace = event["metadata"]["namespace"]
            try:
                await self._api.create(resource_path("v1", "events", namespace), event)
            except KubeApiError as exc:
                logger.warning("could not post the event %s: %s", event["reason"], exc)
            finally:
                self._queue.task_done()
