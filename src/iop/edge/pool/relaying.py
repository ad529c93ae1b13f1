"""One request's trip through the pool and a Node: lease a slot, run, meter, give the slot back.

`Relay.open()` returns a `RelayedRun`, an async context manager that yields the run's events.
Entering it leases a slot (waiting in the queue if needs be), starts the run and waits for its
first event, so that a failure before anything reached the client can still be retried (on a
provider not tried yet, then the model's fallbacks, within `retrying.py`'s budget); a model
whose providers are all busy takes a fallback's free slot, or the first of any (`_first_lease`).
docs/edge.md, "Retries and fallbacks", has the rules. The slot goes back as soon as the run has
ended on its Node, even while a slow client still reads; leaving the context (also by
cancellation, when the client disconnects) cancels the run on its Node and releases the slot.
While a change is on trial, a request runs on its side's view of its model (`splits.py`); a try
of the candidate's that fails before its first byte in a way a config can cause is tried again
on the stable revision (`_back_to_stable`), so the change's faults cost the client no error.
A request that continues a stored response (the Responses API) runs on the provider that holds
it, its `home`, or nowhere: it waits for that provider's slot, and is tried nowhere else.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import orjson

from iop.wire import TERMINAL_EVENTS, RunChunk, RunEvent, RunFailed, RunRequest, RunUsage
from iop.wire import statuses as wire_statuses

from ..authenticating import Principal
from ..bodies import ParsedRequest, apply_policy, estimate_tokens
from ..errors import ModelNotFound, NoProvider, QueueTimeout
from ..hub import NodeRuns, RunEvents
from .choosing import PREFIX_AFFINITY, PrefixKey
from .dispatching import Dispatcher
from .metering import Metrics
from .prefixes import prefix_key
from .priorities import DEFAULT_PRIORITY, Priority
from .retrying import RetryBudget, RetryBudgets, should_retry
from .slots import Lease
from .snapshots import PoolModel
from .splits import CANDIDATE, STABLE, Side
from .traces import RequestTrace


class Relay:
    """Runs parsed requests through the dispatcher and the node hub."""

    def __init__(self, dispatcher: Dispatcher, hub: NodeRuns, metrics: Metrics) -> None:
        self.dispatcher = dispatcher
        self.hub = hub
        self.metrics = metrics
        #: Each model's retry budget, shared by its requests.
        self.budgets = RetryBudgets()
        self._run_ids = itertools.count(1)
        self._run_prefix = os.urandom(4).hex()

    def open(
        self,
        request: ParsedRequest,
        long: bool,
        principal: Principal,
        side: Side = STABLE,
        priority: Priority = DEFAULT_PRIORITY,
        trace: RequestTrace | None = None,
        traceparent: str | None = None,
        home: str = "",
    ) -> RelayedRun:
        """`trace`: the request's spans, when the Edge traces; else `traceparent`, the client's,
        goes with each run as it came. `home`: the one provider the request may run on."""
        return RelayedRun(self, request, long, principal, side, priority, trace, traceparent, home)

    def next_run_id(self) -> str:
        """A run id unique to this Edge process."""
        return f"{self._run_prefix}-{next(self._run_ids):x}"


#: No provider tried yet.
_NONE: Final[frozenset[str]] = frozenset()
#: A request's prefix points before they are needed (most requests never need them).
_UNKNOWN: Final = PrefixKey(())
#: An upstream's answers that a wrong config gives (a served name, a key): on a candidate's try,
#: worth a try on the stable revision, which may not have that fault.
_CONFIG_FAULTS: Final = frozenset({401, 403, 404})


@dataclass(slots=True)
class _Attempts:
    """What one request has tried so far."""

    #: The model asked for, then its fallbacks in the order they are tried.
    chain: tuple[str, ...]
    #: The position in `chain` of the model tried now.
    position: int = 0
    #: The providers that failed this request.
    tried: frozenset[str] = frozenset()
    #: Retries after failures so far (busy refusals not counted).
    retries: int = 0
    #: The failure the current try follows: the answer if that try finds no slot in time.
    failure: RunFailed | None = None


class RelayedRun:
    """The events of one request's run, from its first event on."""

    def __init__(
        self,
        relay: Relay,
        request: ParsedRequest,
        long: bool,
        principal: Principal,
        side: Side = STABLE,
        priority: Priority = DEFAULT_PRIORITY,
        trace: RequestTrace | None = None,
        traceparent: str | None = None,
        home: str = "",
    ) -> None:
        self._dispatcher = relay.dispatcher
        self._hub = relay.hub
        self._metrics = relay.metrics
        self._budgets = relay.budgets
        self._next_run_id = relay.next_run_id
        self._request = request
        self._long = long
        self._principal = principal
        #: Its priority class (`priorities.py`): its place in every queue it waits in.
        self._priority = priority
        #: The one provider it may run on (it holds the stored response the request
        #: continues), or "": then no fallback, and no retry elsewhere.
        self._home = home
        self._model = request.model
        #: The revision the request was given when it arrived (what its outcome counts for).
        self.side = side
        #: The revision whose view it runs on now (the stable one after `_back_to_stable`).
        self._side = side
        self._lease: Lease | None = None
        self._stream: RunEvents | None = None
        self._events: AsyncIterator[RunEvent] | None = None
        self._first: RunEvent | None = None
        self._prefix_key: PrefixKey | None = _UNKNOWN
        #: Tokens the upstream reported for the answer (prompt + completion), once it has; or,
        #: for a stream that ended without its usage (its client left), what was delivered.
        self.spent: int | None = None
        #: A stream's events passed on so far: one token each (`_meter_delivered`).
        self._delivered = 0
        #: Its tries that failed before their first byte and were tried again (a busy refusal
        #: is none), counted with the request when it ends (`OutcomeTally.request`).
        self.retried_tries = 0
        self._trace = trace
        self._traceparent = traceparent
        #: Why the next try is made (its span says): the first, a retry's failure, a fallback.
        self._why = "first"

    @property
    def provider_id(self) -> str:
        return self._lease.provider_id if self._lease is not None else ""

    @property
    def model_id(self) -> str:
        """The catalog id of the model that answers (a fallback's, when one took over)."""
        return self._model

    @property
    def lease(self) -> Lease | None:
        return self._lease

    async def __aenter__(self) -> Self:
        dispatcher = self._dispatcher
        asked = self._request.model
        pool_model = dispatcher.model_view(asked, self._side)
        budget = self._budgets.count_request(dispatcher.snapshot, asked)
        # Made at the first failure or fallback: most requests never need it.
        attempts: _Attempts | None = None
        if pool_model is not None and pool_model.fallbacks and not self._home:
            attempts = _Attempts((asked, *pool_model.fallbacks))
            self._fall_back_if_unavailable(attempts)
        deadline: float | None = None
        while True:
            lease = await self._next_lease(attempts, budget, deadline)
            if lease is None:  # the retry found no slot in time: the failure it follows answers
                assert attempts is not None
                self._first = attempts.failure
                return self
            deadline = lease.deadline
            first = await self._try(lease)
            if isinstance(first, RunFailed):
                if attempts is None:
                    attempts = _Attempts((asked,))
                side = self._side
                if self._trace is not None:
                    self._trace.run_ended(first)
                if self._try_again(first, lease, attempts, budget, deadline):
                    await self._close_stream(None, None, None)
                    if self._side != side:  # the candidate's config failed, not the provider
                        self._dispatcher.release(lease)
                    else:  # it sits out a moment, as after a busy refusal
                        self._dispatcher.refuse(lease)
                    self._lease = None
                    continue
            self._settle(lease, first)
            return self

    async def _next_lease(
        self, attempts: _Attempts | None, budget: RetryBudget, deadline: float | None
    ) -> Lease | None:
        """The slot of the next try: the first try's (with fallbacks, `_first_lease`), or a
        retry's within the first try's deadline; None when a retry finds none in time."""
        dispatcher = self._dispatcher
        trace = self._trace
        if trace is not None:
            trace.waiting(self._model)
        try:
            if deadline is None and attempts is not None:
                lease = await self._first_lease(attempts, budget)
            else:
                lease = await dispatcher.acquire(
                    self._model,
                    self._long,
                    deadline=deadline,
                    principal=self._principal.principal_ref,
                    avoid=attempts.tried if attempts is not None else _NONE,
                    prefix=self._prefix(dispatcher.model_view(self._model, self._side)),
                    side=self._side,
                    priority=self._priority,
                    home=self._home,
                    promise=self._promise() if deadline is None else b"",
                )
        except BaseException as error:
            if trace is not None:
                trace.not_leased(error)
            if not isinstance(error, (QueueTimeout, NoProvider, ModelNotFound)):
                raise
            if attempts is None or attempts.failure is None:
                raise
            return None
        if trace is not None:
            trace.leased(lease)
        if deadline is None:
            self._metrics.observe_queue_wait(
                self._model, self._principal.principal_ref, lease.waited_s
            )
        return lease

    async def _try(self, lease: Lease) -> RunEvent:
        """Start a run on `lease`: its first event (the slot goes back if starting fails)."""
        self._lease = lease
        try:
            return await self._start(lease)
        except BaseException:
            self._dispatcher.release(lease)
            self._lease = None
            raise

    def _settle(self, lease: Lease, first: RunEvent) -> None:
        """The try that answers: its slot is given back when its run ends."""
        self._first = first
        self._dispatcher.started(lease)
        stream = self._stream
        if stream is None:  # the try timed out before its first byte: its run is over
            self._dispatcher.release(lease)
        else:
            stream.on_end(functools.partial(self._dispatcher.release, lease))

    def _prefix(self, pool_model: PoolModel | None) -> PrefixKey | None:
        """The prompt's prefix points when the model dispatches by them (made once)."""
        if pool_model is None or pool_model.dispatch.policy != PREFIX_AFFINITY:
            return None
        if self._prefix_key is _UNKNOWN:
            self._prefix_key = prefix_key(self._request)
        return self._prefix_key

    def _try_again(
        self,
        failed: RunFailed,
        lease: Lease,
        attempts: _Attempts,
        budget: RetryBudget,
        deadline: float,
    ) -> bool:
        """Whether the request tries again after `failed`, its try's first event (so nothing
        reached the client); the request moves to a fallback model when the next try goes
        there."""
        metrics = self._metrics
        asked = attempts.chain[0]
        self._why = failed.code
        if failed.code == wire_statuses.PROVIDER_BUSY:
            metrics.count_retry(asked, failed.code)
            return True
        if self._home:
            return False  # no other server holds the response it continues
        dispatcher = self._dispatcher
        if self._back_to_stable(failed, deadline):
            attempts.failure = failed  # the answer if the stable side finds no slot in time
            metrics.count_retry(asked, failed.code)
            self.retried_tries += 1  # counted on the side it arrived on: the candidate's
            return True
        if not should_retry(failed):
            return False
        settings = dispatcher.snapshot.retries
        attempts.tried |= {lease.provider_id}
        if (
            attempts.retries >= settings.max_per_request
            or asyncio.get_running_loop().time() >= deadline
        ):
            return False
        if not budget.try_retry(settings):
            metrics.count_retry_refused(asked, failed.code)
            return False
        attempts.retries += 1
        attempts.failure = failed
        metrics.count_retry(asked, failed.code)
        self.retried_tries += 1
        if not dispatcher.available_for(self._model, self._long, attempts.tried, self._side):
            fallback = self._reachable(attempts.chain, attempts.position + 1)
            if fallback is not None:
                attempts.position = fallback
                self._move_to(attempts.chain[fallback], "failed")
        return True

    def _back_to_stable(self, failed: RunFailed, deadline: float) -> bool:
        """Whether a failed try on a candidate's view of a model on trial is tried again on the
        stable revision's (once: the request stays there): a 5xx, an upstream that did not know
        the served name or key, or any failure worth a retry, while the deadline allows."""
        if self._side != CANDIDATE:
            return False
        split = self._dispatcher.split
        if split is None or self._model not in split.shared:
            return False
        status = failed.status or 0
        if not (status >= 500 or status in _CONFIG_FAULTS or should_retry(failed)):
            return False
        if asyncio.get_running_loop().time() >= deadline:
            return False
        self._side = STABLE
        pool_model = self._dispatcher.model_view(self._model, STABLE)
        if pool_model is not None:
            apply_policy(self._request, pool_model.generation)
        return True

    async def _first_lease(self, attempts: _Attempts, budget: RetryBudget) -> Lease:
        """The first slot of a request whose model has fallbacks.

        Its own model's when one is free. When every provider of it is busy (held by other
        requests), a free slot of a fallback model in dispatch, if the retry budget has room
        (a spill is paid like a retry, so a flood of one model cannot swamp its fallbacks);
        otherwise the request waits in its own model's queue and in those of its fallbacks at
        once (`_race`).
        """
        dispatcher = self._dispatcher
        lease = dispatcher.try_acquire(
            self._model, self._long, side=self._side, priority=self._priority
        )
        if lease is not None:
            return lease
        fallbacks = [
            model
            for model in attempts.chain[attempts.position + 1 :]
            if dispatcher.available_for(model, self._long, side=self._side)
        ]
        # A provider with room sits out a moment (a busy refusal, a failure): its slot is free
        # again in 50 ms, and a failure's retry has rules of its own.
        if not fallbacks or not self._all_held(self._model):
            return await self._own_queue()
        free = self._free_fallback(fallbacks)
        if free is None:
            return await self._race(fallbacks, attempts, budget)
        model, lease = free
        if not budget.try_retry(dispatcher.snapshot.retries):
            dispatcher.release(lease)
            return await self._own_queue()
        self._spill(attempts, model)
        return lease

    async def _own_queue(self, deadline: float | None = None) -> Lease:
        return await self._dispatcher.acquire(
            self._model,
            self._long,
            deadline=deadline,
            principal=self._principal.principal_ref,
            side=self._side,
            priority=self._priority,
            promise=self._promise() if deadline is None else b"",
        )

    def _promise(self) -> bytes:
        """A sheddable request's identity for the dispatcher's promises: its principal and its
        document (the client's resent request reads the same); b"" for any other."""
        if not self._priority.sheddable:
            return b""
        digest = hashlib.blake2b(self._principal.principal_ref.encode(), digest_size=16)
        digest.update(orjson.dumps(self._request.document))
        return digest.digest()

    def _free_fallback(self, fallbacks: list[str]) -> tuple[str, Lease] | None:
        """The first fallback model with a free slot, and the slot."""
        for model in fallbacks:
            try:
                lease = self._dispatcher.try_acquire(
                    model, self._long, side=self._side, priority=self._priority
                )
            except (NoProvider, ModelNotFound):
                continue
            if lease is not None:
                return model, lease
        return None

    async def _race(self, fallbacks: list[str], attempts: _Attempts, budget: RetryBudget) -> Lease:
        """Wait in the queues of the request's own model and of its fallbacks at once, with its
        own model's deadline, and take whichever slot comes first (a fallback's within the
        retry budget); the other places in line are given up."""
        dispatcher = self._dispatcher
        settings = dispatcher.snapshot.retries
        pool_model = dispatcher.model_view(self._model, self._side)
        assert pool_model is not None  # its own queue was tried just before, in this turn
        deadline = asyncio.get_running_loop().time() + pool_model.queue_timeout_s
        racers = {asyncio.ensure_future(self._own_queue()): self._model}
        for model in fallbacks:
            waiting = dispatcher.acquire(
                model,
                self._long,
                deadline=deadline,
                principal=self._principal.principal_ref,
                side=self._side,
                priority=self._priority,
            )
            racers[asyncio.ensure_future(waiting)] = model
        try:
            while True:
                done, _ = await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
                won: Lease | None = None
                for racer in [racer for racer in racers if racer in done]:  # chain order
                    model = racers.pop(racer)
                    error = racer.exception()
                    if error is not None:
                        if model == self._model:
                            raise error  # its own queue is full, or its deadline passed
                        continue
                    lease = racer.result()
                    if won is None and (model == self._model or budget.try_retry(settings)):
                        won = lease
                        if model != self._model:
                            self._spill(attempts, model)
                    else:
                        dispatcher.release(lease)
                if won is not None:
                    return won
        finally:
            for racer in racers:
                racer.cancel()
            for racer, _ in zip(
                racers, await asyncio.gather(*racers, return_exceptions=True), strict=True
            ):
                if not racer.cancelled() and racer.exception() is None:
                    dispatcher.release(racer.result())  # granted as another one won

    def _all_held(self, model_id: str) -> bool:
        """Every provider of the model in dispatch has its slots taken by other runs."""
        dispatcher = self._dispatcher
        pool_model = dispatcher.model_view(model_id, self._side)
        if pool_model is None:
            return False
        available = dispatcher.available
        return not any(
            candidate.provider.id in available
            and dispatcher.in_flight(candidate.provider.id) < candidate.provider.capacity
            for candidate in pool_model.candidates
        )

    def _spill(self, attempts: _Attempts, model: str) -> None:
        """The request's own model is busy: a slot of fallback `model` serves it."""
        attempts.position = attempts.chain.index(model)
        self._move_to(model, "busy")

    def _fall_back_if_unavailable(self, attempts: _Attempts) -> None:
        """Before the first try: a model with no provider in dispatch hands the request to the
        first fallback that has one (or, with none, that has an enabled one to wait for)."""
        chain = attempts.chain
        position = self._reachable(chain, 0)
        if position is None:
            dispatcher = self._dispatcher
            position = next(
                (
                    i
                    for i, model in enumerate(chain)
                    if dispatcher.serves(model, self._long, self._side)
                ),
                0,
            )
        if position:
            attempts.position = position
            self._move_to(chain[position], "unavailable")

    def _reachable(self, chain: tuple[str, ...], start: int) -> int | None:
        """The position in `chain`, from `start`, of the first model with a provider in
        dispatch that can take this request."""
        dispatcher = self._dispatcher
        for position in range(start, len(chain)):
            if dispatcher.available_for(chain[position], self._long, side=self._side):
                return position
        return None

    def _move_to(self, model_id: str, reason: str) -> None:
        """Hand the request to fallback model `model_id`: its policy, its metrics."""
        self._metrics.count_fallback(self._request.model, model_id, reason)
        self._model = model_id
        self._why = f"fallback from {self._request.model}: {reason}"
        pool_model = self._dispatcher.model_view(model_id, self._side)
        if pool_model is not None:
            apply_policy(self._request, pool_model.generation)

    def _engine_priority(self, lease: Lease) -> int | None:
        """The `priority` the lease's server gets (vLLM's: lower first), or None: the server
        does not schedule by one (`providers[].engine_priority`)."""
        limits = lease.snapshot.providers.get(lease.provider_id)
        return -self._priority.level if limits is not None and limits.engine_priority else None

    async def _start(self, lease: Lease) -> RunEvent:
        request = self._request
        trace = self._trace
        traceparent = self._traceparent
        if trace is not None:
            traceparent = trace.run_started(lease, self._model, self._why)
        stream = self._hub.run(
            RunRequest(
                run_id=self._next_run_id(),
                provider_id=lease.provider_id,
                served_model=lease.served_model,
                kind=request.kind,
                body=request.encode(lease.served_model, self._engine_priority(lease)),
                stream=request.stream,
                long_context=self._long,
                max_response_bytes=lease.snapshot.config.openai.max_response_bytes,
                sse_chunks=request.stream,
                traceparent=traceparent,
            )
        )
        await stream.__aenter__()
        self._stream = stream
        events = stream.__aiter__()
        self._events = events
        pool_model = self._dispatcher.model_view(self._model, self._side)
        limit = pool_model.first_byte_timeout_s if pool_model is not None else None
        try:
            if limit is None:
                return await anext(events)
            try:
                async with asyncio.timeout(limit):
                    return await anext(events)
            except TimeoutError:
                pass
        except BaseException as exc:
            await self._close_stream(type(exc), exc, exc.__traceback__)
            raise
        # No first byte in time: the run is cancelled on its Node, which counts it against the
        # provider's health, and this try failed.
        stream.cancel(first_byte_timeout=True)
        await self._close_stream(None, None, None)
        return wire_statuses.failure(
            wire_statuses.UPSTREAM_TIMEOUT,
            f"no first byte from provider {lease.provider_id!r} within "
            f"{limit * 1000:g} ms (models[{self._model}].first_byte_timeout_ms)",
        )

    async def _close_stream(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stream, self._stream, self._events = self._stream, None, None
        if stream is not None:
            await stream.__aexit__(exc_type, exc, tb)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._close_stream(exc_type, exc, tb)
        finally:
            if self._lease is not None:
                if self.spent is None and self._delivered:
                    self._meter_delivered(self._lease)
                self._dispatcher.release(self._lease)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> RunEvent:
        event = self._first
        if event is not None:
            self._first = None
        else:
            if self._events is None:
                raise StopAsyncIteration
            event = await anext(self._events)
        if isinstance(event, RunChunk):
            if self._request.stream and not event.usage_only:
                self._delivered += event.data.count(b"\n\n") if event.sse else 1
        elif isinstance(event, RunUsage):
            self._meter(event)
        return event

    def take_ready(self) -> list[RunEvent]:
        """The events that already arrived, without waiting (see `RunEvents.take_ready`)."""
        taken: list[RunEvent] = []
        if self._first is not None:
            taken.append(self._first)
            self._first = None
        if self._stream is not None and not (taken and isinstance(taken[0], TERMINAL_EVENTS)):
            taken.extend(self._stream.take_ready())
        stream = self._request.stream
        for event in taken:
            if isinstance(event, RunChunk):
                if stream and not event.usage_only:
                    self._delivered += event.data.count(b"\n\n") if event.sse else 1
            elif isinstance(event, RunUsage):
                self._meter(event)
        return taken

    def _meter(self, usage: RunUsage) -> None:
        lease = self._lease
        assert lease is not None
        self.spent = usage.total_tokens or usage.prompt_tokens + usage.completion_tokens
        if self._trace is not None:
            self._trace.usage(usage)
        self._metrics.count_usage(
            self._principal,
            self._model,
            lease.provider_id,
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens,
        )

    def _meter_delivered(self, lease: Lease) -> None:
        """A stream that ended before its usage (its client left, its run was cancelled) is
        charged what it delivered: the input estimate and one token per event passed on, the
        upstreams' usual one token per chunk (docs/reliability.md, "Bodies and budgets that
        could be gamed")."""
        prompt = estimate_tokens(self._request)
        self.spent = prompt + self._delivered
        self._metrics.count_usage(
            self._principal,
            self._model,
            lease.provider_id,
            prompt,
            self._delivered,
            self.spent,
        )
