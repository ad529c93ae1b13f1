"""One worker task per EdgeConfig: applies are serialised, a newer generation supersedes.

kopf delivers watch events; the handlers only hand the newest body to the EdgeConfig's worker
and wake it (Deployment and Pod events of its workloads wake it too). The worker runs one
reconcile pass at a time, always on the newest body it has, so generations in between are
skipped, never applied out of order; a failed pass is retried with exponential back-off (1 s
doubling to 60 s), which a new generation cuts short. docs/operator.md, "What happens to a
change", says why not kopf's change handlers or a `@kopf.daemon`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from iop.aiokits import guarded_task, stop_tasks

from . import conventions
from .metrics import EdgeConfigHealth
from .reconciling import PassResult, Reconciler

logger = logging.getLogger(__name__)

_BACKOFF_FIRST_S: Final = 1.0
_BACKOFF_MAX_S: Final = 60.0
#: Even with nothing to do, look again this often: it costs a few reads, and heals what no
#: event announced (a node that connected, a Secret that appeared).
_RESYNC_S: Final = 300.0

Key = tuple[str, str]


class Worker:
    """The task that reconciles one EdgeConfig."""

    def __init__(
        self, key: Key, uid: str, reconciler: Reconciler, leading: asyncio.Event | None = None
    ) -> None:
        self.key = key
        self.uid = uid
        self.reconciler = reconciler
        self._leading = leading
        self._body: Mapping[str, Any] | None = None
        self._received_at = 0.0
        #: The generation and the pin annotation last seen: either one changing runs a pass.
        self._generation: tuple[int | None, str | None] | None = None
        self._wake = asyncio.Event()
        self._backoff = _BACKOFF_FIRST_S
        self._task = guarded_task(self._run(), name=f"reconcile {key[0]}/{key[1]}", logger=logger)
        reconciler.wake = self.poke  # a watched object it owns changed

    @property
    def task(self) -> asyncio.Task[None]:
        return self._task

    def notify(self, body: Mapping[str, Any]) -> None:
        """The newest body of the EdgeConfig; a new generation (or pin) runs a pass at once."""
        generation = (body.get("metadata", {}).get("generation"), conventions.pin_of(body))
        if generation != self._generation:
            self._generation = generation
            self._backoff = _BACKOFF_FIRST_S
            self._received_at = time.monotonic()
            self._body = body
            self._wake.set()
        else:
            self._body = body  # a status write of ours, or metadata: no pass for that

    def poke(self) -> None:
        """Something the EdgeConfig depends on changed (a workload, a pod): look again."""
        self._wake.set()

    @property
    def due(self) -> bool:
        """Woken and waiting for its pass."""
        return self._wake.is_set()

    async def _run(self) -> None:
        try:
            await self._passes()
        finally:
            await self.reconciler.stop()  # its watches go with it

    async def _passes(self) -> None:
        delay: float | None = None
        while True:
            try:
                if delay is None:
                    await self._wake.wait()
                else:
                    await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass
            if self._leading is not None and not self._leading.is_set():
                await self._leading.wait()  # a standby replica: only the leader acts
            self._wake.clear()
            body = self._body
            if body is None:
                delay = None
                continue
            try:
                result = await self.reconciler.reconcile(body, self._received_at)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("reconcile of %s/%s failed; retrying", *self.key)
                result = PassResult(retry=True)
            delay = self._next_delay(result)

    def _next_delay(self, result: PassResult) -> float:
        if result.retry:
            delay = self._backoff * random.uniform(0.8, 1.2)
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
            return delay
        self._backoff = _BACKOFF_FIRST_S
        return result.recheck_after if result.recheck_after is not None else _RESYNC_S


class Workers:
    """Every worker, by (namespace, name); created on the first event, dropped on deletion."""

    def __init__(
        self, make: Callable[[str, str], Reconciler], leading: asyncio.Event | None = None
    ) -> None:
        self._make = make
        self._leading = leading
        self._workers: dict[Key, Worker] = {}
        #: Workers of deleted-and-recreated namesakes, cancelled and awaited at `stop`.
        self._retired: set[asyncio.Task[None]] = set()

    def notify(self, body: Mapping[str, Any]) -> None:
        metadata = body["metadata"]
        key = (metadata["namespace"], metadata["name"])
        worker = self._workers.get(key)
        if worker is not None and (worker.uid != metadata.get("uid") or worker.task.done()):
            worker.task.cancel()  # deleted and created again under the same name: start afresh
            self._retired.add(worker.task)
            worker.task.add_done_callback(self._retired.discard)
            worker = None
        if worker is None:
            worker = Worker(key, metadata.get("uid", ""), self._make(*key), self._leading)
            self._workers[key] = worker
        worker.notify(body)

    def poke(self, namespace: str, name: str) -> None:
        worker = self._workers.get((namespace, name))
        if worker is not None:
            worker.poke()

    def reconciler(self, namespace: str, name: str) -> Reconciler | None:
        worker = self._workers.get((namespace, name))
        return worker.reconciler if worker is not None else None

    async def forget(self, namespace: str, name: str) -> None:
        """The EdgeConfig is gone: stop its worker (its objects go with it, by ownership)."""
        worker = self._workers.pop((namespace, name), None)
        if worker is not None:
            await stop_tasks([worker.task])

    def health(self) -> list[EdgeConfigHealth]:
        """Each EdgeConfig's health, for the metrics."""
        return [worker.reconciler.health for worker in self._workers.values()]

    @property
    def pending(self) -> int:
        """Workers with a pass to run (woken, not yet running it): the queue depth."""
        return sum(1 for worker in self._workers.values() if worker.due)

    async def stop(self) -> None:
        workers, self._workers = list(self._workers.values()), {}
        await stop_tasks([*(worker.task for worker in workers), *self._retired])
