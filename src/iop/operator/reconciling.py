"""One reconcile pass of one EdgeConfig: observe, decide, act, report.

A pass is level-based: it reads what is and does what is missing, so running it again changes
nothing, and an operator killed at any point converges on restart without rolling anything twice. It
validates the spec; observes (the generation seen, the token Secrets, the applied record
`documents.AppliedState`, the workloads, the replicas); decides (`deciding.plan`, against the config
*last applied*); acts (the Edge ConfigMap, the restarts' stamps: `rolling.py`, the live apply:
`liveapplying.py`); decides again on what the acts returned (`deciding.judge`); and reports (the
record, the status: `status/reporting.py`, Events). What it writes and reads is watched by name
(`watching.py`). docs/operator.md, "What happens to a change", has each step and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from iop.aiokits import split_listener
from iop.edgeconfig import (
    ChangeReport,
    ConfigError,
    EdgeConfig,
    UpstreamPolicy,
    classify,
    config_hash,
    is_loopback_listener,
    load_data,
    load_text,
    with_token_hashes,
)

from . import conventions
from .adminapi import EdgeAdmin, apply_body, revision_body
from .deciding import (
    NextPass,
    Observation,
    Plan,
    Verdict,
    judge,
    live_targets,
    node_of,
    plan,
    settled_outcomes,
    stamps_due,
    with_restarts,
)
from .discovering import ReplicaFinder
from .documents import (
    KEPT_BUDGET,
    AppliedState,
    EdgeBaseline,
    NodeBaseline,
    Owner,
    StableRevision,
    decode_state,
    edge_configmap,
    render_config,
)
from .documents import state_configmap as record_configmap
from .errors import AdminApiError, AdminUnreachable, KubeApiError
from .gating import (
    FailedRestart,
    came_through,
    edge_baseline,
    failed_restarts,
    node_baseline,
    pods_config,
    stamps_back,
    worse_edge,
    worse_restarts,
)
from .keeping import ConfigKeeper
from .kubeapi import KubeApi, resource_path
from .liveapplying import apply_on_replicas, read_replicas
from .metrics import EdgeConfigHealth, OperatorMetrics
from .revisions import HistoryStep, follow, held_back, needs_logs, restores
from .rolling import edge_workloads, node_workloads, stamp
from .status import (
    EdgeConfigStatus,
    EventPoster,
    HistoryEntry,
    LastChange,
    StatusWriter,
    build_status,
    change_summary,
    now,
    read_history,
    reconciling_status,
)
from .tokensecrets import SecretCache, TokenRead, read_tokens, reserved_refs
from .values import EdgeReplica, EventType, Finding, ReplicaOutcome, ReplicaRevisions
from .watching import NamedObject, NamedWatches, WatchEventType, WatchListener

logger = logging.getLogger(__name__)

#: Look again this soon while a rollout or a restart is under way (Deployment and Pod events
#: wake a pass sooner; this bounds the wait when none comes).
_RECHECK_S: Final = 5.0
#: Look again this soon while a workload rolls, a node drains or Nodes are awaited.
_MOTION_RECHECK_S: Final = 1.0
#: While nodes are not all current (they connect on their own schedule, and no event says when),
#: look again after 1 s, doubling up to this.
_NODES_RECHECK_S: Final = 30.0
#: While a revision is applied or judged (an Edge replica watches a candidate), look again this
#: soon: the Edges decide with no event to say so, and the status and Events follow them.
_JUDGING_RECHECK_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class PassResult:
    """What the worker does next: back off (`retry`), or look again after `recheck_after`."""

    retry: bool = False
    recheck_after: float | None = None
    #: How the pass ended, for the metrics: ok, retry, invalid, blocked, api_error.
    outcome: str = "ok"


@dataclass(slots=True)
class PassTimings:
    """Where one pass spent its time, in milliseconds (what bench/operator.py reports)."""

    generation: int = 0
    received_at: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    #: The replicas' own apply durations (node acks included), when an apply ran.
    replica_apply_ms: list[float] = field(default_factory=list)
    finished_at: float = 0.0

    def mark(self, part: str, since: float) -> float:
        moment = time.perf_counter()
        self.parts[part] = round((moment - since) * 1000, 3)
        return moment


class Reconciler:
    """Reconciles one EdgeConfig; keeps what it learned between passes (the applied record, the
    ConfigMap it wrote, the Secrets it read, the status it wrote), so an idle pass costs a few
    reads. `wake` is called when a watched object changes (the worker sets it to its poke)."""

    def __init__(
        self,
        namespace: str,
        name: str,
        *,
        api: KubeApi,
        admin: EdgeAdmin,
        finder: ReplicaFinder,
        events: EventPoster,
        metrics: OperatorMetrics | None = None,
        on_pass: Callable[[PassTimings], None] | None = None,
        policy: UpstreamPolicy | None = None,
        reserved_secrets: Collection[str] = (),
    ) -> None:
        self.namespace = namespace
        self._policy = policy
        self.name = name
        self.wake: Callable[[], None] = lambda: None
        self._api = api
        self._admin = admin
        self._finder = finder
        self._events = events
        self._on_pass = on_pass
        self._metrics = metrics
        self._last_success: float | None = None
        self._state: AppliedState | None = None
        self._state_owner: str | None = None
        #: The record was deleted or edited by someone else: save it again from memory.
        self._record_lost = False
        #: (config hash, resourceVersion) of the Edge ConfigMap as last written or checked.
        self._written: tuple[str, str] | None = None
        self._record_version = ""
        self._secrets = SecretCache()
        #: Secrets no token may come from (the certificates the operator makes).
        self._reserved = frozenset(reserved_secrets)
        self._repairs: list[str] = []
        #: Objects being written right now: their watch events are this operator's own.
        self._writing: set[str] = set()
        self._last_change: LastChange | None = None
        self._status = StatusWriter(api)
        #: The config hash last seen fully in effect (Applied=True), and since when.
        self._effective: str | None = None
        self._in_effect_since: tuple[str, float] | None = None
        self._nodes_recheck = 1.0
        self._said: set[tuple[str, str]] = set()
        self._watches = NamedWatches(api, self._listener)
        #: The cluster revisions as last written (newest first), and the EdgeConfig they are of;
        #: read back from the status after an operator restart.
        self._history: tuple[HistoryEntry, ...] | None = None
        self._history_owner = ""
        #: The replicas' outcomes of the last pass (how each saw the nodes then).
        self._last_outcomes: Sequence[ReplicaOutcome] = ()
        #: Each node restart under way -> the node as it was before it (with the restart's
        #: config hash): what the restart's gate holds the new process to. Kept in the applied
        #: record too, so a restart under way is held to it after an operator restart.
        self._baselines: dict[str, NodeBaseline] = {}
        #: The Edge's restart under way: what its old pods had served when it was stamped (kept
        #: in the applied record too).
        self._edge_baseline: EdgeBaseline | None = None
        #: The configs of the revisions, kept for a pin to a revision number.
        self._keeper = ConfigKeeper(api)
        #: The pin as the last pass saw it: a pin set again is said again.
        self._pin_seen: str | None = None

    @property
    def applied(self) -> AppliedState | None:
        """The record of what was last applied, once a pass has read it."""
        return self._state

    async def stop(self) -> None:
        await self._watches.stop()

    @property
    def health(self) -> EdgeConfigHealth:
        applied_at = self._state.applied_at if self._state is not None else 0.0
        return EdgeConfigHealth(self.namespace, self.name, applied_at, self._last_success)

    # -- the pass --------------------------------------------------------------------------------

    async def reconcile(self, body: Mapping[str, Any], received_at: float) -> PassResult:
        """One pass over `body` (the EdgeConfig as last seen); what the worker does next."""
        started = time.monotonic()
        result = await self._pass(body, received_at)
        if result.outcome in ("ok", "invalid"):
            self._last_success = time.monotonic()
        if self._metrics is not None:
            self._metrics.passes.labels(result.outcome).inc()
            self._metrics.pass_seconds.observe(time.monotonic() - started)
        return result

    async def _pass(self, body: Mapping[str, Any], received_at: float) -> PassResult:
        timings = PassTimings(received_at=received_at)
        metadata = body["metadata"]
        owner = Owner(metadata["name"], metadata["namespace"], metadata["uid"])
        generation = int(metadata.get("generation") or 1)
        timings.generation = generation
        previous: Mapping[str, Any] = body.get("status") or {}
        clock = time.perf_counter()
        try:
            spec = await asyncio.to_thread(load_data, body.get("spec") or {})
            if self._policy is not None:  # a change let in while the webhook was away
                self._policy.require_allowed(spec)
        except ConfigError as error:
            return await self._refuse(owner, generation, error, previous)
        if reserved := reserved_refs(spec, self._reserved):
            return await self._refuse(owner, generation, ConfigError(reserved), previous)
        clock = timings.mark("validate", clock)
        try:
            spec = await self._pinned(owner, body, spec)
            previous = await self._mark_seen(owner, generation, previous)
            tokens = await read_tokens(self._api, owner, spec, self._secrets)
            self._watch(owner, tokens)
            if tokens.missing or tokens.invalid:
                return await self._hold(owner, generation, tokens, previous)
            observation = await self._observe(owner, generation, spec, tokens)
            clock = timings.mark("observe", clock)
            verdict, step = await self._act(owner, observation, tokens, timings, previous)
            await self._keep(owner, previous, step.history, observation)
            clock = timings.mark("act", clock)
            await self._report(owner, verdict, previous, step)
        except KubeApiError as error:
            return await self._api_failed(owner, generation, error, previous)
        timings.mark("status", clock)
        timings.finished_at = time.monotonic()
        if self._on_pass is not None:
            self._on_pass(timings)
        result = self._next(verdict.next)
        if step.judging and not result.retry:
            wait = result.recheck_after
            return replace(
                result,
                recheck_after=_JUDGING_RECHECK_S if wait is None else min(wait, _JUDGING_RECHECK_S),
            )
        return result

    async def _act(
        self,
        owner: Owner,
        observation: Observation,
        tokens: TokenRead,
        timings: PassTimings,
        previous: Mapping[str, Any],
    ) -> tuple[Verdict, HistoryStep]:
        """Write, roll and apply what `plan` asks (not a config an Edge rolled back: the replicas
        that serve it are put back on the stable one); the verdict on the results, and the
        history's step."""
        current = plan(observation)
        if observation.new_change:
            self._remember_change(observation, current.change)
            self._say(owner, "Normal", "Validated", _plan_message(observation.generation, current))
        history = self._history_of(owner, previous)
        held = held_back(history, observation.desired_hash) is not None
        await self._write_configmap(owner, *pods_config(observation, current, held))
        stamps = dict(observation.applied.stamps) if observation.applied is not None else {}
        observation = await self._roll(owner, observation, current, stamps)
        failed_gate = ""
        gate = failed_restarts(observation, current)
        if gate and self._can_go_back(observation):
            observation, current, stamps, failed_gate = await self._fail_gate(
                owner, observation, current, gate
            )
            held = True
        asked, ready = live_targets(observation)
        if held:
            outcomes = await read_replicas(self._admin, ready, tokens.admin_token)
        else:
            outcomes, current = await self._apply_live(observation, current, ready, tokens)
            worse = [
                *worse_restarts(observation, current, outcomes, self._baselines),
                *worse_edge(observation, current, outcomes, self._edge_baseline, time.time()),
            ]
            if worse and self._can_go_back(observation):
                observation, current, stamps, failed_gate = await self._fail_gate(
                    owner, observation, current, worse
                )
                held = True
        timings.replica_apply_ms += [o.report.duration_ms for o in outcomes if o.report]
        views: dict[str, ReplicaRevisions] = {}
        if held or needs_logs(history, observation.desired_hash, outcomes):
            views = await self._read_logs(outcomes, tokens.admin_token)
            outcomes = await self._converge(
                history, observation.desired_hash, outcomes, views, tokens, held
            )
        observation = await self._roll(owner, observation, current, stamps)
        outcomes = settled_outcomes(current, outcomes, observation.replicas, asked)
        admin = observation.desired.edge.admin.listen
        hint = ""
        if split_listener(admin)[1] == 0 or is_loopback_listener(admin):
            hint = (
                f"edge.admin.listen is {admin}: the operator cannot reach a replica there; "
                "listen on 0.0.0.0 with edge.admin.tokenFile"
            )
        verdict = judge(
            observation,
            current,
            outcomes,
            stamps,
            effective_hash=self._effective or str(previous.get("appliedConfigHash") or ""),
            in_effect_for=self._in_effect_for(observation, previous),
            committed_at=time.time(),
            admin_unreachable_hint=hint,
        )
        if self._metrics is not None and not held:
            for outcome in outcomes:  # the replicas asked to apply (not those already current)
                if outcome.report is not None or outcome.state in ("Failed", "Unreachable"):
                    self._metrics.live_applies.labels(outcome.state).inc()
        if verdict.record is not None:
            await self._save_state(owner, verdict.record)
        elif self._record_lost and self._state is not None:
            await self._save_state(owner, self._state)
        taken = (observation.new_change and verdict.record is not None) or any(
            o.rolled_back or (o.state == "Applied" and o.config_hash == observation.desired_hash)
            for o in outcomes
        )
        step = follow(
            history,
            desired_hash=observation.desired_hash,
            generation=observation.generation,
            taken=taken,
            change=self._last_change_of(previous),
            outcomes=outcomes,
            views=views,
            timestamp=now(),
            restarting=bool(verdict.finding.pending),
            failed_restart=failed_gate,
        )
        newest = step.history[0] if step.history else None
        record = self._state
        settled = None
        if newest is not None and record is not None and newest.config_hash == record.config_hash:
            settled = newest.outcome
        through = came_through(record, settled)
        if through is not None:
            await self._save_state(owner, through)
            observation = replace(observation, applied=through)
            await self._write_configmap(owner, *pods_config(observation, current, held))
        self._last_outcomes = outcomes
        open_scopes = {(r.scope, r.config_hash) for r in current.restarts}
        self._baselines = {
            scope: kept
            for scope, kept in self._baselines.items()
            if (scope, kept.config_hash) in open_scopes
        }
        edge_open = {r.config_hash for r in current.restarts if r.scope == "edge"}
        if self._edge_baseline is not None and self._edge_baseline.config_hash not in edge_open:
            self._edge_baseline = None
        state = self._state
        if state is not None and (
            state.baselines != self._baselines_of(state)
            or state.edge_baseline != self._edge_baseline_of(state)
        ):
            await self._save_state(owner, state)  # a baseline noted, or one done with
        return verdict, step

    # -- observing -------------------------------------------------------------------------------

    async def _observe(
        self, owner: Owner, generation: int, spec: EdgeConfig, tokens: TokenRead
    ) -> Observation:
        desired = await asyncio.to_thread(with_token_hashes, spec, tokens.hashes)
        desired_hash = config_hash(desired)
        applied = await self._load_state(owner)
        base = applied.config if applied is not None else None
        if applied is None:
            base = await self._configmap_base(owner)
        admin_port = split_listener(desired.edge.admin.listen)[1]
        edges = await edge_workloads(self._api, owner.namespace, owner.name)
        nodes = await node_workloads(self._api, owner.namespace, owner.name)
        replicas = await self._finder.replicas(owner.namespace, owner.name, admin_port)
        return Observation(
            namespace=owner.namespace,
            name=owner.name,
            generation=generation,
            desired=desired,
            desired_hash=desired_hash,
            applied=applied,
            base=base,
            edges=tuple(edges),
            nodes={node: tuple(items) for node, items in nodes.items()},
            replicas=tuple(replicas),
        )

    async def _load_state(self, owner: Owner) -> AppliedState | None:
        if self._state_owner == owner.uid:
            return self._state
        path = resource_path(
            "v1", "configmaps", owner.namespace, conventions.state_configmap_name(owner.name)
        )
        configmap = await self._api.find(path, what="read the applied record")
        state = None
        if configmap is not None and _owned_by(configmap, owner):
            state = await asyncio.to_thread(decode_state, configmap)
            self._record_version = configmap["metadata"].get("resourceVersion", "")
        self._state, self._state_owner = state, owner.uid
        self._baselines = dict(state.baselines) if state is not None else {}
        self._edge_baseline = state.edge_baseline if state is not None else None
        self._written = None  # check the ConfigMap once, on the first write
        return state

    async def _configmap_base(self, owner: Owner) -> EdgeConfig | None:
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

    # -- acting ----------------------------------------------------------------------------------

    async def _write_configmap(self, owner: Owner, config: EdgeConfig, digest: str) -> None:
        """NAME-edge holds the desired config: written unless it already does (as read, or as
        this operator last wrote it and no watch event said otherwise)."""
        if self._written is not None and self._written[0] == digest:
            return
        name = conventions.edge_configmap_name(owner.name)
        path = resource_path("v1", "configmaps", owner.namespace, name)
        rendered = await asyncio.to_thread(render_config, config)
        found = await self._api.find(path, what="read the Edge ConfigMap")
        if found is not None and (found.get("data") or {}).get(conventions.CONFIG_KEY) == rendered:
            self._written = (digest, found["metadata"].get("resourceVersion", ""))
            return
        body = await asyncio.to_thread(edge_configmap, owner, config, digest)
        self._writing.add(name)
        try:
            written = await self._api.apply(path, body, what="write the Edge ConfigMap")
        finally:
            self._writing.discard(name)
        self._written = (digest, written["metadata"].get("resourceVersion", ""))

    def _baselines_of(self, state: AppliedState) -> dict[str, NodeBaseline]:
        """The baselines of `state`'s open restarts (what its record keeps of them)."""
        open_scopes = {(r.scope, r.config_hash) for r in state.restarts}
        return {
            scope: baseline
            for scope, baseline in self._baselines.items()
            if (scope, baseline.config_hash) in open_scopes
        }

    def _edge_baseline_of(self, state: AppliedState) -> EdgeBaseline | None:
        """The Edge baseline, if `state` has its restart open (what its record keeps of it)."""
        kept = self._edge_baseline
        if kept is not None and any(
            (r.scope, r.config_hash) == ("edge", kept.config_hash) for r in state.restarts
        ):
            return kept
        return None

    async def _save_state(self, owner: Owner, state: AppliedState) -> None:
        state = replace(
            state,
            baselines=self._baselines_of(state),
            edge_baseline=self._edge_baseline_of(state),
        )
        body = await asyncio.to_thread(record_configmap, owner, state)
        name = conventions.state_configmap_name(owner.name)
        self._writing.add(name)
        try:
            written = await self._api.apply(
                resource_path("v1", "configmaps", owner.namespace, name),
                body,
                what="write the applied record",
            )
        finally:
            self._writing.discard(name)
        self._state, self._record_lost = state, False
        self._record_version = written["metadata"].get("resourceVersion", "")

    async def _roll(
        self, owner: Owner, observation: Observation, current: Plan, stamps: dict[str, str]
    ) -> Observation:
        """Stamp each workload `stamps_due` names (which rolls it); the observation with the
        stamped workloads, and `stamps` (workload -> hash, what the record keeps) updated."""
        rolled: dict[str, list[str]] = {}
        edges = list(observation.edges)
        nodes = {node: list(items) for node, items in observation.nodes.items()}
        for workload, record in stamps_due(observation, current):
            if record.scope == "edge" and (
                self._edge_baseline is None or self._edge_baseline.config_hash != record.config_hash
            ):  # what the old pods served so far, to hold the new ones to
                self._edge_baseline = edge_baseline(self._last_outcomes, record.config_hash)
            kept = self._baselines.get(record.scope)
            if workload.node_id and (kept is None or kept.config_hash != record.config_hash):
                baseline = node_baseline(self._last_outcomes, workload.node_id, record.config_hash)
                if baseline is not None:  # the old process, to hold the new one to
                    self._baselines[record.scope] = baseline
            stamped = await stamp(self._api, owner.namespace, workload, record.config_hash)
            targets = edges if record.scope == "edge" else nodes[stamped.node_id]
            targets[targets.index(workload)] = stamped
            rolled.setdefault(record.scope, []).append(stamped.key)
            if self._metrics is not None:
                self._metrics.rollouts.labels(record.scope.partition(":")[0]).inc()
        for record in current.restarts:
            scope_targets = (
                edges
                if record.scope == "edge"
                else nodes.get(record.scope.removeprefix("node:"), [])
            )
            stamps.update((w.key, record.config_hash) for w in scope_targets)
            if record.scope in rolled:
                self._say(
                    owner,
                    "Normal",
                    "Rolling",
                    f"restart {record.scope}: stamped {', '.join(rolled[record.scope])} with "
                    f"config {record.config_hash[:12]}",
                )
        return replace(
            observation,
            edges=tuple(edges),
            nodes={node: tuple(items) for node, items in nodes.items()},
        )

    async def _pinned(self, owner: Owner, body: Mapping[str, Any], spec: EdgeConfig) -> EdgeConfig:
        """The config to bring into effect: the spec's, or while the EdgeConfig is pinned
        (`iop.dev/pin-revision`, an emergency: the spec is applied again once the annotation
        goes) the stable revision's (`stable`) or revision N's (`"N"`, while its config is kept).
        A pin that cannot be held is said and ignored: the spec is applied."""
        pin = conventions.pin_of(body)
        if pin != self._pin_seen:
            self._said = {key for key in self._said if key[0] not in ("Pinned", "PinIgnored")}
            self._pin_seen = pin
        if pin is None:
            return spec
        held, what = await self._pin_target(owner, body, pin)
        if held is not None and (refused := self._refused_now(held)):
            held, what = None, f"{what} is not allowed now: {refused}"
        if held is None:
            self._say(
                owner,
                "Warning",
                "PinIgnored",
                f"{conventions.PIN_ANNOTATION}={pin!r} is ignored: {what}; the spec is applied",
            )
            return spec
        self._say(
            owner,
            "Warning",
            "Pinned",
            f"{conventions.PIN_ANNOTATION}={pin}: {what} is held in effect in place of the spec; "
            "remove the annotation to apply the spec",
        )
        return held

    def _refused_now(self, config: EdgeConfig) -> str:
        """What the upstream policy and the reserved Secrets refuse of a config that was allowed
        when it came into effect (a pin never brings back what a spec could not ask for now)."""
        problems = list(self._policy.config_problems(config)) if self._policy is not None else []
        problems += reserved_refs(config, self._reserved)
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        return "; ".join(str(p) for p in problems[:3]) + more

    async def _pin_target(
        self, owner: Owner, body: Mapping[str, Any], pin: str
    ) -> tuple[EdgeConfig | None, str]:
        """(the config the pin holds, what it is), or (None, why the pin cannot be held)."""
        record = await self._load_state(owner)
        if pin == conventions.PIN_STABLE:
            stable = record.stable if record is not None else None
            if stable is None:
                return None, "the pin has no stable revision to hold yet (no config came through)"
            return stable.config, f"the stable config {stable.config_hash[:12]}"
        number = conventions.pinned_revision(pin)
        if number is None:
            return None, f"the pin takes {conventions.PIN_STABLE!r} or a revision number"
        history = self._history_of(owner, body.get("status") or {})
        entry = next((e for e in history if e.revision == number), None)
        if entry is None:
            listed = (
                f"revisions {history[-1].revision} to {history[0].revision}"
                if history
                else "none yet"
            )
            return None, f"revision {number} is not in the history ({listed})"
        digest = entry.config_hash
        config = None
        if record is not None and record.config_hash == digest:
            config = record.config
        elif record is not None and record.stable is not None:
            config = record.stable.config if record.stable.config_hash == digest else None
        if config is None:
            config = await self._keeper.config_of(owner, digest)
        if config is None:
            return None, (
                f"the config of revision {number} ({digest[:12]}) is not kept (the operator "
                f"keeps those of the revisions in the history, the newest first, up to "
                f"{KEPT_BUDGET // 1024} KiB compressed)"
            )
        return config, f"revision {number}'s config {digest[:12]}"

    async def _keep(
        self,
        owner: Owner,
        previous: Mapping[str, Any],
        history: Sequence[HistoryEntry],
        observation: Observation,
    ) -> None:
        """A config that came into effect as a new revision is kept (`keeping.py`)."""
        known = {observation.desired_hash: observation.desired}
        if (record := self._state) is not None:
            known.setdefault(record.config_hash, record.config)
            if record.stable is not None:
                known.setdefault(record.stable.config_hash, record.stable.config)
        before = self._history_of(owner, previous)
        await self._keeper.keep(
            owner,
            [(e.revision, e.config_hash) for e in before],
            [(e.revision, e.config_hash) for e in history],
            known,
        )

    def _can_go_back(self, observation: Observation) -> bool:
        """Whether a stable revision other than the desired config is there to go back to."""
        stable = observation.applied.stable if observation.applied is not None else None
        return stable is not None and stable.config_hash != observation.desired_hash

    async def _fail_gate(
        self,
        owner: Owner,
        observation: Observation,
        current: Plan,
        failures: Sequence[FailedRestart],
    ) -> tuple[Observation, Plan, dict[str, str], str]:
        """A restart failed its gate: back on the stable revision (`_go_back`); the observation,
        the plan and the stamps after it, and why, for the revision's outcome."""
        assert observation.applied is not None and observation.applied.stable is not None
        stable = observation.applied.stable
        observation, current = await self._go_back(owner, observation, current, stable)
        stamps = dict(observation.applied.stamps) if observation.applied is not None else {}
        reason = "; ".join(str(f) for f in failures) + (
            f"; back on the pod templates of the stable config {stable.config_hash[:12]}"
        )
        return observation, current, stamps, reason

    async def _go_back(
        self, owner: Owner, observation: Observation, current: Plan, stable: StableRevision
    ) -> tuple[Observation, Plan]:
        """A restart failed its gate: every workload stamped with the desired config back on the
        stable revision's stamp (its last good template, so the Deployment controller scales the
        old ReplicaSet up again and removes the new pod), the ConfigMap back on the stable config,
        and the record without the desired config's restarts (nothing rolls it again)."""
        edges = list(observation.edges)
        nodes = {node: list(items) for node, items in observation.nodes.items()}
        for workload, stamp_of in stamps_back(observation, stable):
            restored = await stamp(self._api, owner.namespace, workload, stamp_of)
            targets = nodes[workload.node_id] if workload.node_id else edges
            targets[targets.index(workload)] = restored
        assert observation.applied is not None
        record = replace(
            observation.applied,
            stamps={**observation.applied.stamps, **stable.stamps},
            restarts=tuple(
                r for r in observation.applied.restarts if r.config_hash != observation.desired_hash
            ),
        )
        await self._save_state(owner, record)
        observation = replace(
            observation,
            applied=record,
            edges=tuple(edges),
            nodes={node: tuple(items) for node, items in nodes.items()},
        )
        current = replace(current, restarts=record.restarts)
        await self._write_configmap(owner, *pods_config(observation, current, held=True))
        return observation, current

    async def _apply_live(
        self,
        observation: Observation,
        current: Plan,
        ready: Sequence[EdgeReplica],
        tokens: TokenRead,
    ) -> tuple[list[ReplicaOutcome], Plan]:
        """Every ready replica brought to the desired config; a second round when a replica
        names a node restart the change lacked (the Edge's own restart ends it: its replicas are
        replaced, not refreshed)."""
        document = observation.desired.model_dump(mode="json", exclude_unset=True)
        outcomes: list[ReplicaOutcome] = []
        for _ in range(2):
            restarting = current.node_restarts()
            replacing = {
                node_of(scope): baseline.instances
                for scope, baseline in self._baselines.items()
                if scope in restarting and baseline.config_hash == observation.desired_hash
            }
            body = await asyncio.to_thread(apply_body, document, restarting, replacing)
            outcomes = await apply_on_replicas(
                self._admin, ready, body, observation.desired_hash, tokens.admin_token
            )
            named = {s for o in outcomes for s in o.restart_scopes}
            widened = with_restarts(current, named, observation.desired_hash)
            if widened is current:
                break
            edge_named = "edge" in named and all(r.scope != "edge" for r in current.restarts)
            current = widened
            if edge_named:
                break
        return outcomes, current

    async def _read_logs(
        self, outcomes: Sequence[ReplicaOutcome], token: str | None
    ) -> dict[str, ReplicaRevisions]:
        """The revision log of every replica that answered (`GET /revisions`), by name; one that
        fails now is left out (its apply's outcome already says why)."""
        answering = [o.replica for o in outcomes if o.status is not None or o.rolled_back]

        async def read(replica: EdgeReplica) -> ReplicaRevisions | None:
            try:
                return await self._admin.revisions(replica, token)
            except AdminApiError as error:
                logger.info("%s: no revision log: %s", replica.name, error)
                return None

        logs = await asyncio.gather(*(read(r) for r in answering))
        return {log.replica.name: log for log in logs if log is not None}

    async def _converge(
        self,
        history: Sequence[HistoryEntry],
        desired_hash: str,
        outcomes: Sequence[ReplicaOutcome],
        views: Mapping[str, ReplicaRevisions],
        tokens: TokenRead,
        held: bool,
    ) -> list[ReplicaOutcome]:
        """When an Edge rolled the desired config back: every replica that still serves it put
        back on the stable config (by its own revision of it), and every replica's outcome says
        the config was rolled back. Otherwise the outcomes as they are."""
        rolled_back = held or any(o.rolled_back for o in outcomes)
        rolled_back = rolled_back or any(
            (found := view.newest_of(desired_hash)) is not None and found.outcome == "rolled_back"
            for view in views.values()
        )
        if not rolled_back:
            return list(outcomes)
        stable = self._state.stable if self._state is not None else None
        prefer = stable.config_hash if stable is not None else ""
        stable_hash, due = restores(
            desired_hash, history, outcomes, views, "" if prefer == desired_hash else prefer
        )
        settled = {o.replica.name: o for o in outcomes}
        token = tokens.admin_token
        restarting = self._nodes_going_back(stable_hash) if due else []
        document = None
        if stable is not None and stable.config_hash == stable_hash and due:
            document = stable.config.model_dump(mode="json", exclude_unset=True)
        for order in due:
            name = order.replica.name
            if order.revision is None and document is None:
                settled[name] = ReplicaOutcome(
                    order.replica,
                    "Failed",
                    f"serves config {desired_hash[:12]}, which an Edge rolled back, and keeps no "
                    f"revision of the stable config {stable_hash[:12]} to go back to",
                    status=settled[name].status,
                    rolled_back=True,
                )
                continue
            try:
                if order.revision is not None:
                    body = revision_body(order.revision, restarting)
                else:  # it keeps no revision of it: the operator's copy
                    assert document is not None
                    body = await asyncio.to_thread(apply_body, document, restarting)
                await self._admin.apply(order.replica, body, token)
                status = await self._admin.status(order.replica, token)
            except AdminApiError as error:
                settled[name] = ReplicaOutcome(
                    order.replica,
                    "Unreachable" if isinstance(error, AdminUnreachable) else "Failed",
                    f"cannot put it back on the stable config {stable_hash[:12]}: {error.reason}",
                    status=settled[name].status,
                    rolled_back=True,
                )
                continue
            settled[name] = ReplicaOutcome(
                order.replica,
                "Failed",
                f"put back on the stable config {stable_hash[:12]} ("
                + (f"its revision {order.revision}" if order.revision else "the operator's copy")
                + f"): config {desired_hash[:12]} was rolled back",
                status=status,
                rolled_back=True,
            )
        for name, outcome in settled.items():
            if outcome.state == "Applied":
                runs = outcome.config_hash[:12]
                settled[name] = replace(
                    outcome,
                    state="Failed",
                    reason=f"runs the stable config {runs}: config {desired_hash[:12]} was rolled "
                    "back, and is not applied again until the spec asks for another config",
                    rolled_back=True,
                )
        return [settled[o.replica.name] for o in outcomes]

    def _nodes_going_back(self, stable_hash: str) -> list[str]:
        """The node scopes between the recorded config and the stable one that need a restart:
        their workloads go back to their stable templates (a failed gate), so the replicas put
        back on the stable config hold them rather than refuse."""
        record = self._state
        if record is None or record.stable is None or record.stable.config_hash != stable_hash:
            return []
        change = classify(record.config, record.stable.config)
        return sorted(s for s in change.restart_scopes if s.startswith("node:"))

    # -- reporting -------------------------------------------------------------------------------

    async def _report(
        self, owner: Owner, verdict: Verdict, previous: Mapping[str, Any], step: HistoryStep
    ) -> None:
        for event in (*verdict.events, *step.events):
            self._say(owner, event.type, event.reason, event.message)
        for repair in self._repairs:
            self._say(owner, "Normal", "Repaired", repair)
        self._repairs.clear()
        finding = verdict.finding
        newest = step.history[0] if step.history else None
        if (
            finding.stalled
            and newest is not None
            and newest.check == "restart"
            and newest.outcome == "RolledBack"
            and newest.config_hash == finding.desired_hash
        ):
            finding.stalled = (
                "RolledBack",
                f"revision {newest.revision} rolled back, its restart failed its gate: "
                f"{newest.reason}; apply a changed spec to start a new rollout (docs/rollout.md)",
            )
        if finding.applied:
            self._effective = finding.desired_hash
            if self._in_effect_since is None or self._in_effect_since[0] != finding.desired_hash:
                self._in_effect_since = (finding.desired_hash, time.monotonic())
        status = build_status(
            finding,
            previous,
            self._last_change,
            now(),
            history=step.history,
            rollout=step.rollout,
        )
        await self._write_status(owner, status, previous)
        self._history, self._history_owner = step.history, owner.uid

    async def _mark_seen(
        self, owner: Owner, generation: int, previous: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """A generation seen for the first time: say so at once (kstatus: InProgress), so no
        reader takes the previous generation's Ready for this one's; the status as it now is."""
        if int(previous.get("observedGeneration") or 0) == generation:
            return previous
        status = reconciling_status(previous, generation, now())
        await self._write_status(owner, status, previous)
        return {**previous, **status.document()}

    async def _refuse(
        self, owner: Owner, generation: int, error: ConfigError, previous: Mapping[str, Any]
    ) -> PassResult:
        """An invalid spec: every problem in the status and an Event; nothing else changes."""
        count = len(error.problems)
        shown = "; ".join(str(p) for p in error.problems[:10])
        more = f" and {count - 10} more" if count > 10 else ""
        self._say(
            owner,
            "Warning",
            "InvalidSpec",
            f"generation {generation} refused, the running config is kept: {shown}{more}",
        )
        finding = Finding(generation, valid=False, problems=error.problems)
        try:
            await self._write_status(owner, build_status(finding, previous, None, now()), previous)
        except KubeApiError as again:
            logger.warning("%s/%s: cannot write status: %s", owner.namespace, owner.name, again)
            return PassResult(retry=True, outcome="api_error")
        # A new generation brings the next chance; retrying cannot help.
        return PassResult(outcome="invalid")

    async def _hold(
        self, owner: Owner, generation: int, tokens: TokenRead, previous: Mapping[str, Any]
    ) -> PassResult:
        """A token Secret the spec names is missing (and not to be generated), or holds what
        cannot be a token: nothing changes until it is put right (its watch wakes the next
        pass). A missing one is retried meanwhile; a bad one waits for a person (Stalled)."""
        if tokens.invalid:
            reason, problems = "TokenSecretInvalid", [*tokens.invalid, *tokens.missing]
        else:
            reason, problems = "TokenSecretMissing", list(tokens.missing)
        message = "; ".join(problems)
        self._say(owner, "Warning", reason, message)
        finding = self._failed_finding(generation, reason, message, previous)
        if tokens.invalid:
            finding.stalled = (reason, f"{message}; nothing is applied until it is put right")
        await self._write_status(
            owner, build_status(finding, previous, self._last_change, now()), previous
        )
        return PassResult(retry=not tokens.invalid, outcome="blocked")

    async def _api_failed(
        self, owner: Owner, generation: int, error: KubeApiError, previous: Mapping[str, Any]
    ) -> PassResult:
        self._say(owner, "Warning", "Degraded", str(error))
        finding = self._failed_finding(
            generation, "KubernetesAPIError", f"Kubernetes API: {error}", previous
        )
        finding.waiting = ("ApplyFailed", "the Kubernetes API refused a call; retrying")
        try:
            await self._write_status(
                owner, build_status(finding, previous, self._last_change, now()), previous
            )
        except KubeApiError as again:
            logger.warning("%s/%s: cannot write status: %s", owner.namespace, owner.name, again)
        return PassResult(retry=True, outcome="api_error")

    def _failed_finding(
        self, generation: int, reason: str, message: str, previous: Mapping[str, Any]
    ) -> Finding:
        finding = Finding(generation, degraded=[message], degraded_reason=reason)
        finding.waiting = (reason, message)
        finding.applied_hash = self._effective or previous.get("appliedConfigHash") or ""
        return finding

    async def _write_status(
        self, owner: Owner, status: EdgeConfigStatus, previous: Mapping[str, Any]
    ) -> None:
        await self._status.write(owner, status, previous)

    def _say(self, owner: Owner, kind: EventType, reason: str, message: str) -> None:
        """An Event, once per distinct reason and message (retries do not repeat it)."""
        key = (reason, message)
        if key in self._said:
            return
        if len(self._said) > 256:
            self._said.clear()
        self._said.add(key)
        self._events.post(owner, kind, reason, message)

    # -- memory between passes -------------------------------------------------------------------

    def _history_of(self, owner: Owner, previous: Mapping[str, Any]) -> tuple[HistoryEntry, ...]:
        """The cluster revisions: as this operator last wrote them (the body of a pass may be
        older than its last write), else as the status holds them (after a restart)."""
        if self._history is not None and self._history_owner == owner.uid:
            return self._history
        return read_history(previous)

    def _last_change_of(self, previous: Mapping[str, Any]) -> LastChange | None:
        if self._last_change is not None:
            return self._last_change
        try:
            return LastChange.model_validate(previous.get("lastChange"))
        except ValueError:
            return None

    def _remember_change(self, observation: Observation, change: ChangeReport | None) -> None:
        base_hash = config_hash(observation.base) if observation.base is not None else ""
        self._last_change = change_summary(
            change if change is not None else ChangeReport(),
            observation.generation,
            base_hash,
            observation.desired_hash,
        )

    def _in_effect_for(self, observation: Observation, previous: Mapping[str, Any]) -> float | None:
        """Seconds the desired config has been in effect; None: not yet. A config the status
        already says was in effect (an operator restart, a failover, a new generation that
        changes nothing) counts as long in effect: no new wait for the Nodes."""
        since = self._in_effect_since
        if since is not None and since[0] == observation.desired_hash:
            return time.monotonic() - since[1]
        if previous.get("appliedConfigHash") == observation.desired_hash:
            return float("inf")
        return None

    def _next(self, step: NextPass) -> PassResult:
        if step == "retry":
            return PassResult(retry=True, outcome="retry")
        if step == "motion":
            return PassResult(recheck_after=_MOTION_RECHECK_S)
        if step == "soon":
            return PassResult(recheck_after=_RECHECK_S)
        if step == "nodes":
            delay = self._nodes_recheck
            self._nodes_recheck = min(delay * 2, _NODES_RECHECK_S)
            return PassResult(recheck_after=delay)
        self._nodes_recheck = 1.0
        return PassResult()

    # -- watches of what the pass owns and reads -------------------------------------------------

    def _watch(self, owner: Owner, tokens: TokenRead) -> None:
        configmaps = (
            conventions.edge_configmap_name(owner.name),
            conventions.state_configmap_name(owner.name),
            conventions.revisions_configmap_name(owner.name),
        )
        self._watches.keep(
            {NamedObject("v1", "configmaps", owner.namespace, name) for name in configmaps}
            | {NamedObject("v1", "secrets", owner.namespace, name) for name in tokens.names}
        )

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
        if target.name in self._writing:
            return False  # the write under way is the newest word on it
        if target.plural == "secrets":
            data = None if gone else (obj or {}).get("data") or {}
            if target.name in self._secrets.entries and self._secrets.entries[target.name] == data:
                return False
            self._secrets.forget(target.name)
            return True
        if target.name == conventions.edge_configmap_name(self.name):
            if self._written is None or (not gone and self._written[1] == version):
                return False
            self._written = None
            self._repairs.append(f"ConfigMap {target.name} was {_what(kind)}; written again")
            return True
        if target.name == conventions.revisions_configmap_name(self.name):
            if not self._keeper.changed_by_others(gone, version):
                return False
            self._repairs.append(f"ConfigMap {target.name} was {_what(kind)}; written again")
            return True
        if self._state is None or (not gone and self._record_version == version):
            return False
        self._record_lost = True
        self._repairs.append(f"ConfigMap {target.name} was {_what(kind)}; written again")
        return True


def _what(kind: WatchEventType) -> str:
    return "deleted" if kind == "DELETED" else "changed by someone else"


def _plan_message(generation: int, current: Plan) -> str:
    """The Validated event: what the operator is about to do with a generation."""
    change = current.change
    if change is None:
        return f"generation {generation} is valid; first apply (no config applied before)"
    if not change.changed:
        return f"generation {generation} is valid; nothing in effect changes"
    live = len(change.live_paths)
    parts = [f"{live} live path{'s' if live != 1 else ''}"]
    if change.restart_scopes:
        parts.append(f"restart {', '.join(change.restart_scopes)}")
    return f"generation {generation} is valid: {'; '.join(parts)}"


def _owned_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    references = obj.get("metadata", {}).get("ownerReferences") or ()
    return any(ref.get("uid") == owner.uid for ref in references)
