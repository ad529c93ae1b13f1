"""Drift repair: watches of what a pass owns and reads, and what to do when someone else edits it.

The Edge ConfigMap, the applied record, the kept configs and the token Secrets a spec names are
watched by name (`watching.py`). An event that is not this operator's own write forgets what the
pass had remembered of that object (so the next pass reads it again, or writes it again), notes a
repair for the `Repaired` Event, and wakes a pass, which puts it back within seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import conventions
from .documents import Owner
from .keeping import ConfigKeeper
from .kubeapi import KubeApi
from .recording import Recorder
from .tokensecrets import SecretCache, TokenRead
from .watching import NamedObject, NamedWatches, WatchEventType, WatchListener


@dataclass(slots=True, kw_only=True)
class Repairer:
    """The watches of one EdgeConfig's objects; `wake` is called when one changed by others."""

    api: KubeApi
    #: The EdgeConfig's name (its ConfigMaps' names are made from it).
    name: str
    recorder: Recorder
    secrets: SecretCache
    keeper: ConfigKeeper
    wake: Callable[[], None]
    _repairs: list[str] = field(default_factory=list, init=False)
    _watches: NamedWatches = field(init=False)

    def __post_init__(self) -> None:
        self._watches = NamedWatches(self.api, self._listener)

    async def stop(self) -> None:
        await self._watches.stop()

    def watch(self, owner: Owner, tokens: TokenRead) -> None:
        """Watch the ConfigMaps the pass owns and the token Secrets it read, and nothing else."""
        configmaps = (
            conventions.edge_configmap_name(owner.name),
            conventions.state_configmap_name(owner.name),
            conventions.revisions_configmap_name(owner.name),
        )
        self._watches.keep(
            {NamedObject("v1", "configmaps", owner.namespace, name) for name in configmaps}
            | {NamedObject("v1", "secrets", owner.namespace, name) for name in tokens.names}
        )

    def take(self) -> list[str]:
        """The repairs noted since the last call (each one to say), forgotten."""
        repairs, self._repairs = self._repairs, []
        return repairs

    def _listener(self, target: NamedObject) -> WatchListener:
        def heard(kind: WatchEventType, obj: Mapping[str, Any] | None) -> None:
            if self._changed_by_others(target, kind, obj):
                self.wake()

        return heard

    def _changed_by_others(
        self, target: NamedObject, kind: WatchEventType, obj: Mapping[str, Any] | None
    ) -> bool:
        """Whether an event on a watched object is news (not this operator's own write), and
        what to forget so the next pass looks again."""
        version = ((obj or {}).get("metadata") or {}).get("resourceVersion", "")
        gone = kind == "DELETED"
        recorder = self.recorder
        if target.name in recorder.writing:
            return False  # the write under way is the newest word on it
        if target.plural == "secrets":
            data = None if gone else (obj or {}).get("data") or {}
            if target.name in self.secrets.entries and self.secrets.entries[target.name] == data:
                return False
            self.secrets.forget(target.name)
            return True
        if target.name == conventions.edge_configmap_name(self.name):
            if recorder.written is None or (not gone and recorder.written[1] == version):
                return False
            recorder.written = None
            self._repairs.append(f"ConfigMap {target.name} was {_what(kind)}; written again")
            return True
        if target.name == conventions.revisions_configmap_name(self.name):
            if not self.keeper.changed_by_others(gone, version):
                return False
            self._repairs.append(f"ConfigMap {target.name} was {_what(kind)}; written again")
            return True
        if recorder.state is None or (not gone and recorder.version == version):
            return False
        recorder.lost = True
        self._repairs.append(f"ConfigMap {target.name} was {_what(kind)}; written again")
        return True


def _what(kind: WatchEventType) -> str:
    return "deleted" if kind == "DELETED" else "changed by someone else"
