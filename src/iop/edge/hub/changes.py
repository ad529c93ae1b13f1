"""The node hub's changes: nodes connecting or leaving, providers' health, told to its listeners.

Each listener (the dispatcher, the readiness wait) reads every provider when told, so the
listeners are told once per turn of the event loop however many changes came in it: a thousand
Nodes reconnecting at once would otherwise cost a million reads. `Changes` also keeps the hub's
provider links built since the last change, which a change drops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from .protocol import ProviderLink


class Changes:
    """The hub's listeners, told once per turn of the loop of the changes made in it."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._listeners: list[Callable[[], None]] = []
        #: The listeners are to be told of a change on the loop's next turn (`changed`).
        self._telling = False
        #: `NodeHub.connected_providers` as built since the last change (None: build it again).
        self.links: Mapping[str, ProviderLink] | None = None

    def add_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def changed(self) -> None:
        """A node connected or left, or a provider's health changed: the links are built again
        when next read, and the listeners are told on the loop's next turn."""
        self.links = None
        if self._telling:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (a hub built and changed outside a loop: tell at once)
            self._tell()
            return
        self._telling = True
        loop.call_soon(self._tell)

    def _tell(self) -> None:
        self._telling = False
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:
                self._logger.exception("node hub listener %r failed", callback)
