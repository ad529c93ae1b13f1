"""Selecting the provider that takes a request now, and taking its slot.

`Selector` holds what dispatch reads on every request: the snapshot in force (and, while a change
is on trial, the split with the stable revision's view: `splits.py`), the providers available now,
each provider's `Slots` (`slots.py`, kept by provider id across snapshots) and the `Chooser`. It
routes a request to its model's view, keeps the candidates that can take it now (available, not
avoided, room) of the lowest priority, and takes the least recently used of them (round robin,
inline) or lets `choosing.py` pick among them; it takes the slot as a `Lease` and gives it back.
The dispatcher (`dispatching.py`) owns it and decides when a request waits instead.
"""

from __future__ import annotations

from ..errors import ModelNotFound, NoProvider
from .choosing import HOME, ROUND_ROBIN, Chooser, PrefixKey
from .slots import Lease, Slots, has_room
from .snapshots import Candidate, PoolModel, PoolSnapshot
from .splits import Split

#: What a freed slot of a provider can serve: (the stable view, the model, its candidate entry).
Freed = tuple[tuple[bool, PoolModel, Candidate], ...]


class Selector:
    """The pool's live view of its providers, and the choice of one for a request."""

    def __init__(self, snapshot: PoolSnapshot) -> None:
        self.snapshot = snapshot
        #: The change on trial, if any: which requests the stable revision's view serves.
        self.split: Split | None = None
        #: The providers of connected nodes that are healthy now (the hub's view).
        self.available: frozenset[str] = frozenset()
        self.slots: dict[str, Slots] = {}
        self.chooser = Chooser()
        # What a freed slot of each provider can serve, made when first needed after a swap.
        self._freed: dict[str, Freed] = {}
        # The dispatch stamp of the latest run given (`Slots.last_used`).
        self._stamp = 0
        self.add_slots(snapshot)

    def add_slots(self, snapshot: PoolSnapshot) -> None:
        for provider_id in snapshot.providers:
            if provider_id not in self.slots:
                self.slots[provider_id] = Slots()

    def set_split(self, split: Split | None) -> None:
        self.split = split
        self._freed = {}

    def drop_idle_slots(self) -> None:
        """Forget the counters of providers no view has any more, once nothing runs there."""
        current = self.snapshot.providers
        kept = self.split.stable.providers if self.split is not None else {}
        for provider_id in [
            pid
            for pid, slots in self.slots.items()
            if pid not in current and pid not in kept and slots.in_flight == 0
        ]:
            del self.slots[provider_id]

    def route(self, model_id: str, long: bool, stable_view: bool = False) -> PoolModel:
        """The model's view the request runs on, or the error that says why none serves it."""
        split = self.split
        if stable_view and split is not None:
            pool_model = split.stable.models.get(model_id)
        else:
            pool_model = self.snapshot.models.get(model_id)
        if pool_model is None:
            raise ModelNotFound(model_id)
        if not pool_model.candidates:
            raise NoProvider(f"No enabled provider serves model `{model_id}` now.")
        if long and not pool_model.takes_long:
            raise NoProvider(
                f"No enabled provider of model `{model_id}` takes long-context requests "
                f"(estimated input tokens >= {self.snapshot.long_context_threshold_tokens})."
            )
        return pool_model

    def others_available(self, pool_model: PoolModel, long: bool, avoid: frozenset[str]) -> bool:
        available = self.available
        for candidate in pool_model.candidates:
            limits = candidate.provider
            if (
                limits.id in available
                and limits.id not in avoid
                and (not long or limits.takes_long)
            ):
                return True
        return False

    def swap_here(self, pool_model: PoolModel, provider_id: str) -> bool:
        """A request of the adapter `pool_model` would wait for a swap at `provider_id`, while
        another available candidate of it, busy, has the adapter loaded or room for it."""
        adapter = pool_model.adapter
        assert adapter is not None
        chooser, all_slots = self.chooser, self.slots
        if chooser.adapter_tier(adapter, provider_id, all_slots[provider_id]) < 3:
            return False
        return any(
            c.provider.id != provider_id
            and c.provider.id in self.available
            and all_slots[c.provider.id].in_flight > 0
            and chooser.adapter_tier(adapter, c.provider.id, all_slots[c.provider.id]) < 3
            for c in pool_model.candidates
        )

    def select(
        self,
        pool_model: PoolModel,
        long: bool,
        avoid: frozenset[str] = frozenset(),
        prefix: PrefixKey | None = None,
        home: str = "",
    ) -> tuple[Candidate, int] | None:
        """The candidate that takes the request now (counted as chosen) and the prompt bytes it
        is expected to prefill (`Lease.prefill`), or None; only `home` when one is given."""
        if home:
            return self._at_home(pool_model, long, home)
        if pool_model.dispatch.policy != ROUND_ROBIN or pool_model.base_model is not None:
            return self._choose(pool_model, long, avoid, prefix)
        available = self.available
        all_slots = self.slots
        best: Candidate | None = None
        best_used = 0
        best_priority = 0
        for candidate in pool_model.candidates:
            limits = candidate.provider
            if best is not None and limits.priority != best_priority:
                break  # candidates are sorted by priority: a free one was found above
            if limits.id not in available or (avoid and limits.id in avoid):
                continue
            slots = all_slots[limits.id]
            if not has_room(limits, slots, long):
                continue
            if best is None or slots.last_used < best_used:
                best, best_used, best_priority = candidate, slots.last_used, limits.priority
        if best is None:
            return None
        self.chooser.count(pool_model.id, ROUND_ROBIN, ROUND_ROBIN)
        return best, 0

    def _at_home(
        self, pool_model: PoolModel, long: bool, home: str
    ) -> tuple[Candidate, int] | None:
        """`home`, the one candidate a request may run on, when it can take it now."""
        if home not in self.available:
            return None
        for candidate in pool_model.candidates:
            limits = candidate.provider
            if limits.id == home:
                if (long and not limits.takes_long) or not has_room(limits, self.slots[home], long):
                    return None
                self.chooser.count(pool_model.id, pool_model.dispatch.policy, HOME)
                return candidate, 0
        return None

    def _choose(
        self,
        pool_model: PoolModel,
        long: bool,
        avoid: frozenset[str],
        prefix: PrefixKey | None,
    ) -> tuple[Candidate, int] | None:
        """`select` for the policies of `choosing.py`: the same filter and priority, then the
        policy picks among the free candidates of the best priority."""
        available = self.available
        all_slots = self.slots
        group: list[Candidate] = []
        free: list[Candidate] = []
        priority: int | None = None
        for candidate in pool_model.candidates:
            limits = candidate.provider
            if limits.priority != priority:
                if free:
                    break  # candidates are sorted by priority: this level has a free one
                group = []
                priority = limits.priority
            if limits.id not in available or (avoid and limits.id in avoid):
                continue
            if long and not limits.takes_long:
                continue
            group.append(candidate)
            if has_room(limits, all_slots[limits.id], long):
                free.append(candidate)
        if not free:
            return None
        adapter = pool_model.adapter
        if adapter is not None and self.chooser.only_swaps(adapter, group, free, all_slots):
            return None  # it waits for a slot of a server that holds its adapter, or has room
        return self.chooser.choose(pool_model, group, free, prefix, all_slots)

    def take(
        self,
        pool_model: PoolModel,
        candidate: Candidate,
        prefill: int,
        long: bool,
        deadline: float,
        waited_s: float = 0.0,
        sheddable: bool = False,
    ) -> Lease:
        """A slot on `candidate`'s provider for one run, counted there."""
        limits = candidate.provider
        slots = self.slots[limits.id]
        slots.in_flight += 1
        slots.prefill += prefill
        if long:
            slots.long_in_flight += 1
        if pool_model.base_model is not None:
            slots.sent(pool_model.id)
        self._stamp += 1
        slots.last_used = self._stamp
        return Lease(
            provider_id=limits.id,
            node_id=limits.node_id,
            served_model=candidate.served_model,
            long=long,
            pool_model=pool_model,
            snapshot=self.snapshot,
            deadline=deadline,
            waited_s=waited_s,
            prefill=prefill,
            sheddable=sheddable,
        )

    def give_back(self, lease: Lease) -> Slots | None:
        """Free the lease's slots once; None when it was already given back."""
        if lease.released:
            return None
        lease.released = True
        slots = self.slots[lease.provider_id]
        slots.in_flight -= 1
        slots.prefill -= lease.prefill
        if lease.long:
            slots.long_in_flight -= 1
        if lease.pool_model.base_model is not None:
            slots.ended(lease.pool_model.id)
        return slots

    def freed(self, provider_id: str) -> Freed:
        """What a freed slot of `provider_id` can serve: the models it is an enabled candidate
        of, in the snapshot's view, and in the stable one's for the models shared by a split."""
        pairs = self._freed.get(provider_id)
        if pairs is None:
            pairs = tuple(
                (False, pool_model, candidate)
                for pool_model, candidate in self.snapshot.models_by_provider.get(provider_id, ())
            )
            split = self.split
            if split is not None:
                pairs += tuple(
                    (True, pool_model, candidate)
                    for pool_model, candidate in split.stable.models_by_provider.get(
                        provider_id, ()
                    )
                    if pool_model.id in split.shared
                )
            self._freed[provider_id] = pairs
        return pairs
