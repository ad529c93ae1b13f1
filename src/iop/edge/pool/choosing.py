"""Choosing among equals: which of a model's best free candidates takes a request.

The dispatcher's `Selector` (`selecting.py`) filters candidates and ranks them by priority as the
specification says; this module only picks among the providers of the lowest priority that have
a free slot, by the model's `dispatch.policy`: `least_load` (the lowest load for its capacity:
this Edge's runs, plus what Nodes and model servers report) or `prefix_affinity` (the home of
the prompt's prefix, from `prefixes.py`, within a bounded load, unless the prompt bytes waiting
for their prefill there, its own included, are more than elsewhere). The default, `round_robin`, the
dispatcher does inline for a model: nothing here is on its path. A LoRA adapter's request first
narrows the free candidates to the servers most ready for its adapter (loaded, then room to load
it, then a swap: `Chooser.adapter_tier`), then its model's policy picks among those.
docs/edge.md, "Choosing among equals" and "LoRA adapters", has each policy's rules and the
reasons every choice is counted by.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from ..hub import ProviderLoad
from .snapshots import Candidate, PoolModel

#: The specification's tie rule, the default policy; also the reason of its choices.
ROUND_ROBIN: Final = "round_robin"
#: The least loaded for its capacity; also the reason of a choice by load alone.
LEAST_LOAD: Final = "least_load"
#: The policy that sends a prompt's prefix back to where it went.
PREFIX_AFFINITY: Final = "prefix_affinity"
#: prefix_affinity sent the request to its prefix's home.
AFFINITY: Final = "affinity"
#: The prefix's home was past its bound or full: the least loaded free candidate took it.
OVERFLOW: Final = "overflow"
#: The prefix's home had more prompt bytes waiting for their prefill, the request's own
#: included, than another free candidate with the whole prompt: that one took it.
BACKLOG: Final = "backlog"
#: A waiting request took the slot that freed first (any policy).
FREED_SLOT: Final = "freed_slot"
#: prefix_affinity: a waiting request took a freed slot of its prefix's home, ahead of the
#: queue's fair head that has nothing cached there (`Dispatcher._cached_here`).
FREED_SLOT_HOME: Final = "freed_slot_home"
#: The request continues a stored response: the provider that holds it took it (any policy).
HOME: Final = "response_home"
#: A LoRA adapter's request went to a server that has the adapter loaded (or on its way).
ADAPTER_LOADED: Final = "adapter_loaded"
#: ... to a server with room to load it now (no free candidate had it loaded).
ADAPTER_ROOM: Final = "adapter_room"
#: ... to a server whose adapter slots all serve other adapters' requests: it waits for a swap
#: there (every free candidate was so).
ADAPTER_SWAP: Final = "adapter_swap"
#: Every reason of `iop_edge_dispatch_total`, in the order status pages list them.
DISPATCH_REASONS: Final = (
    ROUND_ROBIN,
    LEAST_LOAD,
    AFFINITY,
    OVERFLOW,
    BACKLOG,
    FREED_SLOT,
    FREED_SLOT_HOME,
    HOME,
    ADAPTER_LOADED,
    ADAPTER_ROOM,
    ADAPTER_SWAP,
)
#: The adapter tiers, best first: loaded, a free adapter slot, room by evicting an idle
#: adapter, a swap to wait for; and the reason each is counted by.
_TIER_REASONS: Final = (ADAPTER_LOADED, ADAPTER_ROOM, ADAPTER_ROOM, ADAPTER_SWAP)

#: Seconds a Node's load report counts for (a few heartbeats; a probe interval of the bench's).
LOAD_REPORT_TTL_S: Final = 3.0
#: Seconds a server's word on its LoRA adapters counts for: which adapters it holds changes
#: slowly (at swaps), and its probe reads it only every few seconds (5 s by default).
ADAPTER_REPORT_TTL_S: Final = 15.0
#: The least share of the group's capacity its load counts as, for prefix_affinity's bound.
_BUSY_SHARE: Final = 0.5
#: Prefix points remembered per model (least recently used forgotten first): about 16 MB of
#: table at most, a few turns of some tens of thousands of conversations.
PREFIX_HOMES_PER_MODEL: Final = 131_072


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """A prompt as its prefix points, for `prefix_affinity`.

    `points` are hashes of the prompt's leading parts, each covering more of it than the one
    before (a chat prompt: one per message, from the conversation's first user message on; a text
    prompt: one per full block). `anchor` is the first of them: what identifies the conversation
    when no point is known. `sizes` are the prompt bytes each point covers, and `size` the whole
    prompt's: what a server that holds a point's prefix still has to prefill is `size` less the
    point's. `prefixes.py` has how they are made.
    """

    points: tuple[bytes, ...]
    sizes: tuple[int, ...] = ()
    size: int = 0

    @property
    def anchor(self) -> bytes:
        return self.points[0]


class SlotCounts(Protocol):
    """The dispatcher's counters of one provider, as a policy reads them."""

    @property
    def in_flight(self) -> int: ...

    @property
    def last_used(self) -> int: ...

    @property
    def prefill(self) -> int:
        """Prompt bytes of this Edge's runs on the provider that have no first event yet, less
        what each run's server was expected to hold (`Chooser.prefill`)."""
        ...

    @property
    def adapters(self) -> Mapping[str, int]:
        """This Edge's runs on the provider by LoRA adapter (adapters with none left out)."""
        ...

    @property
    def recent_adapters(self) -> Sequence[str]:
        """The LoRA adapters this Edge sent the provider lately, each once, the latest last."""
        ...


def rendezvous_order(anchor: bytes, candidates: Sequence[Candidate]) -> list[Candidate]:
    """`candidates` by rendezvous (highest random weight) hashing of `anchor`: the first is the
    anchor's home, the same on every replica; a provider that leaves moves only its own keys."""
    return sorted(
        candidates,
        key=lambda c: hashlib.blake2b(anchor + c.provider.id.encode(), digest_size=8).digest(),
        reverse=True,
    )


class _Homes:
    """One model's memory of where prefix points went (with the prompt bytes each covers),
    least recently used forgotten first."""

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: OrderedDict[bytes, tuple[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def find(self, key: PrefixKey) -> tuple[str, int] | None:
        """Where the deepest known point of `key` went, and the prompt bytes it covers."""
        table = self._table
        for point in reversed(key.points):
            home = table.get(point)
            if home is not None:
                return home
        return None

    def remember(self, key: PrefixKey, provider_id: str) -> None:
        table = self._table
        sizes = key.sizes
        for index, point in enumerate(key.points):
            table[point] = (provider_id, sizes[index] if index < len(sizes) else 0)
            table.move_to_end(point)
        while len(table) > PREFIX_HOMES_PER_MODEL:
            table.popitem(last=False)


class Chooser:
    """The policies' state: load reports, prefix homes per model, and the count of choices."""

    def __init__(self) -> None:
        self.loads: Mapping[str, ProviderLoad] = {}
        self._homes: dict[str, _Homes] = {}
        #: (model, policy, reason) -> choices made.
        self.decisions: dict[tuple[str, str, str], int] = {}

    def count(self, model_id: str, policy: str, reason: str) -> None:
        key = (model_id, policy, reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def load(self, provider_id: str, own: int, now: float | None = None) -> int:
        """The provider's load: this Edge's runs, other Edges' and other clients' (fresh)."""
        report = self.loads.get(provider_id)
        if report is None:
            return own
        if (time.monotonic() if now is None else now) - report.reported_at > LOAD_REPORT_TTL_S:
            return own
        load = own + report.elsewhere
        server = report.server
        if server is not None and server.age_s <= LOAD_REPORT_TTL_S:
            load += server.not_ours
        return load

    def server_waiting(self, provider_id: str) -> int:
        """Requests waiting in the provider's server's own queue, as last reported (fresh)."""
        report = self.loads.get(provider_id)
        if report is None or report.server is None:
            return 0
        if time.monotonic() - report.reported_at > LOAD_REPORT_TTL_S:
            return 0
        return report.server.waiting

    def kv_usage(self, provider_id: str, now: float) -> float:
        report = self.loads.get(provider_id)
        if report is None or report.server is None or now - report.reported_at > LOAD_REPORT_TTL_S:
            return 0.0
        return report.server.kv_cache_usage

    def prefix_homes(self, model_id: str) -> int:
        """Prefix points remembered for `model_id`."""
        homes = self._homes.get(model_id)
        return len(homes) if homes is not None else 0

    def keep_only(self, route_policies: Mapping[str, str]) -> None:
        """Forget the prefix homes of models gone or no longer on prefix_affinity (a swap)."""
        for model_id in [m for m in self._homes if route_policies.get(m) != PREFIX_AFFINITY]:
            del self._homes[model_id]

    def choose(
        self,
        pool_model: PoolModel,
        group: Sequence[Candidate],
        free: Sequence[Candidate],
        prefix: PrefixKey | None,
        slots: Mapping[str, SlotCounts],
    ) -> tuple[Candidate, int]:
        """The candidate of `free` (not empty, a subset of `group`) that takes the request, and
        the prompt bytes it is expected to prefill there (0 where the policy does not weigh
        them)."""
        policy = pool_model.dispatch.policy
        now = time.monotonic()
        adapter = pool_model.adapter
        by_adapter = ""
        if adapter is not None:
            # A LoRA adapter's request: the candidates of the best tier, then the policy.
            free, by_adapter = self._by_adapter(adapter, free, slots, now)
        prefill = 0
        if policy == PREFIX_AFFINITY and prefix is not None:
            chosen, reason, prefill = self._by_prefix(pool_model, group, free, prefix, slots, now)
            self.remember(pool_model.id, prefix, chosen.provider.id)
        elif policy == ROUND_ROBIN:
            chosen = min(free, key=lambda c: slots[c.provider.id].last_used)
            reason = ROUND_ROBIN
        else:
            chosen, reason = self._least_loaded(free, slots, now), LEAST_LOAD
        self.count(pool_model.id, policy, by_adapter or reason)
        return chosen, prefill

    def adapter_tier(
        self, adapter: str, provider_id: str, counts: SlotCounts, now: float | None = None
    ) -> int:
        """How ready the provider's server is for a request of the LoRA adapter `adapter`:
        0 loaded (a request of it runs or waits there, or this Edge sent it there among the
        server's last `max_loras` adapters: still in its slots, least recently used going
        first), 1 a free adapter slot, 2 room by evicting an idle adapter, 3 every slot held by
        other adapters' requests (it waits there for a swap).

        The server's word (`vllm:lora_requests_info`, fresh) and this Edge's own runs are
        joined: a report comes a probe interval late, this Edge's runs are always current.
        Without the server's `max_loras`, one slot is assumed.
        """
        report = self.loads.get(provider_id)
        server = None
        if report is not None and report.server is not None:
            age = (time.monotonic() if now is None else now) - report.reported_at
            if age <= ADAPTER_REPORT_TTL_S and report.server.age_s <= ADAPTER_REPORT_TTL_S:
                server = report.server
        active = {name for name, runs in counts.adapters.items() if runs > 0}
        limit = 0
        if server is not None:
            active |= server.active_adapters
            limit = server.max_loras
        lately = set(counts.recent_adapters[-(limit or 1) :])
        if adapter in active or adapter in lately:
            return 0
        if limit and len(active) >= limit:
            return 3
        return 1 if len(active | lately) < (limit or 1) else 2

    def only_swaps(
        self,
        adapter: str,
        group: Sequence[Candidate],
        free: Sequence[Candidate],
        slots: Mapping[str, SlotCounts],
    ) -> bool:
        """True when every free candidate would make a request of `adapter` wait for a swap
        while a busy one of `group` has it loaded or room for it: the request does better to
        wait at the Edge for that one's next free slot (a server keeps admitting the requests of
        the adapters it holds before a swap, so a request sent to swap may wait there for as
        long as they keep coming)."""
        now = time.monotonic()
        if any(
            self.adapter_tier(adapter, c.provider.id, slots[c.provider.id], now) < 3 for c in free
        ):
            return False
        return any(
            candidate not in free
            and slots[candidate.provider.id].in_flight > 0
            and self.adapter_tier(adapter, candidate.provider.id, slots[candidate.provider.id], now)
            < 3
            for candidate in group
        )

    def _by_adapter(
        self, adapter: str, free: Sequence[Candidate], slots: Mapping[str, SlotCounts], now: float
    ) -> tuple[list[Candidate], str]:
        """The free candidates of the best adapter tier (`adapter_tier`), and its reason."""
        best: list[Candidate] = []
        best_tier = len(_TIER_REASONS)
        for candidate in free:
            provider_id = candidate.provider.id
            tier = self.adapter_tier(adapter, provider_id, slots[provider_id], now)
            if tier < best_tier:
                best, best_tier = [candidate], tier
            elif tier == best_tier:
                best.append(candidate)
        return best, _TIER_REASONS[best_tier]

    def prefill(self, model_id: str, prefix: PrefixKey, provider_id: str) -> int:
        """The prompt bytes of `prefix` that `provider_id` is expected to prefill: what the
        deepest known point does not cover there, the whole prompt elsewhere."""
        homes = self._homes.get(model_id)
        found = homes.find(prefix) if homes is not None else None
        if found is not None and found[0] == provider_id:
            return max(0, prefix.size - found[1])
        return prefix.size

    def remember(self, model_id: str, prefix: PrefixKey, provider_id: str) -> None:
        """The request of `prefix` went to `provider_id`: its points' home from now on."""
        homes = self._homes.get(model_id)
        if homes is None:
            homes = self._homes[model_id] = _Homes()
        homes.remember(prefix, provider_id)

    def _least_loaded(
        self, free: Sequence[Candidate], slots: Mapping[str, SlotCounts], now: float
    ) -> Candidate:
        best = free[0]
        best_key: tuple[float, float, int] | None = None
        for candidate in free:
            limits = candidate.provider
            counts = slots[limits.id]
            key = (
                self.load(limits.id, counts.in_flight, now) / limits.capacity,
                self.kv_usage(limits.id, now),
                counts.last_used,
            )
            if best_key is None or key < best_key:
                best, best_key = candidate, key
        return best

    def _by_prefix(
        self,
        pool_model: PoolModel,
        group: Sequence[Candidate],
        free: Sequence[Candidate],
        prefix: PrefixKey,
        slots: Mapping[str, SlotCounts],
        now: float,
    ) -> tuple[Candidate, str, int]:
        loads = {
            c.provider.id: self.load(c.provider.id, slots[c.provider.id].in_flight, now)
            for c in group
        }
        order = rendezvous_order(prefix.anchor, group)
        home: Candidate | None = None
        held = 0
        homes = self._homes.get(pool_model.id)
        found = homes.find(prefix) if homes is not None else None
        if found is not None:
            home = next((c for c in group if c.provider.id == found[0]), None)
            held = found[1] if home is not None else 0
        known = home is not None
        if home is None:
            home = order[0]
        within = False
        if home in free:
            total_capacity = sum(c.provider.capacity for c in group)
            busy = max(sum(loads.values()) + 1, total_capacity * _BUSY_SHARE)
            limits = home.provider
            bound = math.ceil(
                pool_model.dispatch.load_factor * busy * limits.capacity / total_capacity
            )
            within = loads[limits.id] + 1 <= bound
        size = prefix.size
        if within and not known:
            # A prompt this Edge has not seen goes where the rendezvous sends it, as on every
            # other replica, which may have sent its conversation's earlier turns there.
            return home, AFFINITY, size
        # The time to a first token is mostly prefill: the request's own prompt bytes that its
        # server does not hold, after those of the runs there that have no first token yet.
        rank = {c.provider.id: index for index, c in enumerate(order)}
        best = home
        best_key: tuple[int, bool, float, int] | None = None
        for candidate in free:
            is_home = candidate is home
            if is_home and not within:
                continue
            limits = candidate.provider
            own = max(0, size - held) if is_home else size
            key = (
                slots[limits.id].prefill + own,
                not is_home,
                loads[limits.id] / limits.capacity,
                rank[limits.id],
            )
            if best_key is None or key < best_key:
                best, best_key = candidate, key
        if best_key is None:  # only the home is free, past its bound: it takes the request
            return home, OVERFLOW, max(0, size - held)
        if best is home:
            return home, AFFINITY, max(0, size - held)
        return best, BACKLOG if within else OVERFLOW, size
