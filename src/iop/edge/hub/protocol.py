"""What the request path needs from the node hub, as a Protocol: the seam between the two.

The hub (`nodehub`) owns the gRPC side: which nodes are connected, their providers' health and
load, and the runs in flight on each connection. The request path only needs the calls below, so
it is written (and unit-tested, with an in-process fake) against this Protocol rather than the
hub.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from iop.edgeconfig import EdgeConfig, NodePayload
from iop.wire import NODE_DISCONNECTED, ConfigAck, DrainProgress, RunEvent, RunRequest, ServerLoad


@dataclass(frozen=True, slots=True)
class ProviderLink:
    """A provider of a connected node, as the hub sees it: healthy, or why not (`reason`, a
    code of `iop.wire.nodestates`; `detail`, the sentence for people)."""

    provider_id: str
    node_id: str
    healthy: bool
    detail: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ProviderLoad:
    """A provider's load as its Node last reported it in a heartbeat: its runs from every Edge
    (`node_in_flight`), those of them from other Edges than this one (`elsewhere`) and, when
    the model server exposes vLLM's metrics, the server's own view. `reported_at` is this
    Edge's `time.monotonic()` when the heartbeat arrived."""

    node_in_flight: int
    server: ServerLoad | None
    reported_at: float
    elsewhere: int = 0


@dataclass(frozen=True, slots=True)
class InstanceDrain:
    """An older process of a node id that a newer one superseded (a rollout with surge): it
    finishes the runs it has on this Edge, then goes. `drain` is what it said about its own
    drain (after its SIGTERM); before that, its runs on this Edge are what it has left."""

    instance_id: str
    runs_in_flight: int
    drain: DrainProgress


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """A connected node, for status pages and the admin API."""

    node_id: str
    alias: str
    instance_id: str
    peer: str
    ready: bool
    applied_generation: int
    applied_hash: str
    runs_in_flight: int
    connected_at: float
    #: What the node last said about its drains (none under way: `DrainProgress()`).
    drain: DrainProgress = field(default_factory=DrainProgress)
    #: Older processes of this node id still finishing their runs here.
    superseded: tuple[InstanceDrain, ...] = ()

    @property
    def draining(self) -> bool:
        """This node, or an older process of it, is draining."""
        return self.drain.draining or bool(self.superseded)

    def draining_runs(self) -> dict[str, int]:
        """provider id -> runs left to drain, over this process and the older ones."""
        left = dict(self.drain.runs_left)
        for older in self.superseded:
            for provider_id, runs in older.drain.runs_left.items():
                left[provider_id] = left.get(provider_id, 0) + runs
        return left


class RunEvents(Protocol):
    """The events of one run; leaving the `async with` early cancels the run on its Node."""

    async def __aenter__(self) -> RunEvents: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    def __aiter__(self) -> AsyncIterator[RunEvent]: ...

    def on_end(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once the run has ended on its Node (its last event arrived), even
        while the consumer has not read every event yet; at once if it has ended already."""
        ...

    def take_ready(self) -> list[RunEvent]:
        """The events already arrived, without waiting (empty when none has, or the stream
        cannot tell): a writer that is behind sends them all at once instead of one by one."""
        ...

    def cancel(self, *, first_byte_timeout: bool = False) -> None:
        """Stop the run now unless it has ended. `first_byte_timeout`: because its first byte
        came too late, which its Node counts against the provider's health."""
        ...


class NodeRuns(Protocol):
    """The node hub, as the request path uses it."""

    def connected_providers(self) -> Mapping[str, ProviderLink]:
        """provider id -> link, for the providers of every connected node."""
        ...

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever nodes connect or disconnect or a provider's health changes."""
        ...

    def provider_loads(self) -> Mapping[str, ProviderLoad]:
        """provider id -> its last reported load: a live view, updated as heartbeats arrive."""
        ...

    def run(self, request: RunRequest) -> RunEvents:
        """Start `request` on the node of its provider."""
        ...


@dataclass(frozen=True, slots=True)
class PreparedSwap:
    """What a swap of `config` needs, built off the event loop (`ConfigPush.prepare`): the
    hub's own snapshot (`snapshot`, opaque to the caller), each node's payload under `config`
    and under the config it replaces (`replaces`), which a classification reuses."""

    config: EdgeConfig
    generation: int
    replaces: EdgeConfig
    payloads: Mapping[str, NodePayload]
    replaced_payloads: Mapping[str, NodePayload]
    snapshot: object = None


class ConfigPush(Protocol):
    """The node hub, as the refresher uses it: swap the config, push payloads, report nodes."""

    def prepare(self, config: EdgeConfig, generation: int) -> PreparedSwap:
        """What `swap_config(config, generation=generation, prepared=...)` swaps in: a pure
        function of `config` and the config in use, safe in a worker thread."""
        ...

    async def swap_config(
        self,
        config: EdgeConfig,
        *,
        generation: int | None = ...,
        ack_timeout: float = ...,
        hold: Mapping[str, Collection[str]] = ...,
        prepared: PreparedSwap | None = ...,
    ) -> Mapping[str, ConfigAck | None]:
        """Make `config` current; push each connected node's changed payload (but to the nodes
        in `hold`, node id -> the processes their restart replaces); node id -> ack.
        `prepared`: `prepare(config, generation)`'s, used when it is still for that swap."""
        ...

    def nodes(self) -> Mapping[str, NodeStatus]:
        """The connected nodes."""
        ...

    def payload_digests(self) -> Mapping[str, str]:
        """node id -> the digest of the payload the config in use gives that node."""
        ...


class Hub(NodeRuns, ConfigPush, Protocol):
    """The node hub with its lifecycle, as the Edge process owns it."""

    async def start(self) -> int:
        """Listen for nodes; returns the bound port."""
        ...

    async def stop(self, grace: float = ...) -> None:
        """Let runs finish for up to `grace` seconds, then close every node's connection."""
        ...


def available_providers(links: Mapping[str, ProviderLink]) -> frozenset[str]:
    """The providers dispatch may use: those of connected nodes that report themselves healthy."""
    return frozenset(provider_id for provider_id, link in links.items() if link.healthy)


def provider_health(
    nodes: Mapping[str, str], links: Mapping[str, ProviderLink]
) -> dict[str, ProviderLink]:
    """provider id -> its health, for every provider of `nodes` (provider id -> node id, the
    config's): its link, or unhealthy `node_disconnected` when its node is not connected."""
    return {
        provider_id: links.get(provider_id)
        or ProviderLink(
            provider_id,
            node_id,
            healthy=False,
            detail=f"node {node_id} is not connected",
            reason=NODE_DISCONNECTED,
        )
        for provider_id, node_id in sorted(nodes.items())
    }
