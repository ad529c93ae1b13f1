"""Going back to the stable revision: a restart that failed its gate, a config an Edge rolled back.

A failed gate (`gating.py`) puts every workload stamped with the desired config back on the stable
revision's stamps, the Edge ConfigMap back on the stable config, and drops the desired config's
restarts from the applied record. A config an Edge rolled back is taken off every replica that
still serves it: each goes back to the stable config by its own revision of it (`GET /revisions`),
or by the operator's copy. docs/rollout.md has the rules.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from iop.edgeconfig import classify

from .adminapi import EdgeAdmin, apply_body, revision_body
from .deciding import Observation, Plan
from .documents import AppliedState, Owner, StableRevision
from .errors import AdminApiError, AdminUnreachable
from .gating import FailedRestart, pods_config, stamps_back
from .kubeapi import KubeApi
from .recording import Recorder
from .revisions import restores
from .rolling import stamp
from .status import HistoryEntry
from .tokensecrets import TokenRead
from .values import EdgeReplica, ReplicaOutcome, ReplicaRevisions

logger = logging.getLogger(__name__)


def can_go_back(observation: Observation) -> bool:
    """Whether a stable revision other than the desired config is there to go back to."""
    stable = observation.applied.stable if observation.applied is not None else None
    return stable is not None and stable.config_hash != observation.desired_hash


async def fail_gate(
    api: KubeApi,
    recorder: Recorder,
    owner: Owner,
    observation: Observation,
    current: Plan,
    failures: Sequence[FailedRestart],
) -> tuple[Observation, Plan, dict[str, str], str]:
    """A restart failed its gate: back on the stable revision (`go_back`); the observation, the
    plan and the stamps after it, and why, for the revision's outcome."""
    assert observation.applied is not None and observation.applied.stable is not None
    stable = observation.applied.stable
    observation, current = await go_back(api, recorder, owner, observation, current, stable)
    stamps = dict(observation.applied.stamps) if observation.applied is not None else {}
    reason = "; ".join(str(f) for f in failures) + (
        f"; back on the pod templates of the stable config {stable.config_hash[:12]}"
    )
    return observation, current, stamps, reason


async def go_back(
    api: KubeApi,
    recorder: Recorder,
    owner: Owner,
    observation: Observation,
    current: Plan,
    stable: StableRevision,
) -> tuple[Observation, Plan]:
    """A restart failed its gate: every workload stamped with the desired config back on the
    stable revision's stamp (its last good template, so the Deployment controller scales the
    old ReplicaSet up again and removes the new pod), the ConfigMap back on the stable config,
    and the record without the desired config's restarts (nothing rolls it again)."""
    edges = list(observation.edges)
    nodes = {node: list(items) for node, items in observation.nodes.items()}
    for workload, stamp_of in stamps_back(observation, stable):
        restored = await stamp(api, owner.namespace, workload, stamp_of)
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
    await recorder.save(owner, record)
    observation = replace(
        observation,
        applied=record,
        edges=tuple(edges),
        nodes={node: tuple(items) for node, items in nodes.items()},
    )
    current = replace(current, restarts=record.restarts)
    await recorder.write_configmap(owner, *pods_config(observation, current, held=True))
    return observation, current


async def read_logs(
    admin: EdgeAdmin, outcomes: Sequence[ReplicaOutcome], token: str | None
) -> dict[str, ReplicaRevisions]:
    """The revision log of every replica that answered (`GET /revisions`), by name; one that
    fails now is left out (its apply's outcome already says why)."""
    answering = [o.replica for o in outcomes if o.status is not None or o.rolled_back]

    async def read(replica: EdgeReplica) -> ReplicaRevisions | None:
        try:
            return await admin.revisions(replica, token)
        except AdminApiError as error:
            logger.info("%s: no revision log: %s", replica.name, error)
            return None

    logs = await asyncio.gather(*(read(r) for r in answering))
    return {log.replica.name: log for log in logs if log is not None}


async def converge(
    admin: EdgeAdmin,
    record: AppliedState | None,
    history: Sequence[HistoryEntry],
    desired_hash: str,
    outcomes: Sequence[ReplicaOutcome],
    views: Mapping[str, ReplicaRevisions],
    tokens: TokenRead,
    held: bool,
) -> list[ReplicaOutcome]:
    """When an Edge rolled the desired config back: every replica that still serves it put back
    on the stable config of `record` (by its own revision of it), and every replica's outcome
    says the config was rolled back. Otherwise the outcomes as they are."""
    rolled_back = held or any(o.rolled_back for o in outcomes)
    rolled_back = rolled_back or any(
        (found := view.newest_of(desired_hash)) is not None and found.outcome == "rolled_back"
        for view in views.values()
    )
    if not rolled_back:
        return list(outcomes)
    stable = record.stable if record is not None else None
    prefer = stable.config_hash if stable is not None else ""
    stable_hash, due = restores(
        desired_hash, history, outcomes, views, "" if prefer == desired_hash else prefer
    )
    settled = {o.replica.name: o for o in outcomes}
    token = tokens.admin_token
    restarting = nodes_going_back(record, stable_hash) if due else []
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
            await admin.apply(order.replica, body, token)
            status = await admin.status(order.replica, token)
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


def nodes_going_back(record: AppliedState | None, stable_hash: str) -> list[str]:
    """The node scopes between the recorded config and the stable one that need a restart:
    their workloads go back to their stable templates (a failed gate), so the replicas put
    back on the stable config hold them rather than refuse."""
    if record is None or record.stable is None or record.stable.config_hash != stable_hash:
        return []
    change = classify(record.config, record.stable.config)
    return sorted(s for s in change.restart_scopes if s.startswith("node:"))
