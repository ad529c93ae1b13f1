"""One admitted run's events, pulled through its adapter: `AdmittedRun`.

`Runner.run_events` (`running.py`) hands one out for a run `Runner.admit` let in; `Runner.execute`
pushes its events to a Node's stream, and a node placed on the Edge (`iop.edge.hub.localnodes`)
pulls them in-process. Its terminal event counts toward its provider's health; however the run
ends (that event, a failure of the adapter, an early `aclose`), its slot goes back to the runner,
once. When the process traces, the run's span (`runtraces.py`) covers it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Protocol

from iop import tracing
from iop.wire import TERMINAL_EVENTS, RunDone, RunEvent, RunFailed, RunRequest, statuses

from .provisions import Provision
from .runtraces import RunTrace

logger = logging.getLogger(__name__)


class Admitter(Protocol):
    """What let a run in and takes it back (the `Runner`): it judges how the run ended and
    frees its slot. A protocol rather than the class: `running.py` imports this module, and
    the import contract lets no two modules import each other."""

    def judge_run(
        self, request: RunRequest, provision: Provision, end: RunDone | RunFailed
    ) -> None: ...

    def release(self, request: RunRequest, provision: Provision) -> None: ...


class AdmittedRun:
    """The events of a run `Runner.admit` let in (`Runner.run_events`): the adapter's, then a
    failure if the adapter ended without a result or failed with a bug.

    An iterator of its own rather than an async generator wrapping the adapter's: a generator
    is one more frame to resume for every event and is registered with the loop at its first
    step, and the request path pulls every event of every run through it."""

    __slots__ = ("_done", "_events", "_provision", "_request", "_runner", "_trace")

    def __init__(self, runner: Admitter, request: RunRequest, provision: Provision) -> None:
        adapter = provision.adapter
        assert adapter is not None
        self._runner = runner
        self._request = request
        self._provision = provision
        tracer = tracing.tracer()
        #: The run's span, when this process traces (`runtraces.py`).
        self._trace = None
        # A run whose Edge did not sample its trace is not sampled here either (parent-based).
        traceparent = request.traceparent
        if tracer is not None and (not traceparent or tracing.sampled(traceparent)):
            kind = str(provision.payload.adapter.get("type", ""))
            self._trace = RunTrace(tracer, request, kind, adapter.upstream)
        sent = request if self._trace is None else self._trace.request(request)
        self._events: AsyncGenerator[RunEvent, None] = adapter.run(sent)
        self._done = False

    def __aiter__(self) -> AdmittedRun:
        return self

    @property
    def request(self) -> RunRequest:
        return self._request

    @property
    def provision(self) -> Provision:
        return self._provision

    def abandon(self) -> None:
        """Free the slot of a run whose events were never pulled (its task was cancelled before
        its first step); a run that started has closed itself, and this does nothing."""
        self._release()

    async def __anext__(self) -> RunEvent:
        if self._done:
            raise StopAsyncIteration
        request = self._request
        try:
            event = await anext(self._events)
        except StopAsyncIteration:
            event = statuses.failure(statuses.INTERNAL_ERROR, "the adapter ended without a result")
        except Exception as exc:
            logger.exception("run %s on %s failed", request.run_id, request.provider_id)
            self._release()
            return statuses.failure(statuses.INTERNAL_ERROR, f"the adapter failed: {exc!r}")
        except BaseException:
            self._release()
            raise
        else:
            if self._trace is not None:
                self._trace.event(event)
            if not isinstance(event, TERMINAL_EVENTS):
                return event
            self._runner.judge_run(request, self._provision, event)
        await self.aclose()
        return event

    async def aclose(self) -> None:
        """End the run (the adapter's work aborted if it is under way) and free its slot."""
        if self._done:
            return
        try:
            await self._events.aclose()
        finally:
            self._release()

    def _release(self) -> None:
        if not self._done:
            self._done = True
            if self._trace is not None:
                self._trace.end()
            self._runner.release(self._request, self._provision)
