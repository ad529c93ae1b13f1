"""What the request path needs from the node hub, as a Protocol: the seam between the two.

The hub (`nodehub`) owns the gRPC side: which nodes are connected, their providers' health, and
the runs in flight on each connection. The request path only needs the four calls below, so it is
written (and unit-tested, with an in-process fake) against this Protocol rather than the hub.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from types import TracebackType
from typing import Protocol

from iop.wire import RunEvent, RunRequest

__all__ = ["Hub", "NodeRuns", "ProviderLink", "RunStream", "available_providers"]


class ProviderLink(Protocol):
    """A provider of a connected node, as the hub sees it."""

    @property
    def node_id(self) -> str: ...

    @property
    def healthy(self) -> bool: ...


class RunStream(Protocol):
    """The events of one run; leaving the `async with` early cancels the run on its Node."""

    async def __aenter__(self) -> RunStream: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None: ...

    def __aiter__(self) -> AsyncIterator[RunEvent]: ...


class NodeRuns(Protocol):
    """The node hub, as the request path uses it."""

    def connected_providers(self) -> Mapping[str, ProviderLink]:
        """provider id -> link, for the providers of every connected node."""
        ...

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever nodes connect or disconnect or a provider's health changes."""
        ...

    def run(self, request: RunRequest) -> RunStream:
        """Start `request` on the node of its provider."""
        ...


class Hub(NodeRuns, Protocol):
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
