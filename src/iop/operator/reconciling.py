"""One reconcile pass of one EdgeConfig: validate, classify, write, apply live or roll, report.

A pass is level-based: it reads what is (the spec, the record of what was last applied, the
workloads, the Edge replicas) and does what is missing, so running it again changes nothing,
and an operator killed at any point converges on restart without rolling anything twice.

1. **Validate** the spec with the config model (every check of `iop config check`). Invalid:
   `Valid=False` with every problem and an Event; nothing else is touched.
2. **Classify** against the config *last applied* (`documents.AppliedState`), never the last
   seen: a refused or failed change does not become the base. With no record yet (first pass),
   the base is what the Edge ConfigMap holds, if anything; with neither, each replica's own
   classification (it answers 409 for a restart) decides.
3. **Write** the Edge ConfigMap: pods that start from now on are current at once.
4. **Roll** only the restart scopes the change names: `edge` stamps the Edge workload(s),
   `node:<id>` that node's workload (found by label); a scope with no workload (a Node on a
   bare-metal host) stays pending, by name, until that node runs the new payload.
5. **Apply live** on every ready replica of the current pod template that does not run the
   desired config yet, telling it which node restarts the operator makes itself; a replica
   that says it needs an Edge restart gets one (stamp); failures are named and retried.
6. **Commit**: once every replica took the change (or the Edge roll for it is stamped), the
   desired config becomes the applied record, with the restarts still to confirm.
7. **Report**: status and Events (`reporting.py`, `eventing.py`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from iop.edgeconfig import (
    ChangeReport,
    ConfigError,
    EdgeConfig,
    classify,
    config_hash,
    load_data,
    load_text,
    split_listener,
)

from . import conventions
from .adminapi import EdgeAdmin, apply_body
from .discovering import EdgeReplica, ReplicaFinder
from .documents import (
    AppliedState,
    Owner,
    RestartRecord,
    decode_state,
    edge_configmap,
    state_configmap,
)
from .errors import KubeApiError, KubeNotFound
from .eventing import EventPoster, EventType
from .kubeapi import KubeApi, resource_path
from .liveapplying import NodeResult, ReplicaOutcome, apply_on_replicas, node_results
from .reporting import (
    Finding,
    PendingRestart,
    RolloutRecord,
    build_status,
    change_summary,
    now,
)
from .rolling import Workload, edge_workloads, node_workloads, stamp

__all__ = ["PassResult", "PassTimings", "Reconciler"]

logger = logging.getLogger(__name__)

#: How long a fetched admin token is trusted before the Secret is read again.
_TOKEN_TTL_S: Final = 60.0
#: Look again this soon while a rollout or a restart is under way (Deployment and Pod events
#: wake a pass sooner; this bounds the wait when none comes).
_RECHECK_S: Final = 5.0
#: Look again this soon while a workload rolls or a node drains, so `status.nodes` follows.
_MOTION_RECHECK_S: Final = 1.0
#: While nodes are not all current (they connect on their own schedule, and no event says when),
#: look again after 1 s, doubling up to this.
_NODES_RECHECK_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class PassResult:
    """What the worker does next: back off (`retry`), or look again after `recheck_after`."""

    retry: bool = False
    recheck_after: float | None = None


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
    """Reconciles one EdgeConfig; keeps what it learned between passes (the applied record,
    the ConfigMap it wrote, the status it wrote), so an idle pass costs a few reads."""

    def __init__(
        self,
        namespace: str,
        name: str,
        *,
        api: KubeApi,
        admin: EdgeAdmin,
        finder: ReplicaFinder,
        events: EventPoster,
        on_pass: Callable[[PassTimings], None] | None = None,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self._api = api
        self._admin = admin
        self._finder = finder
        self._events = events
        self._on_pass = on_pass
        self._state: AppliedState | None = None
        self._state_owner: str | None = None
        self._written_hash: str | None = None
        self._last_change: dict[str, Any] | None = None
        self._last_status: dict[str, Any] | None = None
        #: The config hash last seen fully in effect (Applied=True).
        self._effective: str | None = None
        self._token: tuple[str | None, float] | None = None
        self._nodes_recheck = 1.0
        self._said: set[tuple[str, str]] = set()

    @property
    def applied(self) -> AppliedState | None:
        """The record of what was last applied, once a pass has read it."""
        return self._state

    # -- the pass --------------------------------------------------------------------------------

    async def reconcile(self, body: Mapping[str, Any], received_at: float) -> PassResult:
        timings = PassTimings(received_at=received_at)
        clock = time.perf_counter()
        metadata = body["metadata"]
        owner = Owner(metadata["name"], metadata["namespace"], metadata["uid"])
        generation = int(metadata.get("generation") or 1)
        timings.generation = generation
        previous = body.get("status") or {}

        try:
            desired = await asyncio.to_thread(load_data, body.get("spec") or {})
        except ConfigError as error:
            return await self._invalid(owner, generation, error, previous)
        desired_hash = config_hash(desired)
        clock = timings.mark("validate", clock)

        state = await self._load_state(owner)
        new_change = state is None or state.config_hash != desired_hash
        restarts = list(state.restarts) if state is not None else []
        change: ChangeReport | None = None
        if new_change:
            base = state.config if state is not None else await self._configmap_base(owner)
            base_hash = config_hash(base) if base is not None else ""
            if base is not None:
                change = classify(base, desired)
                self._last_change = change_summary(change, generation, base_hash, desired_hash)
            else:
                self._last_change = change_summary(ChangeReport(), generation, "", desired_hash)
            for scope in change.restart_scopes if change is not None else ():
                restarts = [r for r in restarts if r.scope != scope]
                restarts.append(RestartRecord(scope, desired_hash))
        node_ids = {node.id for node in desired.nodes}
        restarts = [r for r in restarts if r.scope == "edge" or _node_of(r.scope) in node_ids]
        clock = timings.mark("classify", clock)

        finding = Finding(generation, desired_hash=desired_hash, node_total=len(node_ids))
        try:
            await self._write_configmap(owner, desired, desired_hash)
            clock = timings.mark("configmap", clock)
            edges = await edge_workloads(self._api, owner.namespace, owner.name)
            nodes = await node_workloads(self._api, owner.namespace, owner.name)
            stamps = dict(state.stamps) if state is not None else {}
            edges, nodes = await self._roll(owner, restarts, edges, nodes, stamps)
            clock = timings.mark("workloads", clock)
            token = await self._admin_token(owner, desired)
        except KubeApiError as error:
            return await self._api_failed(owner, finding, error, previous, timings)

        if new_change:
            await self._say(owner, "Normal", "Validated", _plan(generation, change))
        known = len(restarts)
        replicas, outcomes = await self._apply_live(
            owner, desired, desired_hash, restarts, edges, token, finding
        )
        for outcome in outcomes:
            if outcome.report is not None:
                timings.replica_apply_ms.append(outcome.report.duration_ms)
        if len(restarts) > known:
            # A replica named a restart the classification lacked (its config was not the
            # record's, e.g. before the first apply): roll that scope after all.
            try:
                edges, nodes = await self._roll(owner, restarts, edges, nodes, stamps)
            except KubeApiError as error:
                return await self._api_failed(owner, finding, error, previous, timings)
        clock = timings.mark("replicas", clock)

        failed = [o for o in outcomes if o.state in ("Failed", "Unreachable")]
        edge_rolls = any(r.scope == "edge" and r.config_hash == desired_hash for r in restarts)
        committed = not new_change
        open_restarts, rollouts, pending = self._restarts_left(
            restarts, edges, nodes, outcomes, desired_hash
        )
        try:
            if new_change and (not failed or edge_rolls):
                await self._commit(owner, desired, generation, stamps, restarts, change, outcomes)
                committed = True
            if (
                committed
                and self._state is not None
                and self._state.restarts != tuple(open_restarts)
            ):
                await self._save_state(owner, _replace_restarts(self._state, open_restarts))
                for record in restarts:
                    if record not in open_restarts:
                        await self._say(
                            owner,
                            "Normal",
                            "RolledOut",
                            f"restart {record.scope} done for config {record.config_hash[:12]}",
                        )
        except KubeApiError as error:
            return await self._api_failed(owner, finding, error, previous, timings)

        restarting_nodes = {_node_of(r.scope) for r in open_restarts if r.scope != "edge"}
        nodes_seen = node_results(node_ids, outcomes, restarting_nodes)
        self._judge(finding, committed, outcomes, replicas, edges, open_restarts, rollouts, pending)
        finding.replicas = outcomes
        finding.nodes = nodes_seen
        if finding.applied:
            self._effective = desired_hash
        finding.applied_hash = self._effective or previous.get("appliedConfigHash") or ""
        try:
            await self._report(owner, finding, previous, nodes_seen)
        except KubeApiError as error:
            return await self._api_failed(owner, finding, error, previous, timings)
        timings.mark("status", clock)
        timings.finished_at = time.monotonic()
        if self._on_pass is not None:
            self._on_pass(timings)

        if finding.degraded:
            return PassResult(retry=True)
        if _in_motion(edges, nodes) or any(node.draining_runs for node in nodes_seen):
            # A rollout, ours or anyone's (`kubectl rollout restart`), or a drain: the nodes'
            # progress (a superseded process finishing its runs) changes with no event to say so.
            return PassResult(recheck_after=_MOTION_RECHECK_S)
        if finding.progressing or not finding.applied:
            return PassResult(recheck_after=_RECHECK_S)
        if any(node.state != "Acked" for node in nodes_seen):
            delay, self._nodes_recheck = (
                self._nodes_recheck,
                min(self._nodes_recheck * 2, _NODES_RECHECK_S),
            )
            return PassResult(recheck_after=delay)
        self._nodes_recheck = 1.0
        return PassResult()

    # -- steps -----------------------------------------------------------------------------------

    async def _invalid(
        self, owner: Owner, generation: int, error: ConfigError, previous: Mapping[str, Any]
    ) -> PassResult:
        finding = Finding(generation, valid=False, problems=error.problems)
        count = len(error.problems)
        shown = "; ".join(str(p) for p in error.problems[:10])
        more = f" and {count - 10} more" if count > 10 else ""
        await self._say(
            owner,
            "Warning",
            "InvalidSpec",
            f"generation {generation} refused, the running config is kept: {shown}{more}",
        )
        await self._write_status(owner, build_status(finding, previous, None, now()), previous)
        return PassResult()  # a new generation brings the next chance; retrying cannot help

    async def _api_failed(
        self,
        owner: Owner,
        finding: Finding,
        error: KubeApiError,
        previous: Mapping[str, Any],
        timings: PassTimings,
    ) -> PassResult:
        finding.degraded.append(f"Kubernetes API: {error}")
        finding.degraded_reason = "KubernetesAPIError"
        finding.waiting = ("ApplyFailed", "the Kubernetes API refused a call; retrying")
        finding.applied_hash = self._effective or previous.get("appliedConfigHash") or ""
        await self._say(owner, "Warning", "Degraded", str(error))
        try:
            await self._write_status(
                owner, build_status(finding, previous, self._last_change, now()), previous
            )
        except KubeApiError as again:
            logger.warning("%s/%s: cannot write status: %s", owner.namespace, owner.name, again)
        timings.finished_at = time.monotonic()
        return PassResult(retry=True)

    async def _load_state(self, owner: Owner) -> AppliedState | None:
        if self._state_owner == owner.uid:
            return self._state
        path = resource_path(
            "v1", "configmaps", owner.namespace, conventions.state_configmap_name(owner.name)
        )
        try:
            configmap = await self._api.get(path, what="read the applied record")
        except KubeNotFound:
            configmap = None
        state = None
        if configmap is not None and _owned_by(configmap, owner):
            state = await asyncio.to_thread(decode_state, configmap)
        self._state, self._state_owner = state, owner.uid
        if state is not None:
            self._written_hash = None  # check the ConfigMap once, on the first write
        return state

    async def _save_state(self, owner: Owner, state: AppliedState) -> None:
        body = await asyncio.to_thread(state_configmap, owner, state)
        name = conventions.state_configmap_name(owner.name)
        await self._api.apply(
            resource_path("v1", "configmaps", owner.namespace, name),
            body,
            what="write the applied record",
        )
        self._state = state

    async def _configmap_base(self, owner: Owner) -> EdgeConfig | None:
        """What the Edge ConfigMap holds before the operator's first apply (pods started from it),
        or None when there is none or it does not load."""
        path = resource_path(
            "v1", "configmaps", owner.namespace, conventions.edge_configmap_name(owner.name)
        )
        try:
            configmap = await self._api.get(path, what="read the Edge ConfigMap")
        except KubeNotFound:
            return None
        text = (configmap.get("data") or {}).get(conventions.CONFIG_KEY)
        if not text:
            return None
        try:
            return await asyncio.to_thread(load_text, text)
        except ConfigError:
            return None

    async def _write_configmap(self, owner: Owner, config: EdgeConfig, digest: str) -> None:
        name = conventions.edge_configmap_name(owner.name)
        path = resource_path("v1", "configmaps", owner.namespace, name)
        if self._written_hash is None:
            try:
                found = await self._api.get(path, what="read the Edge ConfigMap")
                annotations = found["metadata"].get("annotations") or {}
                self._written_hash = annotations.get(conventions.CONFIG_HASH_ANNOTATION, "")
            except KubeNotFound:
                self._written_hash = ""
        if self._written_hash == digest:
            return
        body = await asyncio.to_thread(edge_configmap, owner, config, digest)
        await self._api.apply(path, body, what="write the Edge ConfigMap")
        self._written_hash = digest

    async def _roll(
        self,
        owner: Owner,
        restarts: Sequence[RestartRecord],
        edges: list[Workload],
        nodes: dict[str, list[Workload]],
        stamps: dict[str, str],
    ) -> tuple[list[Workload], dict[str, list[Workload]]]:
        """Stamp the workloads of each restart with its config hash (no-op when stamped)."""
        for record in restarts:
            targets = edges if record.scope == "edge" else nodes.get(_node_of(record.scope), [])
            rolled: list[Workload] = []
            for workload in targets:
                stamped = await stamp(self._api, owner.namespace, workload, record.config_hash)
                if stamped.stamp != workload.stamp:
                    rolled.append(stamped)
                stamps[stamped.key] = record.config_hash
                targets[targets.index(workload)] = stamped
            if rolled:
                names = ", ".join(w.key for w in rolled)
                await self._say(
                    owner,
                    "Normal",
                    "Rolling",
                    f"restart {record.scope}: stamped {names} with config "
                    f"{record.config_hash[:12]}",
                )
        return edges, nodes

    async def _admin_token(self, owner: Owner, config: EdgeConfig) -> str | None:
        """The admin token from Secret NAME-edge-admin (key `token`); None when the config's
        admin API takes no token."""
        admin = config.edge.admin
        if not admin.token_hash_sha256 and not admin.token_file:
            return None
        cached = self._token
        if cached is not None and time.monotonic() - cached[1] < _TOKEN_TTL_S:
            return cached[0]
        name = conventions.admin_secret_name(owner.name)
        secret = await self._api.get(
            resource_path("v1", "secrets", owner.namespace, name),
            what=f"read the admin token Secret {name}",
        )
        encoded = (secret.get("data") or {}).get(conventions.ADMIN_TOKEN_KEY)
        token = base64.b64decode(encoded).decode().strip() if encoded else None
        self._token = (token, time.monotonic())
        return token

    async def _apply_live(
        self,
        owner: Owner,
        desired: EdgeConfig,
        desired_hash: str,
        restarts: list[RestartRecord],
        edges: Sequence[Workload],
        token: str | None,
        finding: Finding,
    ) -> tuple[list[EdgeReplica], list[ReplicaOutcome]]:
        """Every ready replica of the current pod template, brought to the desired config."""
        try:
            admin_port = split_listener(desired.edge.admin.listen)[1]
            replicas = await self._finder.replicas(owner.namespace, owner.name, admin_port)
        except KubeApiError as error:
            finding.degraded.append(f"cannot list the Edge replicas: {error}")
            finding.degraded_reason = "KubernetesAPIError"
            return [], []
        edge_stamps = {w.stamp for w in edges}
        current = [r for r in replicas if r.stamp is None or not edges or r.stamp in edge_stamps]
        ready = [r for r in current if r.ready]
        document = desired.model_dump(mode="json", exclude_unset=True)
        outcomes: list[ReplicaOutcome] = []
        for _ in range(2):  # a second round when a replica names a restart the change lacked
            restarting = sorted({r.scope for r in restarts if r.scope.startswith("node:")})
            body = await asyncio.to_thread(apply_body, document, restarting)
            outcomes = await apply_on_replicas(self._admin, ready, body, desired_hash, token)
            named = {s for o in outcomes for s in o.restart_scopes}
            missing = named - {r.scope for r in restarts}
            if not missing:
                break
            for scope in sorted(missing):
                restarts.append(RestartRecord(scope, desired_hash))
            if "edge" in missing:
                break  # the Edge rolls: its replicas are replaced, not refreshed
        waiting_for = {r.scope for r in restarts}
        outcomes = [
            replace(o, state="AwaitingRestart")
            if o.state == "Failed" and o.restart_scopes and set(o.restart_scopes) <= waiting_for
            else o
            for o in outcomes
        ]
        outcomes += [
            ReplicaOutcome(r, "Replaced", "its pod template is being replaced")
            for r in replicas
            if r not in current
        ]
        if admin_port == 0 or _loopback(desired.edge.admin.listen):
            for outcome in outcomes:
                if outcome.state == "Unreachable":
                    finding.degraded.append(
                        f"edge.admin.listen is {desired.edge.admin.listen}: the operator cannot "
                        "reach a replica there; listen on 0.0.0.0 with edge.admin.tokenFile"
                    )
                    break
        return current, outcomes

    async def _commit(
        self,
        owner: Owner,
        desired: EdgeConfig,
        generation: int,
        stamps: Mapping[str, str],
        restarts: Sequence[RestartRecord],
        change: ChangeReport | None,
        outcomes: Sequence[ReplicaOutcome],
    ) -> None:
        state = AppliedState(
            desired, config_hash(desired), generation, dict(stamps), tuple(restarts)
        )
        await self._save_state(owner, state)
        if change is None:
            ready = sum(o.state == "Applied" for o in outcomes)
            await self._say(
                owner,
                "Normal",
                "AppliedLive",
                f"generation {generation} (config {state.config_hash[:12]}) is the first applied: "
                f"{conventions.edge_configmap_name(owner.name)} written, {ready} ready "
                f"replica{'s' if ready != 1 else ''} run{'s' if ready == 1 else ''} it",
            )
        elif not restarts:
            applied = sum(o.state == "Applied" for o in outcomes)
            paths = len(change.live_paths) if change is not None else 0
            await self._say(
                owner,
                "Normal",
                "AppliedLive",
                f"generation {generation} (config {state.config_hash[:12]}) applied live on "
                f"{applied} replica{'s' if applied != 1 else ''}: {paths} live "
                f"path{'s' if paths != 1 else ''}",
            )

    def _restarts_left(
        self,
        restarts: Sequence[RestartRecord],
        edges: Sequence[Workload],
        nodes: Mapping[str, Sequence[Workload]],
        outcomes: Sequence[ReplicaOutcome],
        desired_hash: str,
    ) -> tuple[list[RestartRecord], list[RolloutRecord], list[PendingRestart]]:
        """Which restarts are not done yet, the rollouts behind them, and why each waits.

        `edge` is done when its workloads rolled out and every ready replica runs the desired
        config; `node:<id>` when its workloads rolled out and the node runs the desired payload
        on every replica. A scope without a workload is done only when that holds too: someone
        restarted it by hand.
        """
        left: list[RestartRecord] = []
        rollouts: list[RolloutRecord] = []
        pending: list[PendingRestart] = []
        asked = [o for o in outcomes if o.state != "Replaced"]
        replicas_current = bool(asked) and all(
            o.state == "Applied" and o.config_hash == desired_hash for o in asked
        )
        for record in restarts:
            if record.scope == "edge":
                workloads = list(edges)
                selector, what = conventions.edge_selector(self.name), "the Edge"
                arrived = replicas_current
            else:
                node_id = _node_of(record.scope)
                workloads = list(nodes.get(node_id, ()))
                selector = conventions.node_selector(self.name, node_id)
                what = f"node {node_id}"
                views = [
                    n
                    for o in outcomes
                    if o.status is not None
                    for n in o.status.nodes
                    if n.node_id == node_id
                ]
                arrived = bool(views) and all(n.current for n in views)
            rollouts += [
                RolloutRecord(record.scope, w.key, w.stamp, w.rollout.phase, w.rollout.message)
                for w in workloads
            ]
            rolled = all(w.rollout.phase == "Complete" for w in workloads)
            if rolled and arrived:
                continue
            left.append(record)
            if not workloads:
                reason = (
                    f"no workload labelled {selector} in namespace {self.namespace}: "
                    f"restart {what} by hand"
                )
            elif not rolled:
                reason = "rolling out"
            else:
                reason = f"rolled out; waiting for {what} to run the new config"
            pending.append(PendingRestart(record.scope, reason))
        return left, rollouts, pending

    def _judge(
        self,
        finding: Finding,
        committed: bool,
        outcomes: Sequence[ReplicaOutcome],
        replicas: Sequence[EdgeReplica],
        edges: Sequence[Workload],
        open_restarts: Sequence[RestartRecord],
        rollouts: Sequence[RolloutRecord],
        pending: Sequence[PendingRestart],
    ) -> None:
        """Fill in Applied, Progressing and Degraded from what the pass saw."""
        for outcome in outcomes:
            if outcome.state in ("Failed", "Unreachable"):
                finding.degraded.append(
                    f"replica {outcome.replica.name} {outcome.state.lower()}: {outcome.reason}"
                )
                finding.degraded_reason = finding.degraded_reason or (
                    "ReplicaUnreachable" if outcome.state == "Unreachable" else "ReplicaFailed"
                )
        stalled = [r for r in rollouts if r.state == "Stalled"]
        for record in stalled:
            finding.degraded.append(f"rollout of {record.workload} stalled: {record.message}")
            finding.degraded_reason = finding.degraded_reason or "RolloutStalled"
        finding.rollouts = rollouts
        # One entry per scope: a workload's rollout says more than "pending".
        seen: set[str] = set()
        unique = []
        for item in pending:
            if item.scope not in seen:
                seen.add(item.scope)
                unique.append(item)
        finding.pending = unique
        finding.progressing = bool(open_restarts) and not stalled
        ready = [o for o in outcomes if o.state == "Applied"]
        asked = [o for o in outcomes if o.state != "Replaced"]
        if not committed:
            finding.waiting = ("ApplyFailed", "the change is not applied on every replica yet")
        elif open_restarts:
            scopes = ", ".join(r.scope for r in open_restarts)
            finding.waiting = ("RestartPending", f"waiting for the restart of {scopes}")
        elif not replicas and not edges:
            finding.waiting = (
                "NoEdgeWorkload",
                f"no Edge workload labelled {conventions.edge_selector(self.name)} in namespace "
                f"{self.namespace}",
            )
            finding.degraded.append(finding.waiting[1])
            finding.degraded_reason = finding.degraded_reason or "NoEdgeWorkload"
        elif not ready:
            finding.waiting = ("WaitingForReplicas", "no ready Edge replica yet")
        elif len(ready) < len(asked):
            finding.waiting = ("ApplyFailed", "not every ready replica runs the desired config")
        else:
            finding.applied = True

    async def _report(
        self,
        owner: Owner,
        finding: Finding,
        previous: Mapping[str, Any],
        nodes_seen: Sequence[NodeResult],
    ) -> None:
        last_change = (
            self._last_change if self._last_change is not None else previous.get("lastChange")
        )
        status = build_status(finding, previous, last_change, now())
        if finding.degraded:
            await self._say(owner, "Warning", "Degraded", "; ".join(finding.degraded))
        failed_nodes = [n for n in nodes_seen if n.state == "Failed"]
        if failed_nodes:
            shown = "; ".join(f"{n.node_id}: {n.reason}" for n in failed_nodes[:10])
            await self._say(owner, "Warning", "NodeFailed", shown)
        for item in finding.pending:
            if item.reason.startswith("no workload"):
                await self._say(owner, "Warning", "RestartPending", f"{item.scope}: {item.reason}")
        if finding.applied and not finding.degraded and not finding.progressing:
            await self._say(
                owner, "Normal", "Ready", f"config {finding.desired_hash[:12]} is in effect"
            )
        await self._write_status(owner, status, previous)

    async def _write_status(
        self, owner: Owner, status: dict[str, Any], previous: Mapping[str, Any]
    ) -> None:
        """Patch the status subresource, unless it would change nothing."""
        if _same_status(status, self._last_status) or _same_status(status, previous):
            self._last_status = status
            return
        path = resource_path(
            f"{conventions.GROUP}/{conventions.VERSION}",
            conventions.PLURAL,
            owner.namespace,
            owner.name,
            "status",
        )
        await self._api.merge_patch(path, {"status": status}, what="write the status")
        self._last_status = status

    async def _say(self, owner: Owner, kind: EventType, reason: str, message: str) -> None:
        """An Event, once per distinct reason and message (retries do not repeat it)."""
        key = (reason, message)
        if key in self._said:
            return
        if len(self._said) > 256:
            self._said.clear()
        self._said.add(key)
        self._events.post(owner, kind, reason, message)


def _plan(generation: int, change: ChangeReport | None) -> str:
    """The Validated event: what the operator is about to do with a generation."""
    if change is None:
        return f"generation {generation} is valid; first apply (no config applied before)"
    if not change.changed:
        return f"generation {generation} is valid; nothing in effect changes"
    live = len(change.live_paths)
    parts = [f"{live} live path{'s' if live != 1 else ''}"]
    if change.restart_scopes:
        parts.append(f"restart {', '.join(change.restart_scopes)}")
    return f"generation {generation} is valid: {'; '.join(parts)}"


def _node_of(scope: str) -> str:
    return scope.removeprefix("node:")


def _loopback(listen: str) -> bool:
    from iop.edgeconfig import is_loopback_listener

    return is_loopback_listener(listen)


def _owned_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    references = obj.get("metadata", {}).get("ownerReferences") or ()
    return any(ref.get("uid") == owner.uid for ref in references)


def _replace_restarts(state: AppliedState, restarts: Sequence[RestartRecord]) -> AppliedState:
    return AppliedState(
        state.config, state.config_hash, state.generation, state.stamps, tuple(restarts)
    )


def _in_motion(edges: Sequence[Workload], nodes: Mapping[str, Sequence[Workload]]) -> bool:
    """Whether a workload of the EdgeConfig is rolling out (whoever started it)."""
    workloads = [*edges, *(w for items in nodes.values() for w in items)]
    return any(w.rollout.phase == "Progressing" for w in workloads)


def _same_status(status: Mapping[str, Any], other: Mapping[str, Any] | None) -> bool:
    """Equal but for the conditions' transition times (which only move with their status)."""
    if other is None:
        return False
    return _comparable(status) == _comparable(other)


def _comparable(status: Mapping[str, Any]) -> dict[str, Any]:
    result = {k: v for k, v in status.items() if k != "conditions"}
    result["conditions"] = sorted(
        (
            (
                c.get("type"),
                c.get("status"),
                c.get("reason"),
                c.get("message"),
                c.get("observedGeneration"),
            )
            for c in status.get("conditions") or ()
        ),
        key=str,
    )
    return result
