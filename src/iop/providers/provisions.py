"""What a runner knows of each provider: a `Provision` each, in an immutable `Registry`.

`Runner.apply` (`running.py`) builds a registry from a node's payload and swaps it in whole. A
provision holds the provider's payload, its adapter (or why none could be built), the runs using
that adapter (`AdapterRuns`) and its health verdict (`healthstates.py`); the runs and the verdict
are shared by every registry that carries the adapter over. docs/architecture.md, "The registry
and its swaps", says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import orjson

from iop.edgeconfig import NodePayload, ProviderPayload
from iop.wire import ADAPTER_ERROR, ProviderHealth

from .adapters import Adapter
from .healthstates import HealthState
from .probing import ProbeTarget


class AdapterRuns:
    """The runs using one adapter, shared by every registry that carries the adapter over.

    A run releases through the `Provision` it was admitted with, which may belong to a registry
    swapped out since; sharing the counter keeps the count right in the registry in use.
    """

    __slots__ = ("active", "idle")

    def __init__(self) -> None:
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()


@dataclass(eq=False, slots=True)
class Provision:
    """One provider in a registry: its payload, its adapter, the runs using that adapter and
    its health verdict (shared, like the runs, by every registry that carries the adapter)."""

    payload: ProviderPayload
    adapter: Adapter | None
    #: Why no adapter could be built from the payload's settings (`adapter` is None then).
    build_error: str = ""
    runs: AdapterRuns = field(default_factory=AdapterRuns)
    state: HealthState | None = None
    #: A swap replaced it: its runs finish on it, and each one that ends is drain progress.
    retired: bool = False

    @property
    def active(self) -> int:
        return self.runs.active

    @property
    def settings_key(self) -> bytes:
        return orjson.dumps(self.payload.adapter, option=orjson.OPT_SORT_KEYS)

    @property
    def problem(self) -> str:
        """Why this provider cannot run on this node: adapter settings that cannot be built here,
        or what its adapter found wrong in the node's environment (`Adapter.problem`); empty
        when it can run. Its model server's health (probes, failing runs) is not part of it."""
        return self.build_error if self.adapter is None else self.adapter.problem

    @property
    def health(self) -> ProviderHealth:
        if self.adapter is None:
            return ProviderHealth(self.payload.id, False, self.build_error, ADAPTER_ERROR)
        health = self.adapter.health
        if not health.healthy or self.state is None:
            return health
        return self.state.health

    def judge(self, previous: HealthState | None) -> None:
        """Give the provision its health state: `previous` (carried over) reconfigured for the
        payload's policy, or a new one."""
        policy = self.payload.health_policy
        probed = self.adapter is not None and self.adapter.upstream is not None
        if previous is None:
            self.state = HealthState(self.payload.id, policy, probed=probed)
        else:
            previous.reconfigure(policy, probed=probed)
            self.state = previous

    @property
    def probe(self) -> ProbeTarget | None:
        """What to probe for this provider, or None when it is not probed."""
        upstream = self.adapter.upstream if self.adapter is not None else None
        if upstream is None or self.state is None or not self.state.probed:
            return None
        return ProbeTarget.of(self.payload.id, upstream, self.payload.health_policy)


@dataclass(frozen=True, slots=True)
class Registry:
    """An immutable provider id -> `Provision` map, with the payload it was built from."""

    provisions: Mapping[str, Provision]
    payload: NodePayload | None
    digest: str

    @classmethod
    def empty(cls) -> Registry:
        return cls(MappingProxyType({}), None, "")
