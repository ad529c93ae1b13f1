"""Kubernetes Events for the operator's decisions, on the EdgeConfig they are about.

`kubectl describe ec NAME` shows them: validated or refused, applied live, rolled a scope,
rollout done, degraded and why. Posting an Event never fails a reconcile: a refused Event is
logged, and the status still says everything.
"""

from __future__ import annotations

import logging
import secrets
import socket
from typing import Final, Literal

from . import conventions
from .documents import Owner
from .errors import KubeApiError
from .kubeapi import KubeApi, resource_path
from .reporting import now

__all__ = ["EventPoster", "EventType"]

logger = logging.getLogger(__name__)

EventType = Literal["Normal", "Warning"]
#: The API server refuses Event messages over 1 KiB.
_MAX_MESSAGE: Final = 1000


class EventPoster:
    """Posts core/v1 Events (RBAC: `create events`) and says the same in the log."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api
        self._instance = socket.gethostname()

    async def post(self, owner: Owner, kind: EventType, reason: str, message: str) -> None:
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
            await self._api.create(resource_path("v1", "events", owner.namespace), event)
        except KubeApiError as exc:
            logger.warning("could not post the event %s for %s: %s", reason, owner.name, exc)
