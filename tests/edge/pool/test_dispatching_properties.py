"""The pool's invariants under any sequence of requests, retries that avoid the providers they
tried, releases, cancellations, swaps and node changes, under every dispatch policy (each model
draws its own, and a swap may change it) with prompts of a few prefixes and load reports from the
Nodes, and changes on trial: a swap may keep the stable snapshot beside the new one for some
models, requests come on either side, the share moves and the trial ends; and requests of three
priority classes, one of them sheddable (a hypothesis state machine over a real event loop)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from iop.edge.errors import EdgeError
from iop.edge.hub.protocol import ProviderLoad
from iop.edge.pool.choosing import PrefixKey
from iop.edge.pool.dispatching import Dispatcher
from iop.edge.pool.priorities import Priority
from iop.edge.pool.selecting import Selector
from iop.edge.pool.slots import Lease
from iop.edge.pool.snapshots import PoolSnapshot
from iop.edge.pool.splits import Side, Split
from iop.edgeconfig import EdgeConfig
from iop.wire.nodestates import ServerLoad

PROVIDERS = ("a", "b", "c")
MODELS = {"x": ["a", "b"], "y": ["b", "c"], "z": ["c"]}
POLICIES = ("round_robin", "least_load", "prefix_affinity")
CLASSES = ("high", "standard", "sheddable")
PRIORITY = {
    "classes": [
        {"name": "high", "priority": 5},
        {"name": "standard", "priority": 0},
        {"name": "sheddable", "priority": -1},
    ]
}
#: Prompts of three conversations, a few turns each (None: a request without a prefix).
PREFIXES = [None] + [
    PrefixKey(tuple(f"{conversation}-{turn}".encode() for turn in range(turns)))
    for conversation in "pqr"
    for turns in (1, 2, 3)
]
PROVIDER_SETTINGS = st.fixed_dictionaries(
    {
        pid: st.tuples(
            st.integers(1, 3),
            st.sampled_from([None, 1]),
            # Mostly one priority, mostly enabled: a policy chooses only among equals, and a
            # chooser that takes a full provider is found in the default number of examples.
            st.sampled_from([0, 0, 0, 1, 2]),
            st.sampled_from([True, True, True, False]),
        )
        for pid in PROVIDERS
    }
)
DISPATCH_SETTINGS = st.fixed_dictionaries(
    {
        model: st.tuples(st.sampled_from(POLICIES), st.sampled_from([1.0, 1.25, 3.0]))
        for model in MODELS
    }
)


class CheckedSelector(Selector):
    """The selector, each slot it gives checked against its view's capacity as it is given (a
    request granted on a stable view and one on the candidate's may then share a provider up to
    the candidate's larger capacity: checked later, the first would look over its own)."""

    def __init__(self, snapshot: PoolSnapshot) -> None:
        super().__init__(snapshot)
        self.over_capacity: list[str] = []

    def take(self, pool_model, candidate, *args, **kwargs):
        lease = super().take(pool_model, candidate, *args, **kwargs)
        if self.slots[candidate.provider.id].in_flight > candidate.provider.capacity:
            self.over_capacity.append(candidate.provider.id)
        return lease


class CheckedDispatcher(Dispatcher):
    """The dispatcher over a `CheckedSelector`."""

    def __init__(self, snapshot: PoolSnapshot) -> None:
        super().__init__(snapshot)
        self._selector = CheckedSelector(snapshot)
        self.over_capacity = self._selector.over_capacity


class PoolMachine(RuleBasedStateMachine):
    # The conftest helpers, set by the test (a state machine is built without arguments).
    config_of: Callable[..., EdgeConfig]
    provider: Callable[..., dict[str, Any]]

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.generation = 1
        self.leases: list[Lease] = []
        #: Leases ever given (each must be one counted dispatch choice).
        self.given = 0
        self.waiting: list[asyncio.Task[Lease]] = []
        #: A waiting request's (model, long, priority), when it is a first try (not a retry).
        self.first_tries: dict[asyncio.Task[Lease], tuple[str, bool, Priority]] = {}
        #: Requests given a slot while one of a higher priority waited for the same candidates.
        self.overtaken: list[tuple[Priority, Priority]] = []

    def config(
        self,
        settings: dict[str, tuple[int, int | None, int, bool]],
        dispatch: dict[str, tuple[str, float]],
    ):
        providers = [
            self.provider(
                pid,
                capacity=capacity,
                long_context_slots=long_slots,
                priority=priority,
                enabled=enabled,
                max_queue=3,
                queue_timeout_ms=600_000,
            )
            for pid, (capacity, long_slots, priority, enabled) in settings.items()
        ]
        # Keep every model valid: its first provider always takes long requests when enabled.
        policies = {
            model: {"dispatch": {"policy": policy, "load_factor": factor}}
            for model, (policy, factor) in dispatch.items()
        }
        return self.config_of(
            providers, MODELS, model_settings=policies, openai={"priority": PRIORITY}
        )

    @initialize(settings=PROVIDER_SETTINGS, dispatch=DISPATCH_SETTINGS)
    def start(self, settings, dispatch) -> None:
        self.dispatcher = CheckedDispatcher(PoolSnapshot.build(self.config(settings, dispatch)))
        self.dispatcher.set_available(PROVIDERS)
        self.loads: dict[str, ProviderLoad] = {}
        self.dispatcher.watch_loads(self.loads)

    def settle(self) -> None:
        async def spin() -> None:
            for _ in range(4):
                await asyncio.sleep(0)

        self.loop.run_until_complete(spin())
        granted = []
        for task in [t for t in self.waiting if t.done()]:
            self.waiting.remove(task)
            first = self.first_tries.pop(task, None)
            if not task.cancelled() and task.exception() is None:
                self.admitted(task.result())
                if first is not None:
                    granted.append(first)
        if self.dispatcher.split is not None:
            return  # two views of a model wait for different candidates
        for model, long, priority in granted:
            for other_model, other_long, other in self.first_tries.values():
                if (other_model, other_long) == (model, long) and other.level > priority.level:
                    self.overtaken.append((priority, other))

    def admitted(self, lease: Lease) -> None:
        candidate = lease.pool_model.candidate(lease.provider_id)
        assert candidate is not None  # a lease is on one of the model's candidates in its view
        self.leases.append(lease)
        self.given += 1

    @rule(
        model=st.sampled_from(sorted(MODELS)),
        long=st.booleans(),
        prefix=st.sampled_from(PREFIXES),
        side=st.sampled_from([0, 1]),
        klass=st.sampled_from(CLASSES),
    )
    def request(
        self, model: str, long: bool, prefix: PrefixKey | None, side: Side, klass: str
    ) -> None:
        priority = self.dispatcher.snapshot.priorities.classes[klass]

        async def try_now() -> None:
            try:
                lease = self.dispatcher.try_acquire(model, long, prefix, side, priority)
            except EdgeError:
                return
            if lease is not None:
                self.admitted(lease)
            else:
                task = asyncio.ensure_future(
                    self.dispatcher.acquire(
                        model, long, prefix=prefix, side=side, priority=priority
                    )
                )
                self.waiting.append(task)
                self.first_tries[task] = (model, long, priority)

        self.loop.run_until_complete(try_now())
        self.settle()

    @rule(
        model=st.sampled_from(sorted(MODELS)),
        classes=st.lists(st.sampled_from(CLASSES), min_size=2, max_size=6),
    )
    def crowd(self, model: str, classes: list[str]) -> None:
        """Requests of several classes at once for one model: a queue of mixed priorities."""
        for klass in classes:
            self.request(model, False, None, 0, klass)

    @rule(
        model=st.sampled_from(sorted(MODELS)),
        long=st.booleans(),
        avoid=st.frozensets(st.sampled_from(PROVIDERS), min_size=1, max_size=2),
        prefix=st.sampled_from(PREFIXES),
        side=st.sampled_from([0, 1]),
    )
    def retry(
        self, model: str, long: bool, avoid: frozenset[str], prefix: PrefixKey | None, side: Side
    ) -> None:
        async def acquire() -> None:
            deadline = asyncio.get_running_loop().time() + 600
            task = asyncio.ensure_future(
                self.dispatcher.acquire(
                    model, long, deadline=deadline, avoid=avoid, prefix=prefix, side=side
                )
            )
            self.waiting.append(task)

        self.loop.run_until_complete(acquire())
        self.settle()

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        lease = self.leases.pop(index % len(self.leases))
        self.dispatcher.release(lease)
        self.settle()

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100))
    def client_leaves(self, index: int) -> None:
        self.waiting[index % len(self.waiting)].cancel()
        self.settle()

    @rule(
        settings=PROVIDER_SETTINGS,
        dispatch=DISPATCH_SETTINGS,
        shared=st.none() | st.frozensets(st.sampled_from(sorted(MODELS))),
        share=st.integers(1, 100),
    )
    def swap(self, settings, dispatch, shared: frozenset[str] | None, share: int) -> None:
        """A change; with `shared`, on trial: the stable snapshot (the one on trial beside the
        current one, if any) keeps serving its side of those models."""
        self.generation += 1
        snapshot = PoolSnapshot.build(self.config(settings, dispatch), self.generation)
        split = None
        if shared is not None:
            current = self.dispatcher.split
            stable = current.stable if current is not None else self.dispatcher.snapshot
            split = Split(stable, frozenset(MODELS), shared, share)
        self.dispatcher.swap(snapshot, split)
        self.settle()

    @precondition(lambda self: hasattr(self, "dispatcher") and self.dispatcher.split is not None)
    @rule(share=st.integers(1, 100))
    def share_moves(self, share: int) -> None:
        self.dispatcher.set_share(share)
        self.settle()

    @precondition(lambda self: hasattr(self, "dispatcher") and self.dispatcher.split is not None)
    @rule()
    def trial_promoted(self) -> None:
        self.dispatcher.end_split()
        self.settle()

    @rule(
        provider=st.sampled_from(PROVIDERS),
        node_in_flight=st.integers(0, 6),
        elsewhere=st.integers(0, 6),
        server=st.none()
        | st.tuples(
            st.integers(0, 6), st.integers(0, 6), st.floats(0, 1), st.just(0.0), st.integers(0, 6)
        ),
    )
    def node_reports_load(
        self,
        provider: str,
        node_in_flight: int,
        elsewhere: int,
        server: tuple[int, int, float, float, int] | None,
    ) -> None:
        """A heartbeat: other Edges' runs and the server's own queue, which may say anything."""
        report = ServerLoad(*server) if server is not None else None
        self.loads[provider] = ProviderLoad(node_in_flight, report, time.monotonic(), elsewhere)

    @rule(up=st.sets(st.sampled_from(PROVIDERS)))
    def nodes_change(self, up: set[str]) -> None:
        self.dispatcher.set_available(up)
        self.settle()

    @invariant()
    def slots_match_leases(self) -> None:
        if not hasattr(self, "dispatcher"):
            return
        for pid in PROVIDERS:
            mine = [lease for lease in self.leases if lease.provider_id == pid]
            assert self.dispatcher.in_flight(pid) == len(mine)
            assert self.dispatcher.long_in_flight(pid) == sum(lease.long for lease in mine)

    @invariant()
    def admissions_respect_capacity(self) -> None:
        if hasattr(self, "dispatcher"):
            assert not self.dispatcher.over_capacity

    @invariant()
    def no_request_overtakes_a_higher_class(self) -> None:
        assert not self.overtaken

    @invariant()
    def every_lease_is_one_counted_choice(self) -> None:
        if hasattr(self, "dispatcher"):
            assert sum(self.dispatcher.decisions().values()) == self.given

    @invariant()
    def queue_depth_matches_waiting_requests(self) -> None:
        if hasattr(self, "dispatcher"):
            assert self.dispatcher.waiting == len(self.waiting)

    @invariant()
    def no_request_waits_while_a_candidate_is_free(self) -> None:
        if not hasattr(self, "dispatcher"):
            return
        snapshot = self.dispatcher.snapshot
        split = self.dispatcher.split
        available = self.dispatcher.available
        for (model, long, stable_view, _), queue in self.dispatcher._waiters.queues.items():
            assert queue
            assert not stable_view or (split is not None and model in split.shared)
            view = split.stable if stable_view and split is not None else snapshot
            candidates = [
                c.provider for c in view.models[model].candidates if c.provider.id in available
            ]
            for waiter in queue.in_order():
                # A retry takes none of the providers it tried while another one is available.
                untried = [
                    p for p in candidates if p.id not in waiter.avoid and (not long or p.takes_long)
                ]
                for limits in untried if waiter.avoid and untried else candidates:
                    full = self.dispatcher.in_flight(limits.id) >= limits.capacity
                    long_full = (
                        long
                        and limits.long_context_slots is not None
                        and self.dispatcher.long_in_flight(limits.id) >= limits.long_context_slots
                    )
                    assert full or long_full, (model, long, limits, waiter.avoid)

    def teardown(self) -> None:
        for task in self.waiting:
            task.cancel()
        if self.waiting:
            self.loop.run_until_complete(asyncio.gather(*self.waiting, return_exceptions=True))
        if hasattr(self, "dispatcher"):
            self.dispatcher.close()
        self.loop.close()


def test_pool_invariants(config_of, provider) -> None:
    class Machine(PoolMachine):
        pass

    Machine.config_of = staticmethod(config_of)
    Machine.provider = staticmethod(provider)
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
