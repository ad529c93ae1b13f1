"""Writing an EdgeConfig's status subresource, and only when it changes something.

Whether a write is needed is judged against two things, because either alone can be wrong: the
body the pass was given (stale when the watch event of our last write comes after the next pass
began: a drain's count written, the next pass reading the body from before it would leave the
count there for good) and what this replica last wrote (overwritten when someone else writes
the status). A document equal to both is not written again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import conventions
from ..documents import Owner
from ..kubeapi import KubeApi, resource_path
from .model import EdgeConfigStatus
from .reporting import same_status


class StatusWriter:
    """Patches one EdgeConfig's status; remembers what it wrote."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api
        self._written: dict[str, Any] | None = None
        #: Status patches sent (not those found needless).
        self.writes = 0

    async def write(
        self, owner: Owner, status: EdgeConfigStatus, previous: Mapping[str, Any]
    ) -> None:
        """Patch the status to `status` unless `previous` (the body's) and what was last written
        both equal it already (but for the conditions' transition times)."""
        document = status.document()
        written = self._written if self._written is not None else previous
        if same_status(document, previous) and same_status(document, written):
            self._written = document
            return
        path = resource_path(
            f"{conventions.GROUP}/{conventions.VERSION}",
            conventions.PLURAL,
            owner.namespace,
            owner.name,
            "status",
        )
        await self._api.merge_patch(path, {"status": document}, what="write the status")
        self._written = document
        self.writes += 1
