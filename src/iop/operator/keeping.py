"""The configs of one EdgeConfig's cluster revisions, kept in the cluster for a pin to a revision
number (`iop.dev/pin-revision: N`).

The ConfigMap `NAME-edge-revisions` (`documents.KeptConfigs`) survives an operator restart; the
keeper holds what it last read or wrote, reads it back only when a pin needs a config (or a new
revision must be added to it), and writes it only when a revision is added or someone else
deleted or edited it. A failure to keep costs a pin, never the pass: it is logged and tried again
on the next one. docs/operator.md, "Revisions", has the budget and the rules.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from iop.edgeconfig import EdgeConfig

from . import conventions
from .documents import KeptConfigs, Owner, decode_kept, kept_configmap
from .errors import KubeApiError
from .kubeapi import KubeApi, resource_path

logger = logging.getLogger(__name__)


class ConfigKeeper:
    """The kept configs of one EdgeConfig, as last read or written."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api
        #: None: not read since the operator started.
        self._kept: KeptConfigs | None = None
        self._owner = ""
        self._version = ""
        #: To be written again (a write failed, or someone else's write came after it).
        self._due = False
        #: A write is under way: its watch events are the keeper's own.
        self.writing = False

    async def config_of(self, owner: Owner, digest: str) -> EdgeConfig | None:
        """The config kept under `digest` (read back first if need be); None when it is not
        kept or does not read. A Kubernetes API error is raised (the pass is retried)."""
        kept = await self._read(owner)
        return await asyncio.to_thread(kept.config_of, digest)

    async def keep(
        self,
        owner: Owner,
        before: Sequence[tuple[int, str]],
        history: Sequence[tuple[int, str]],
        known: Mapping[str, EdgeConfig],
    ) -> None:
        """After a pass: when `history` ((revision, config hash), newest first) has a revision
        that `before` had not, keep its config (from `known`) with those of the others, within
        the budget; and write again what someone else changed."""
        added = bool(history) and (not before or before[0][0] != history[0][0])
        if not added and not self._due:
            return
        try:
            kept = await self._read(owner)
            updated = await asyncio.to_thread(kept.keeping, history, known)
            if updated == kept and not self._due:
                return
            name = conventions.revisions_configmap_name(owner.name)
            self.writing = True
            try:
                written = await self._api.apply(
                    resource_path("v1", "configmaps", owner.namespace, name),
                    kept_configmap(owner, updated),
                    what="write the kept configs",
                )
            finally:
                self.writing = False
        except KubeApiError as error:
            logger.warning("%s/%s: cannot keep the configs: %s", owner.namespace, owner.name, error)
            self._due = True
            return
        self._kept, self._owner, self._due = updated, owner.uid, False
        self._version = written["metadata"].get("resourceVersion", "")

    def changed_by_others(self, gone: bool, version: str) -> bool:
        """Whether a watch event on the ConfigMap is someone else's change to what this keeper
        holds (then it is written again on the next pass)."""
        if self.writing or self._kept is None or (not gone and version == self._version):
            return False
        self._due = True
        return True

    async def _read(self, owner: Owner) -> KeptConfigs:
        if self._kept is not None and self._owner == owner.uid:
            return self._kept
        path = resource_path(
            "v1", "configmaps", owner.namespace, conventions.revisions_configmap_name(owner.name)
        )
        found = await self._api.find(path, what="read the kept configs")
        kept, version = KeptConfigs(), ""
        references = (found or {}).get("metadata", {}).get("ownerReferences") or ()
        if found is not None and any(ref.get("uid") == owner.uid for ref in references):
            kept = decode_kept(found)  # still packed: cheap
            version = found["metadata"].get("resourceVersion", "")
        self._kept, self._owner, self._version = kept, owner.uid, version
        return kept
