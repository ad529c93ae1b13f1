"""The objects the operator writes for an EdgeConfig, and the record of what it last applied.

- The Edge ConfigMap (`NAME-edge`, key `edge.yaml`): the config as compact JSON, snake_case,
  only the keys the spec set. A pod that starts reads it and is current at once.
- The applied record (`NAME-edge-applied`): the config *last applied* (the base the next change
  is classified against), gzip-compressed, its hash and generation, the stamps the operator
  wrote on workloads, each restart's baseline (a node's old process, or what the Edge's old
  pods had served, that the new ones are held to, so the gate holds across an operator
  restart); and the *stable* revision (the newest config that came through its trial and its
  restarts, with its stamps): what the ConfigMap holds while a newer one is on trial or after it
  was rolled back, and the pod templates a failed restart goes back to.
- The kept configs (`NAME-edge-revisions`): the config of each cluster revision still in the
  history, gzip-compressed, by config hash, the newest first within `KEPT_BUDGET` (what a pin to
  a revision number puts back).

All three are owned by the EdgeConfig and written with server-side apply. docs/operator.md, "What
the operator writes", says why they are so.
"""

from __future__ import annotations

import base64
import gzip
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import orjson

from iop.edgeconfig import ConfigError, EdgeConfig, config_hash, load_data
from iop.verdicts import Figures

from . import conventions

logger = logging.getLogger(__name__)

_STATE_KEY: Final = "config.json.gz"
_STABLE_KEY: Final = "stable.json.gz"
#: The kept configs' compressed bytes in all (a ConfigMap holds at most 1 MiB, and base64 adds
#: a third): the oldest are dropped first to stay within it.
KEPT_BUDGET: Final = 512 * 1024
_KEPT_SUFFIX: Final = ".json.gz"


@dataclass(frozen=True, slots=True)
class Owner:
    """The EdgeConfig an object belongs to (for names and ownerReferences)."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        # No blockOwnerDeletion: setting it needs update on edgeconfigs/finalizers, and the
        # garbage collector removes these after the EdgeConfig either way.
        return {
            "apiVersion": f"{conventions.GROUP}/{conventions.VERSION}",
            "kind": conventions.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
        }

    def labels(self) -> dict[str, str]:
        return {
            conventions.EDGECONFIG_LABEL: self.name,
            "app.kubernetes.io/managed-by": "iop-operator",
        }


def render_config(config: EdgeConfig) -> str:
    """The config as edge.yaml: compact JSON, snake_case, only what was set."""
    return orjson.dumps(config.model_dump(mode="json", exclude_unset=True)).decode()


def edge_configmap(owner: Owner, config: EdgeConfig, digest: str) -> dict[str, Any]:
    """The Edge ConfigMap, as a server-side apply body."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": conventions.edge_configmap_name(owner.name),
            "namespace": owner.namespace,
            "labels": owner.labels(),
            "annotations": {conventions.CONFIG_HASH_ANNOTATION: digest},
            "ownerReferences": [owner.reference()],
        },
        "data": {conventions.CONFIG_KEY: render_config(config)},
    }


@dataclass(frozen=True, slots=True)
class RestartRecord:
    """A restart scope a committed change needs and that is not confirmed done yet, with the
    config hash its workloads were stamped with (a later change never stamps it again)."""

    scope: str
    config_hash: str

    def as_dict(self) -> dict[str, str]:
        return {"scope": self.scope, "configHash": self.config_hash}


@dataclass(frozen=True, slots=True)
class NodeBaseline:
    """A node as the replicas saw it just before its restart for `config_hash`: the processes
    that served it and the providers healthy on every replica that saw it (what the new process
    is held to)."""

    config_hash: str
    instances: frozenset[str]
    healthy: frozenset[str]

    def as_dict(self) -> dict[str, object]:
        return {
            "configHash": self.config_hash,
            "instances": sorted(self.instances),
            "healthy": sorted(self.healthy),
        }


@dataclass(frozen=True, slots=True)
class EdgeBaseline:
    """The Edge's old pods when its workload was stamped for `config_hash`: what each (by pod
    name) had served by then. What they serve after it is what a new pod is held to."""

    config_hash: str
    replicas: Mapping[str, Figures]

    def as_dict(self) -> dict[str, object]:
        return {
            "configHash": self.config_hash,
            "replicas": {name: figures.counts() for name, figures in self.replicas.items()},
        }


@dataclass(frozen=True, slots=True)
class StableRevision:
    """The newest config that came through its trial and its restarts, and each workload's stamp
    then ("" where the pod template carried none): what a rollback goes back to."""

    config: EdgeConfig
    config_hash: str
    stamps: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AppliedState:
    """What the operator last applied for one EdgeConfig."""

    config: EdgeConfig
    config_hash: str
    #: The EdgeConfig's .metadata.generation it came from.
    generation: int
    #: Workload ("Deployment/NAME") -> the config hash its pod template was stamped with.
    stamps: Mapping[str, str] = field(default_factory=dict)
    #: Restarts still to confirm (rollouts under way, nodes outside the cluster to restart).
    restarts: tuple[RestartRecord, ...] = ()
    #: Unix time the change was committed (0: a record older than this field).
    applied_at: float = 0.0
    #: The stable revision (None: none known yet, e.g. before the first config came through).
    stable: StableRevision | None = None
    #: Each node restart scope under way -> the node as it was before it was stamped.
    baselines: Mapping[str, NodeBaseline] = field(default_factory=dict)
    #: The Edge's restart under way: what its old pods had served when it was stamped.
    edge_baseline: EdgeBaseline | None = None

    def with_stable(self) -> AppliedState:
        """This record with its own config as the stable revision (it came through)."""
        return replace(
            self, stable=StableRevision(self.config, self.config_hash, dict(self.stamps))
        )


def state_configmap(owner: Owner, state: AppliedState) -> dict[str, Any]:
    """The applied record, as a server-side apply body."""
    packed = _pack(state.config)
    data = {
        "configHash": state.config_hash,
        "generation": str(state.generation),
        "stamps": _json(dict(state.stamps)),
        "restarts": orjson.dumps([r.as_dict() for r in state.restarts]).decode(),
        "appliedAt": f"{state.applied_at:.3f}",
    }
    if state.edge_baseline is not None:
        data["edgeBaseline"] = _json_value(state.edge_baseline.as_dict())
    if state.baselines:
        data["nodeBaselines"] = _json_value(
            {scope: b.as_dict() for scope, b in state.baselines.items()}
        )
    binary = {_STATE_KEY: packed}
    stable = state.stable
    if stable is not None:
        data["stableConfigHash"] = stable.config_hash
        data["stableStamps"] = _json(dict(stable.stamps))
        if stable.config_hash != state.config_hash:  # else the same config: kept once
            binary[_STABLE_KEY] = _pack(stable.config)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": conventions.state_configmap_name(owner.name),
            "namespace": owner.namespace,
            "labels": owner.labels(),
            "ownerReferences": [owner.reference()],
        },
        "data": data,
        "binaryData": binary,
    }


def _pack(config: EdgeConfig) -> str:
    packed = gzip.compress(render_config(config).encode(), compresslevel=6, mtime=0)
    return base64.b64encode(packed).decode()


def _unpack(text: str) -> EdgeConfig:
    return load_data(orjson.loads(gzip.decompress(base64.b64decode(text))))


def _json(value: Mapping[str, str]) -> str:
    return _json_value(value)


def _json_value(value: object) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _stable_of(
    data: Mapping[str, Any], binary: Mapping[str, Any], config: EdgeConfig, digest: str
) -> StableRevision | None:
    stable_hash = data.get("stableConfigHash")
    if not stable_hash:
        return None  # a record older than the field, or none came through yet
    stamps = orjson.loads(data.get("stableStamps") or "{}")
    stable_config = config if stable_hash == digest else _unpack(binary[_STABLE_KEY])
    if config_hash(stable_config) != stable_hash:
        raise ValueError("the stable config does not match its hash")
    return StableRevision(stable_config, stable_hash, {str(k): str(v) for k, v in stamps.items()})


def _baselines_of(data: Mapping[str, Any]) -> dict[str, NodeBaseline]:
    try:
        found = orjson.loads(data.get("nodeBaselines") or "{}")
        return {
            str(scope): NodeBaseline(
                str(b["configHash"]),
                frozenset(str(i) for i in b["instances"]),
                frozenset(str(p) for p in b["healthy"]),
            )
            for scope, b in found.items()
        }
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        logger.warning("the node baselines of the applied record are unreadable (%r)", exc)
        return {}  # the restarts under way are judged by their readiness alone


def _edge_baseline_of(data: Mapping[str, Any]) -> EdgeBaseline | None:
    try:
        found = orjson.loads(data.get("edgeBaseline") or "null")
        if found is None:
            return None
        replicas = {str(name): Figures.of_counts(c) for name, c in found["replicas"].items()}
        return EdgeBaseline(str(found["configHash"]), replicas)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        # (Another release's buckets, say): the Edge's restart is judged by readiness alone.
        logger.warning("the Edge baseline of the applied record is unreadable (%r)", exc)
        return None


def decode_state(configmap: Mapping[str, Any]) -> AppliedState | None:
    """The record back; None (logged) when it is unreadable, so the operator starts afresh
    rather than classify against a base it cannot trust. Parses and validates a whole config:
    call it off the event loop."""
    name = configmap.get("metadata", {}).get("name", "?")
    try:
        data = configmap.get("data") or {}
        binary = configmap.get("binaryData") or {}
        config = _unpack(binary[_STATE_KEY])
        digest = config_hash(config)
        stamps = orjson.loads(data.get("stamps") or "{}")
        restarts = orjson.loads(data.get("restarts") or "[]")
        state = AppliedState(
            config=config,
            config_hash=digest,
            generation=int(data.get("generation") or 0),
            stamps={str(k): str(v) for k, v in stamps.items()},
            restarts=tuple(RestartRecord(str(r["scope"]), str(r["configHash"])) for r in restarts),
            applied_at=float(data.get("appliedAt") or 0.0),
            stable=_stable_of(data, binary, config, digest),
            baselines=_baselines_of(data),
            edge_baseline=_edge_baseline_of(data),
        )
    except (KeyError, ValueError, TypeError, OSError, ConfigError, AttributeError) as exc:
        logger.warning("the applied record %s is unreadable (%r); starting afresh", name, exc)
        return None
    if data.get("configHash") not in (None, state.config_hash):
        logger.warning("the applied record %s does not match its hash; starting afresh", name)
        return None
    return state


# -- the kept configs ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeptConfigs:
    """The configs of the cluster revisions, each packed once (gzip, base64) under its config
    hash, the newest first; and which revisions (number, hash) of the history they serve.
    Unpacked only when asked for one (`config_of`): a pin needs it."""

    #: (config hash, packed config), the newest first.
    packed: tuple[tuple[str, str], ...] = ()
    #: (revision, config hash) of each revision whose config is kept, the newest first.
    revisions: tuple[tuple[int, str], ...] = ()

    def hashes(self) -> tuple[str, ...]:
        return tuple(digest for digest, _ in self.packed)

    def size(self) -> int:
        """The compressed bytes kept (what `KEPT_BUDGET` bounds)."""
        return sum(_packed_size(text) for _, text in self.packed)

    def config_of(self, digest: str) -> EdgeConfig | None:
        """The config kept under `digest`; None when it is not kept, or is unreadable or does not
        match its hash (logged). Parses and validates a whole config: call it off the event
        loop."""
        text = dict(self.packed).get(digest)
        if text is None:
            return None
        try:
            config = _unpack(text)
        except (ValueError, TypeError, OSError, ConfigError) as exc:
            logger.warning("the kept config %s is unreadable (%r)", digest[:12], exc)
            return None
        if config_hash(config) != digest:
            logger.warning("the kept config %s does not match its hash", digest[:12])
            return None
        return config

    def keeping(
        self,
        history: Sequence[tuple[int, str]],
        known: Mapping[str, EdgeConfig],
        budget: int = KEPT_BUDGET,
    ) -> KeptConfigs:
        """The configs to keep for `history` ((revision, config hash), the newest first): each
        revision's config, from what is kept or from `known` (packed here; a config neither
        holds is not kept), the newest first while they fit in `budget` compressed bytes (the
        first that does not fit and every older one are dropped). Packs: call it off the event
        loop."""
        have = dict(self.packed)
        packed: dict[str, str] = {}
        total = 0
        full = False
        for _, digest in history:
            if digest in packed or full:
                continue
            text = have.get(digest)
            if text is None and digest in known:
                text = _pack(known[digest])
            if text is None:
                continue  # never kept (an operator before this record) or lost
            size = _packed_size(text)
            if total + size > budget:
                full = True
                continue
            packed[digest] = text
            total += size
        revisions = tuple((number, digest) for number, digest in history if digest in packed)
        return KeptConfigs(tuple(packed.items()), revisions)


def kept_configmap(owner: Owner, kept: KeptConfigs) -> dict[str, Any]:
    """The kept configs, as a server-side apply body (a key no longer sent is removed)."""
    revisions = [{"revision": number, "configHash": digest} for number, digest in kept.revisions]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": conventions.revisions_configmap_name(owner.name),
            "namespace": owner.namespace,
            "labels": owner.labels(),
            "ownerReferences": [owner.reference()],
        },
        "data": {"revisions": orjson.dumps(revisions).decode()},
        "binaryData": {f"{digest}{_KEPT_SUFFIX}": text for digest, text in kept.packed},
    }


def decode_kept(configmap: Mapping[str, Any]) -> KeptConfigs:
    """The kept configs back, still packed (each is checked against its hash when it is
    unpacked); none (logged) when the index is unreadable. A key the index does not name is
    left out."""
    name = configmap.get("metadata", {}).get("name", "?")
    try:
        binary = configmap.get("binaryData") or {}
        index = orjson.loads((configmap.get("data") or {}).get("revisions") or "[]")
        revisions = tuple((int(r["revision"]), str(r["configHash"])) for r in index)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        logger.warning("the kept configs %s are unreadable (%r); none are kept", name, exc)
        return KeptConfigs()
    packed: dict[str, str] = {}
    for _, digest in revisions:
        text = binary.get(f"{digest}{_KEPT_SUFFIX}")
        if isinstance(text, str) and digest not in packed:
            packed[digest] = text
    return KeptConfigs(tuple(packed.items()), tuple((n, d) for n, d in revisions if d in packed))


def _packed_size(text: str) -> int:
    """The bytes a base64 text decodes to."""
    return len(text) * 3 // 4 - text[-2:].count("=")
