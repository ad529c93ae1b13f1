"""The applied record and the Edge ConfigMap, as a pass last read or wrote them.

`NAME-edge-state` holds what was last applied (`documents.AppliedState`: the config, the stamps,
the restarts under way with their baselines, the stable revision); `NAME-edge` holds the config
the pods start from. The `Recorder` reads the record once per EdgeConfig, writes either only when
it changes, and keeps the resourceVersions it wrote, so that a watch event can tell its own write
from someone else's (`repairing.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from iop.edgeconfig import ConfigError, EdgeConfig, load_text

from . import conventions
from .documents import (
    AppliedState,
    EdgeBaseline,
    NodeBaseline,
    Owner,
    RestartRecord,
    decode_state,
    edge_configmap,
    render_config,
)
from .documents import state_configmap as record_configmap
from .kubeapi import KubeApi, resource_path


class Recorder:
    """The record of what was last applied and the Edge ConfigMap, kept between passes so an
    idle pass reads neither again."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api
        self.state: AppliedState | None = None
        self.state_owner: str | None = None
        #: The record was deleted or edited by someone else: save it again from memory.
        self.lost = False
        #: (config hash, resourceVersion) of the Edge ConfigMap as last written or checked.
        self.written: tuple[str, str] | None = None
        self.version = ""
        #: Objects being written right now: their watch events are this operator's own.
        self.writing: set[str] = set()
        #: Each node restart under way -> the node as it was before it (with the restart's
        #: config hash): what the restart's gate holds the new process to. Kept in the applied
        #: record too, so a restart under way is held to it after an operator restart.
        self.baselines: dict[str, NodeBaseline] = {}
        #: The Edge's restart under way: what its old pods had served when it was stamped (kept
        #: in the applied record too).
        self.edge_baseline: EdgeBaseline | None = None

    async def load(self, owner: Owner) -> AppliedState | None:
        """The applied record of `owner`: as last read or written, else read from the cluster."""
        if self.state_owner == owner.uid:
            return self.state
        path = resource_path(
            "v1", "configmaps", owner.namespace, conventions.state_configmap_name(owner.name)
        )
        configmap = await self._api.find(path, what="read the applied record")
        state = None
        if configmap is not None and _owned_by(configmap, owner):
            state = await asyncio.to_thread(decode_state, configmap)
            self.version = configmap["metadata"].get("resourceVersion", "")
        self.state, self.state_owner = state, owner.uid
        self.baselines = dict(state.baselines) if state is not None else {}
        self.edge_baseline = state.edge_baseline if state is not None else None
        self.written = None  # check the ConfigMap once, on the first write
        return state

    async def configmap_base(self, owner: Owner) -> EdgeConfig | None:
        """What the Edge ConfigMap holds before the operator's first apply (pods started from it),
        or None when there is none or it does not load."""
        path = resource_path(
            "v1", "configmaps", owner.namespace, conventions.edge_configmap_name(owner.name)
        )
        configmap = await self._api.find(path, what="read the Edge ConfigMap")
        if configmap is None:
            return None
        text = (configmap.get("data") or {}).get(conventions.CONFIG_KEY)
        if not text:
            return None
        try:
            return await asyncio.to_thread(load_text, text)
        except ConfigError:
            return None

    async def write_configmap(self, owner: Owner, config: EdgeConfig, digest: str) -> None:
        """NAME-edge holds the desired config: written unless it already does (as read, or as
        this operator last wrote it and no watch event said otherwise)."""
        if self.written is not None and self.written[0] == digest:
            return
        name = conventions.edge_configmap_name(owner.name)
        path = resource_path("v1", "configmaps", owner.namespace, name)
        rendered = await asyncio.to_thread(render_config, config)
        found = await self._api.find(path, what="read the Edge ConfigMap")
        if found is not None and (found.get("data") or {}).get(conventions.CONFIG_KEY) == rendered:
            self.written = (digest, found["metadata"].get("resourceVersion", ""))
            return
        body = await asyncio.to_thread(edge_configmap, owner, config, digest)
        self.writing.add(name)
        try:
            written = await self._api.apply(path, body, what="write the Edge ConfigMap")
        finally:
            self.writing.discard(name)
        self.written = (digest, written["metadata"].get("resourceVersion", ""))

    def baselines_of(self, state: AppliedState) -> dict[str, NodeBaseline]:
        """The baselines of `state`'s open restarts (what its record keeps of them)."""
        open_scopes = {(r.scope, r.config_hash) for r in state.restarts}
        return {
            scope: baseline
            for scope, baseline in self.baselines.items()
            if (scope, baseline.config_hash) in open_scopes
        }

    def edge_baseline_of(self, state: AppliedState) -> EdgeBaseline | None:
        """The Edge baseline, if `state` has its restart open (what its record keeps of it)."""
        kept = self.edge_baseline
        if kept is not None and any(
            (r.scope, r.config_hash) == ("edge", kept.config_hash) for r in state.restarts
        ):
            return kept
        return None

    def close_baselines(self, restarts: Sequence[RestartRecord]) -> None:
        """Forget the baselines of restarts no longer open (those of `restarts` stay)."""
        open_scopes = {(r.scope, r.config_hash) for r in restarts}
        self.baselines = {
            scope: kept
            for scope, kept in self.baselines.items()
            if (scope, kept.config_hash) in open_scopes
        }
        edge_open = {r.config_hash for r in restarts if r.scope == "edge"}
        if self.edge_baseline is not None and self.edge_baseline.config_hash not in edge_open:
            self.edge_baseline = None

    def baselines_changed(self, state: AppliedState) -> bool:
        """Whether the record `state` keeps other baselines than those now held."""
        if state.baselines != self.baselines_of(state):
            return True
        return state.edge_baseline != self.edge_baseline_of(state)

    async def save(self, owner: Owner, state: AppliedState) -> None:
        """Write `state` (with the baselines of its open restarts) as the applied record."""
        state = replace(
            state,
            baselines=self.baselines_of(state),
            edge_baseline=self.edge_baseline_of(state),
        )
        body = await asyncio.to_thread(record_configmap, owner, state)
        name = conventions.state_configmap_name(owner.name)
        self.writing.add(name)
        try:
            written = await self._api.apply(
                resource_path("v1", "configmaps", owner.namespace, name),
                body,
                what="write the applied record",
            )
        finally:
            self.writing.discard(name)
        self.state, self.lost = state, False
        self.version = written["metadata"].get("resourceVersion", "")


def _owned_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    references = obj.get("metadata", {}).get("ownerReferences") or ()
    return any(ref.get("uid") == owner.uid for ref in references)
