"""The EdgeConfig's `.status`, as one model: the reconcile writes it, the CRD's schema is made
from it (`crds.status_schema`), so the API server never drops a field the writer sets.

It follows the Kubernetes API conventions and kstatus (docs/operator.md, "Status"): a top-level
`observedGeneration` and `conditions[]` (type, status, reason in CamelCase, message,
observedGeneration, lastTransitionTime), with `Ready` as the summary and the abnormal-true
`Reconciling` and `Stalled` that Flux, Helm 4's `--wait` and Argo CD read.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

#: The conditions an EdgeConfig's status carries.
ConditionType = Literal[
    "Ready", "Reconciling", "Stalled", "Valid", "Applied", "Progressing", "Degraded"
]
#: In the order they are written (the summary first, then kstatus's, then the product's own).
CONDITION_TYPES: tuple[ConditionType, ...] = (
    "Ready",
    "Reconciling",
    "Stalled",
    "Valid",
    "Applied",
    "Progressing",
    "Degraded",
)
#: A condition's status, as metav1.Condition spells it.
ConditionStatus = Literal["True", "False", "Unknown"]
#: What the last apply did on an Edge replica.
ReplicaEntryState = Literal["Applied", "Failed", "Unreachable", "Replaced", "AwaitingRestart"]
#: Where a node is, across every Edge replica.
NodeEntryState = Literal["Acked", "Failed", "NotConnected", "Restarting"]
#: How far a workload's rollout is.
RolloutEntryState = Literal["Progressing", "Complete", "Stalled", "Missing"]
#: How a cluster revision came out, across the Edge replicas (docs/operator.md, "Revisions").
RevisionOutcome = Literal[
    "Applying", "Watching", "Canary", "Promoted", "Unjudged", "Applied", "RolledBack", "Superseded"
]
#: The outcomes that never change again.
FINAL_OUTCOMES: frozenset[RevisionOutcome] = frozenset(
    {"Promoted", "Unjudged", "Applied", "RolledBack", "Superseded"}
)
#: The outcomes of a revision that was good to serve (a stable one).
GOOD_OUTCOMES: frozenset[RevisionOutcome] = frozenset({"Promoted", "Unjudged", "Applied"})


class _Part(BaseModel):
    """A piece of the status: camelCase on the wire, immutable, tolerant of unknown keys (a
    status written by another release of the operator)."""

    model_config = ConfigDict(
        frozen=True, alias_generator=to_camel, validate_by_name=True, extra="ignore"
    )


def _text(description: str) -> object:
    return Field(description=description)


class Condition(_Part):
    """metav1.Condition, as every Kubernetes API spells it."""

    type: Annotated[
        ConditionType,
        _text(
            "Ready (the summary), Reconciling and Stalled (kstatus), Valid, Applied, "
            "Progressing or Degraded."
        ),
    ]
    status: Annotated[ConditionStatus, _text("True, False or Unknown.")]
    reason: Annotated[str, _text("Why, in one CamelCase word.")]
    message: Annotated[str, _text("Why, for people.")]
    observed_generation: Annotated[
        int, _text("The .metadata.generation this condition was set for.")
    ]
    last_transition_time: Annotated[
        str,
        Field(
            description="When the status last changed (RFC 3339).",
            json_schema_extra={"format": "date-time"},
        ),
    ]


class ProblemEntry(_Part):
    """One problem of an invalid spec."""

    path: Annotated[str, _text("Where, in the spec's spelling (nodes[0].providers[1].capacity).")]
    message: Annotated[str, _text("What is wrong.")]


class RestartPathEntry(_Part):
    """A changed path that needs a restart, and of what."""

    path: Annotated[str, _text("The changed path.")]
    scope: Annotated[str, _text("What restarts: edge, or node:<id>.")]


class LastChange(_Part):
    """The last change the operator acted on, as classified against the config last applied."""

    generation: Annotated[int, _text("The .metadata.generation it came from.")]
    from_config_hash: Annotated[str, _text("SHA-256 of the config it changed.")]
    to_config_hash: Annotated[str, _text("SHA-256 of the config it asks for.")]
    live_paths: Annotated[list[str], _text("Paths that apply live.")]
    restart_paths: Annotated[list[RestartPathEntry], _text("Paths that need a restart.")]
    restart_scopes: Annotated[list[str], _text("The restarts the change needs.")]
    changed_nodes: Annotated[list[str], _text("Nodes the change touches.")]
    changed_providers: Annotated[list[str], _text("Providers the change touches.")]
    changed_models: Annotated[list[str], _text("Models the change touches.")]
    omitted_paths: Annotated[
        int, _text("Paths left out of the lists above to keep the status small.")
    ]


class ReplicaEntry(_Part):
    """One Edge replica (pod) and the outcome of the last apply on it."""

    pod: Annotated[str, _text("The pod (or, for an Edge outside the cluster, its admin URL).")]
    address: Annotated[str, _text("Its admin API URL.")]
    state: Annotated[
        ReplicaEntryState,
        _text(
            "Applied (runs the desired config), Failed or Unreachable (named in Degraded), "
            "Replaced (its pod template is being rolled away), AwaitingRestart (it needs a "
            "restart the operator already waits for)."
        ),
    ]
    config_hash: Annotated[str, _text("SHA-256 of the config it runs.")]
    snapshot: Annotated[
        int | None,
        _text(
            "The replica's own counter of the configs it has run: 1 at its start, one more for "
            "each apply that changed something (not a Kubernetes generation)."
        ),
    ] = None
    reason: Annotated[str, _text("Why it is not Applied, when it is not.")]


class NodeEntry(_Part):
    """One node of the config, across every Edge replica."""

    node_id: Annotated[str, _text("The node's id.")]
    state: Annotated[
        NodeEntryState,
        _text(
            "Acked (runs the desired payload on every Edge replica), Failed (with the reason), "
            "NotConnected, or Restarting."
        ),
    ]
    reason: Annotated[str, _text("Why, when it is not Acked.")]
    draining_runs: Annotated[
        int | None,
        _text(
            "Runs the node's draining processes still finish (the most any Edge replica "
            "reports): a rollout's old pod, a SIGTERM; absent when none drains."
        ),
    ] = None


class RolloutEntry(_Part):
    """A workload the operator rolled for a restart, and how far its rollout is."""

    scope: Annotated[str, _text("The restart it is for: edge, or node:<id>.")]
    workload: Annotated[str, _text("Deployment/NAME.")]
    config_hash: Annotated[str, _text("The config hash its pod template is stamped with.")]
    state: Annotated[RolloutEntryState, _text("Progressing, Complete, Stalled or Missing.")]
    message: Annotated[str, _text("How far, as `kubectl rollout status` says it.")]


class HistoryEntry(_Part):
    """One cluster revision: a config the operator applied (live or by a restart)."""

    revision: Annotated[
        int, _text("Its number: one more than the last, for each config that came into effect.")
    ]
    config_hash: Annotated[str, _text("SHA-256 of its config.")]
    generation: Annotated[int, _text("The .metadata.generation it came from.")]
    applied_at: Annotated[
        str,
        Field(
            description="When the operator applied it (RFC 3339).",
            json_schema_extra={"format": "date-time"},
        ),
    ]
    live_paths: Annotated[list[str], _text("The paths it changed live (at most 10).")]
    restart_paths: Annotated[
        list[RestartPathEntry], _text("The paths it changed that needed a restart (at most 10).")
    ]
    omitted_paths: Annotated[int, _text("Paths left out of the two lists above.")] = 0
    outcome: Annotated[
        RevisionOutcome,
        _text(
            "Applying (not on every Edge replica yet), Watching or Canary (the Edges judge it by "
            "what it serves), Promoted (judged good), Unjudged (too little traffic to judge, "
            "kept), Applied (nothing to judge it by), RolledBack (an Edge judged it bad and put "
            "the stable revision back) or Superseded (a newer revision came before its verdict)."
        ),
    ]
    reason: Annotated[str, _text("Why it came out so, as the Edge said it.")] = ""
    check: Annotated[
        str | None,
        _text(
            "The check that decided: errors, first_token_p95, duration_p95, bake, traffic, or "
            "restart (its restart failed its gate)."
        ),
    ] = None
    restores: Annotated[
        int | None, _text("The earlier revision whose config this one is again.")
    ] = None
    share_percent: Annotated[
        int | None,
        _text("On canary: the share of the touched models' requests it served when last seen."),
    ] = None


class RevisionRollout(_Part):
    """The rollout of the newest revision, as the Edge replicas judge it."""

    stable: Annotated[
        int | None, _text("The revision last judged good (what a rollback returns to).")
    ] = None
    candidate: Annotated[int | None, _text("The revision being applied or judged now, if any.")] = (
        None
    )
    state: Annotated[RevisionOutcome, _text("The newest revision's outcome (see history).")]
    share_percent: Annotated[
        int | None,
        _text("During a canary, the share of the touched models' requests on the candidate."),
    ] = None
    check: Annotated[str | None, _text("The check that decided, once one did.")] = None
    message: Annotated[str | None, _text("What the Edges said of it, with the figures.")] = None
    rolled_back_config_hash: Annotated[
        str | None,
        _text(
            "SHA-256 of the config an Edge rolled back: the operator applies it no more, and "
            "puts every replica back on the stable config, until the spec asks for another."
        ),
    ] = None


class EdgeConfigStatus(_Part):
    """What the operator made of the spec; written only by the operator."""

    observed_generation: Annotated[
        int,
        _text(
            "The .metadata.generation the operator works on: written as soon as it sees a new "
            "generation (with Reconciling=True), so a generation not reflected here is not "
            "looked at yet."
        ),
    ] = 0
    conditions: Annotated[
        list[Condition],
        _text("Ready, Reconciling, Stalled, Valid, Applied, Progressing and Degraded."),
    ] = Field(default_factory=list)
    desired_config_hash: Annotated[
        str | None, _text("SHA-256 of the config the spec (and its token Secrets) asks for.")
    ] = None
    applied_config_hash: Annotated[
        str | None,
        _text(
            "SHA-256 of the config last in effect in full (every Edge replica runs it and every "
            "restart it needed is done)."
        ),
    ] = None
    config_short_hash: Annotated[
        str | None, _text("The first 12 characters of appliedConfigHash.")
    ] = None
    pending_restart: Annotated[
        str | None, _text("The restart scopes not done yet (edge, node:<id>), or none.")
    ] = None
    nodes_acked: Annotated[
        str | None,
        _text("Nodes running the desired config on every Edge replica / nodes in the config."),
    ] = None
    problems: Annotated[
        list[ProblemEntry], _text("Every problem of an invalid spec, with its path.")
    ] = Field(default_factory=list)
    last_change: Annotated[LastChange | None, _text("The last change the operator acted on.")] = (
        None
    )
    replicas: Annotated[
        list[ReplicaEntry] | None,
        _text("Each Edge replica (pod) and the outcome of the last apply on it."),
    ] = None
    nodes: Annotated[list[NodeEntry] | None, _text("Each node of the config.")] = None
    omitted_nodes: Annotated[
        int | None, _text("Nodes left out of .nodes to keep the status small (all Acked).")
    ] = None
    rollouts: Annotated[
        list[RolloutEntry] | None,
        _text("Workloads the operator rolled for restarts still to confirm, and how far."),
    ] = None
    revision: Annotated[
        int | None, _text("The stable cluster revision: the one the Edges serve as good.")
    ] = None
    rollout: Annotated[RevisionRollout | None, _text("The rollout of the newest revision.")] = None
    history: Annotated[
        list[HistoryEntry] | None,
        _text(
            "The newest 20 cluster revisions, newest first: kept here so an operator restart "
            "reads them back and numbers on."
        ),
    ] = None

    def condition(self, kind: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type == kind), None)

    def document(self) -> dict[str, object]:
        """The status as the API takes it (camelCase; unset parts left out, but for `rollout`'s:
        a merge patch keeps what it does not name, so they are sent as null, which removes
        them)."""
        document = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        if self.rollout is not None:
            document["rollout"] = self.rollout.model_dump(mode="json", by_alias=True)
        return document
