"""One reconcile pass of one EdgeConfig: observe, decide, act, report.

A pass is level-based: it reads what is and does what is missing, so running it again changes
nothing, and an operator killed at any point converges on restart without rolling anything twice. It
validates the spec; observes (the generation seen, the token Secrets, the applied record:
`recording.py`, the workloads, the replicas); decides (`deciding.plan`, against the config *last
applied*); acts (the Edge ConfigMap, the restarts and the live apply: `restarting.py`, going back
when a gate fails: `restoring.py`); decides again on what the acts returned (`deciding.judge`); and
reports (the record, the status and Events: `announcing.py`). What it writes and reads is watched
by name (`repairing.py`). docs/operator.md, "What happens to a change", has each step and why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from iop.aiokits import split_listener
from iop.edgeconfig import (
    ConfigError,
    EdgeConfig,
    UpstreamPolicy,
    config_hash,
    is_loopback_listener,
    load_data,
    with_token_hashes,
)

from .adminapi import EdgeAdmin
from .announcing import Announcer
from .deciding import (
    NextPass,
    Observation,
    Plan,
    Verdict,
    judge,
    live_targets,
    plan,
    settled_outcomes,
)
from .discovering import ReplicaFinder
from .documents import AppliedState, Owner
from .errors import KubeApiError
from .gating import came_through, failed_restarts, pods_config, worse_edge, worse_restarts
from .keeping import ConfigKeeper
from .kubeapi import KubeApi
from .liveapplying import read_replicas
from .metrics import EdgeConfigHealth, OperatorMetrics
from .pinning import Pinner
from .recording import Recorder
from .repairing import Repairer
from .restarting import apply_live, roll
from .restoring import can_go_back, converge, fail_gate, read_logs
from .revisions import HistoryStep, follow, held_back, needs_logs
from .rolling import edge_workloads, node_workloads
from .status import EventPoster, HistoryEntry, now
from .tokensecrets import SecretCache, TokenRead, read_tokens, reserved_refs
from .values import ReplicaOutcome, ReplicaRevisions

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
        self._on_pass = on_pass
        self._metrics = metrics
        self._last_success: float | None = None
        self._secrets = SecretCache()
        #: Secrets no token may come from (the certificates the operator makes).
        self._reserved = frozenset(reserved_secrets)
        self._recorder = Recorder(api)
        self._announcer = Announcer(api, events)
        self._nodes_recheck = 1.0
        #: The replicas' outcomes of the last pass (how each saw the nodes then).
        self._last_outcomes: Sequence[ReplicaOutcome] = ()
        #: The configs of the revisions, kept for a pin to a revision number.
        self._keeper = ConfigKeeper(api)
        self._pinner = Pinner(
            recorder=self._recorder,
            keeper=self._keeper,
            announcer=self._announcer,
            policy=policy,
            reserved=self._reserved,
        )
        self._repairer = Repairer(
            api=api,
            name=name,
            recorder=self._recorder,
            secrets=self._secrets,
            keeper=self._keeper,
            wake=lambda: self.wake(),
        )

    @property
    def applied(self) -> AppliedState | None:
        """The record of what was last applied, once a pass has read it."""
        return self._recorder.state

    async def stop(self) -> None:
        await self._repairer.stop()

    @property
    def health(self) -> EdgeConfigHealth:
        state = self._recorder.state
        applied_at = state.applied_at if state is not None else 0.0
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
        announcer = self._announcer
        try:
            spec = await self._pinner.config(owner, body, spec)
            previous = await announcer.mark_seen(owner, generation, previous)
            tokens = await read_tokens(self._api, owner, spec, self._secrets)
            self._repairer.watch(owner, tokens)
            if tokens.missing or tokens.invalid:
                await announcer.hold(owner, generation, tokens, previous)
                return PassResult(retry=not tokens.invalid, outcome="blocked")
            observation = await self._observe(owner, generation, spec, tokens)
            clock = timings.mark("observe", clock)
            verdict, step = await self._act(owner, observation, tokens, timings, previous)
            await self._keep(owner, previous, step.history, observation)
            clock = timings.mark("act", clock)
            await announcer.report(owner, verdict, previous, step, self._repairer.take())
        except KubeApiError as error:
            await announcer.api_failed(owner, generation, error, previous)
            return PassResult(retry=True, outcome="api_error")
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
        api, recorder, announcer = self._api, self._recorder, self._announcer
        current = plan(observation)
        if observation.new_change:
            announcer.validated(owner, observation, current)
        history = announcer.history_of(owner, previous)
        held = held_back(history, observation.desired_hash) is not None
        await recorder.write_configmap(owner, *pods_config(observation, current, held))
        stamps = dict(observation.applied.stamps) if observation.applied is not None else {}
        observation = await self._roll(owner, observation, current, stamps)
        failed_gate = ""
        gate = failed_restarts(observation, current)
        if gate and can_go_back(observation):
            observation, current, stamps, failed_gate = await fail_gate(
                api, recorder, owner, observation, current, gate
            )
            held = True
        asked, ready = live_targets(observation)
        if held:
            outcomes = await read_replicas(self._admin, ready, tokens.admin_token)
        else:
            outcomes, current = await apply_live(
                self._admin, recorder.baselines, observation, current, ready, tokens
            )
            worse = [
                *worse_restarts(observation, current, outcomes, recorder.baselines),
                *worse_edge(observation, current, outcomes, recorder.edge_baseline, time.time()),
            ]
            if worse and can_go_back(observation):
                observation, current, stamps, failed_gate = await fail_gate(
                    api, recorder, owner, observation, current, worse
                )
                held = True
        timings.replica_apply_ms += [o.report.duration_ms for o in outcomes if o.report]
        views: dict[str, ReplicaRevisions] = {}
        if held or needs_logs(history, observation.desired_hash, outcomes):
            views = await read_logs(self._admin, outcomes, tokens.admin_token)
            outcomes = await converge(
                self._admin,
                recorder.state,
                history,
                observation.desired_hash,
                outcomes,
                views,
                tokens,
                held,
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
            effective_hash=announcer.effective or str(previous.get("appliedConfigHash") or ""),
            in_effect_for=announcer.in_effect_for(observation, previous),
            committed_at=time.time(),
            admin_unreachable_hint=hint,
        )
        if self._metrics is not None and not held:
            for outcome in outcomes:  # the replicas asked to apply (not those already current)
                if outcome.report is not None or outcome.state in ("Failed", "Unreachable"):
                    self._metrics.live_applies.labels(outcome.state).inc()
        if verdict.record is not None:
            await recorder.save(owner, verdict.record)
        elif recorder.lost and recorder.state is not None:
            await recorder.save(owner, recorder.state)
        taken = (observation.new_change and verdict.record is not None) or any(
            o.rolled_back or (o.state == "Applied" and o.config_hash == observation.desired_hash)
            for o in outcomes
        )
        step = follow(
            history,
            desired_hash=observation.desired_hash,
            generation=observation.generation,
            taken=taken,
            change=announcer.last_change_of(previous),
            outcomes=outcomes,
            views=views,
            timestamp=now(),
            restarting=bool(verdict.finding.pending),
            failed_restart=failed_gate,
        )
        newest = step.history[0] if step.history else None
        settled = None
        if (
            newest is not None
            and recorder.state is not None
            and newest.config_hash == recorder.state.config_hash
        ):
            settled = newest.outcome
        through = came_through(recorder.state, settled)
        if through is not None:
            await recorder.save(owner, through)
            observation = replace(observation, applied=through)
            await recorder.write_configmap(owner, *pods_config(observation, current, held))
        self._last_outcomes = outcomes
        recorder.close_baselines(current.restarts)
        state = recorder.state
        if state is not None and recorder.baselines_changed(state):
            await recorder.save(owner, state)  # a baseline noted, or one done with
        return verdict, step

    async def _roll(
        self, owner: Owner, observation: Observation, current: Plan, stamps: dict[str, str]
    ) -> Observation:
        return await roll(
            self._api,
            self._recorder,
            self._announcer,
            owner,
            observation,
            current,
            stamps,
            last_outcomes=self._last_outcomes,
            metrics=self._metrics,
        )

    async def _observe(
        self, owner: Owner, generation: int, spec: EdgeConfig, tokens: TokenRead
    ) -> Observation:
        desired = await asyncio.to_thread(with_token_hashes, spec, tokens.hashes)
        desired_hash = config_hash(desired)
        applied = await self._recorder.load(owner)
        base = applied.config if applied is not None else None
        if applied is None:
            base = await self._recorder.configmap_base(owner)
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

    async def _keep(
        self,
        owner: Owner,
        previous: Mapping[str, Any],
        history: Sequence[HistoryEntry],
        observation: Observation,
    ) -> None:
        """A config that came into effect as a new revision is kept (`keeping.py`)."""
        known = {observation.desired_hash: observation.desired}
        if (record := self._recorder.state) is not None:
            known.setdefault(record.config_hash, record.config)
            if record.stable is not None:
                known.setdefault(record.stable.config_hash, record.stable.config)
        before = self._announcer.history_of(owner, previous)
        await self._keeper.keep(
            owner,
            [(e.revision, e.config_hash) for e in before],
            [(e.revision, e.config_hash) for e in history],
            known,
        )

    async def _refuse(
        self, owner: Owner, generation: int, error: ConfigError, previous: Mapping[str, Any]
    ) -> PassResult:
        """An invalid spec: every problem in the status and an Event; nothing else changes."""
        if not await self._announcer.refuse(owner, generation, error, previous):
            return PassResult(retry=True, outcome="api_error")
        # A new generation brings the next chance; retrying cannot help.
        return PassResult(outcome="invalid")

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
