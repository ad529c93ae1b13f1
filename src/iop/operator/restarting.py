"""The restarts a pass drives, and the live apply that may name more of them.

`roll` stamps each workload a plan restarts (`rolling.stamp`, which rolls it), noting first what
its old processes served: the baseline the restart's gate holds the new ones to (`gating.py`).
`apply_live` brings every ready Edge replica to the desired config (`liveapplying.py`), a second
time when a replica names a node restart the change lacked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from .adminapi import EdgeAdmin, apply_body
from .announcing import Announcer
from .deciding import Observation, Plan, node_of, stamps_due, with_restarts
from .documents import NodeBaseline, Owner
from .gating import edge_baseline, node_baseline
from .kubeapi import KubeApi
from .liveapplying import apply_on_replicas
from .metrics import OperatorMetrics
from .recording import Recorder
from .rolling import stamp
from .tokensecrets import TokenRead
from .values import EdgeReplica, ReplicaOutcome


async def roll(
    api: KubeApi,
    recorder: Recorder,
    announcer: Announcer,
    owner: Owner,
    observation: Observation,
    current: Plan,
    stamps: dict[str, str],
    *,
    last_outcomes: Sequence[ReplicaOutcome],
    metrics: OperatorMetrics | None,
) -> Observation:
    """Stamp each workload `stamps_due` names (which rolls it); the observation with the stamped
    workloads, and `stamps` (workload -> hash, what the record keeps) updated. The baselines are
    taken from `last_outcomes` (how each replica saw the nodes in the last pass)."""
    rolled: dict[str, list[str]] = {}
    edges = list(observation.edges)
    nodes = {node: list(items) for node, items in observation.nodes.items()}
    for workload, record in stamps_due(observation, current):
        if record.scope == "edge" and (
            recorder.edge_baseline is None
            or recorder.edge_baseline.config_hash != record.config_hash
        ):  # what the old pods served so far, to hold the new ones to
            recorder.edge_baseline = edge_baseline(last_outcomes, record.config_hash)
        kept = recorder.baselines.get(record.scope)
        if workload.node_id and (kept is None or kept.config_hash != record.config_hash):
            baseline = node_baseline(last_outcomes, workload.node_id, record.config_hash)
            if baseline is not None:  # the old process, to hold the new one to
                recorder.baselines[record.scope] = baseline
        stamped = await stamp(api, owner.namespace, workload, record.config_hash)
        targets = edges if record.scope == "edge" else nodes[stamped.node_id]
        targets[targets.index(workload)] = stamped
        rolled.setdefault(record.scope, []).append(stamped.key)
        if metrics is not None:
            metrics.rollouts.labels(record.scope.partition(":")[0]).inc()
    for record in current.restarts:
        scope_targets = (
            edges if record.scope == "edge" else nodes.get(record.scope.removeprefix("node:"), [])
        )
        stamps.update((w.key, record.config_hash) for w in scope_targets)
        if record.scope in rolled:
            announcer.say(
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


async def apply_live(
    admin: EdgeAdmin,
    baselines: dict[str, NodeBaseline],
    observation: Observation,
    current: Plan,
    ready: Sequence[EdgeReplica],
    tokens: TokenRead,
) -> tuple[list[ReplicaOutcome], Plan]:
    """Every ready replica brought to the desired config; a second round when a replica names a
    node restart the change lacked (the Edge's own restart ends it: its replicas are replaced,
    not refreshed). A node restart under way tells the replicas which instances it replaces
    (from its baseline in `baselines`)."""
    document = observation.desired.model_dump(mode="json", exclude_unset=True)
    outcomes: list[ReplicaOutcome] = []
    for _ in range(2):
        restarting = current.node_restarts()
        replacing = {
            node_of(scope): baseline.instances
            for scope, baseline in baselines.items()
            if scope in restarting and baseline.config_hash == observation.desired_hash
        }
        body = await asyncio.to_thread(apply_body, document, restarting, replacing)
        outcomes = await apply_on_replicas(
            admin, ready, body, observation.desired_hash, tokens.admin_token
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
