"""One active operator among its replicas: leader election on a coordination.k8s.io Lease.

Two replicas run (the chart's default), so a lost node costs seconds, not the minutes a single
replica takes to be rescheduled. Both watch and both serve the webhook; only the holder of the
Lease reconciles (`workers.py` waits for `leading`). The rules are client-go's `leaderelection`
(renew every `retry_s`, take over a record unrenewed for `lease_s` by one's own clock, step down
past `renew_deadline_s`, release on stop), with optimistic writes on the resourceVersion.
docs/operator.md, "Several replicas, one active", says why, and why not kopf's peering.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

from .errors import KubeApiError, KubeConflict, KubeNotFound
from .kubeapi import KubeApi, resource_path

logger = logging.getLogger(__name__)

_API: Final = "coordination.k8s.io/v1"


def _micro_time() -> str:
    """Kubernetes' MicroTime: RFC 3339 with microseconds, UTC."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElection:
    """Holds (or waits for) Lease `name`; `leading` is set while this replica holds it."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_s: float = 2.0,
    ) -> None:
        self._api = api
        self._path = resource_path(_API, "leases", namespace, name)
        self._collection = resource_path(_API, "leases", namespace)
        self.name = name
        self.identity = identity
        self._lease_s = lease_s
        self._renew_deadline_s = renew_deadline_s
        self._retry_s = retry_s
        self.leading = asyncio.Event()
        #: The holder's record as last seen (resourceVersion) and when this replica saw it change.
        self._seen: tuple[str, float] | None = None
        self._renewed_at = 0.0
        self._released = False
        #: One read-and-write of the Lease at a time: a release must not cross a renewal in
        #: flight (its PUT would conflict, and the renewal would take the Lease back).
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        """Try to acquire or renew every `retry_s` until cancelled."""
        while True:
            try:
                async with self._lock:
                    await self._try()
            except KubeApiError as error:
                logger.warning("Lease %s: %s", self.name, error)
            if (
                self.leading.is_set()
                and time.monotonic() - self._renewed_at > self._renew_deadline_s
            ):
                logger.warning(
                    "Lease %s not renewed for %.0fs: stepping down",
                    self.name,
                    self._renew_deadline_s,
                )
                self.leading.clear()
            await asyncio.sleep(self._retry_s)

    async def release(self) -> None:
        """Give the Lease up (on shutdown), so a standby takes over at once; this replica takes
        it no more."""
        self._released = True
        async with self._lock:
            if not self.leading.is_set():
                return
            self.leading.clear()
            await self._give_up()

    async def _give_up(self) -> None:
        try:
            lease = await self._api.get(self._path, what=f"read the Lease {self.name}")
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}
                await self._api.request(
                    "PUT",
                    self._path,
                    body={**lease, "spec": spec},
                    what=f"release the Lease {self.name}",
                )
                logger.info("released the Lease %s", self.name)
        except KubeApiError as error:
            logger.warning("could not release the Lease %s: %s", self.name, error)

    async def _try(self) -> None:
        if self._released:
            return
        try:
            lease = await self._api.get(self._path, what=f"read the Lease {self.name}")
        except KubeNotFound:
            await self._create()
            return
        spec: Mapping[str, Any] = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        version = lease["metadata"].get("resourceVersion", "")
        moment = time.monotonic()
        if holder == self.identity:
            await self._write(lease, transitions=int(spec.get("leaseTransitions") or 0))
            return
        if self.leading.is_set():  # someone else holds it now: we lost it
            logger.warning("Lease %s is held by %s: stepping down", self.name, holder)
            self.leading.clear()
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, moment)
        duration = float(spec.get("leaseDurationSeconds") or self._lease_s)
        if holder and moment - self._seen[1] < duration:
            return  # held and renewed within its lease, as far as this replica has seen
        await self._write(lease, transitions=int(spec.get("leaseTransitions") or 0) + 1)

    async def _create(self) -> None:
        now = _micro_time()
        body = {
            "apiVersion": _API,
            "kind": "Lease",
            "metadata": {"name": self.name},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self._lease_s),
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            },
        }
        try:
            await self._api.create(self._collection, body, what=f"create the Lease {self.name}")
        except KubeConflict:
            return  # another replica made it first; the next try reads it
        self._won()

    async def _write(self, lease: Mapping[str, Any], *, transitions: int) -> None:
        """Take or renew the Lease; a conflict means another replica wrote first."""
        spec = dict(lease.get("spec") or {})
        now = _micro_time()
        if spec.get("holderIdentity") != self.identity:
            spec["acquireTime"] = now
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=int(self._lease_s),
            renewTime=now,
            leaseTransitions=transitions,
        )
        try:
            await self._api.request(
                "PUT", self._path, body={**lease, "spec": spec}, what=f"renew the Lease {self.name}"
            )
        except KubeConflict:
            return
        self._won()

    def _won(self) -> None:
        self._renewed_at = time.monotonic()
        if not self.leading.is_set():
            logger.info("this replica (%s) leads: it holds the Lease %s", self.identity, self.name)
            self.leading.set()
