"""The cluster's revisions: every config the operator applies, numbered, and how each came out.

A config that comes into effect with a new hash (live or by a restart) is the next cluster
revision, kept in `.status.history` (the newest `KEEP`), so a restarted operator reads it back
and numbers on. Its outcome comes from the Edge replicas' own logs (`GET /revisions`, matched by
config hash): rolled back when any replica rolled it back, promoted when every one ended it well.
A config an Edge rolled back is applied no more, and the replicas still serving it are put back
on the stable config (`restores`). Pure, like `deciding.py` (tests/operator/test_revisions.py);
docs/operator.md, "Revisions", has the rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from .status import (
    FINAL_OUTCOMES,
    GOOD_OUTCOMES,
    HistoryEntry,
    LastChange,
    RestartPathEntry,
    RevisionOutcome,
    RevisionRollout,
)
from .values import EdgeReplica, Event, ReplicaOutcome, ReplicaRevisions

#: Revisions the status keeps.
KEEP: Final = 20
#: Live paths and restart paths each revision lists.
MAX_PATHS: Final = 10
_MAX_REASON: Final = 400

#: The Edge's outcome of a revision -> the cluster's word for it.
_EDGE_OUTCOMES: Final[Mapping[str, RevisionOutcome]] = {
    "started": "Applied",
    "kept": "Applied",
    "watching": "Watching",
    "promoted": "Promoted",
    "unjudged": "Unjudged",
    "rolled_back": "RolledBack",
    "superseded": "Superseded",
}
#: Which replica's word decides a revision's outcome, first first (see `aggregate`).
_PRECEDENCE: Final[tuple[RevisionOutcome, ...]] = (
    "RolledBack",
    "Canary",
    "Watching",
    "Applying",
    "Superseded",
    "Promoted",
    "Unjudged",
    "Applied",
)
#: Outcomes while a revision is not settled: the operator looks again soon.
_UNSETTLED: Final[frozenset[RevisionOutcome]] = frozenset({"Applying", "Watching", "Canary"})


@dataclass(frozen=True, slots=True)
class ReplicaVerdict:
    """What one replica says of one config."""

    replica: str
    #: Applying: it does not run the config (nor did it end it) yet.
    outcome: RevisionOutcome
    #: Its own number for the revision, when its log keeps one.
    edge_revision: int | None = None
    reason: str = ""
    check: str = ""
    figures: str = ""
    share_percent: int | None = None


def verdicts_of(
    config_hash: str,
    outcomes: Sequence[ReplicaOutcome],
    views: Mapping[str, ReplicaRevisions],
) -> list[ReplicaVerdict]:
    """Each asked replica's word on `config_hash`: its log's newest revision of that hash, else
    what the apply answered (a refusal of a config it rolled back; an Edge with no log that runs
    it has applied it)."""
    verdicts = []
    for outcome in outcomes:
        if outcome.state == "Replaced":
            continue
        name = outcome.replica.name
        view = views.get(name)
        entry = view.newest_of(config_hash) if view is not None else None
        if entry is not None:
            word = _EDGE_OUTCOMES.get(entry.outcome, "Applied")
            candidate = outcome.status.candidate if outcome.status is not None else None
            share = None
            if (
                word == "Watching"
                and candidate is not None
                and candidate.config_hash == config_hash
                and candidate.mode == "canary"
            ):
                word, share = "Canary", candidate.share_percent
            verdicts.append(
                ReplicaVerdict(
                    name, word, entry.number, entry.reason, entry.check, entry.figures, share
                )
            )
        elif outcome.rolled_back:
            verdicts.append(ReplicaVerdict(name, "RolledBack", reason=outcome.reason))
        elif outcome.state == "Applied" and outcome.config_hash == config_hash:
            verdicts.append(ReplicaVerdict(name, "Applied"))
        else:
            verdicts.append(ReplicaVerdict(name, "Applying", reason=outcome.reason))
    return verdicts


def aggregate(verdicts: Sequence[ReplicaVerdict]) -> tuple[RevisionOutcome, ReplicaVerdict | None]:
    """The revision's outcome across replicas, and the replica whose word decided it: rolled
    back when any replica rolled it back; judged while any judges it; applying while any has not
    taken it; superseded when any saw another change first; else promoted (or unjudged, or
    applied with nothing to judge) when every replica ended it so."""
    for outcome in _PRECEDENCE:
        found = next((v for v in verdicts if v.outcome == outcome), None)
        if found is not None:
            return outcome, found
    return "Applying", None


@dataclass(frozen=True, slots=True)
class HistoryStep:
    """The history after a pass, the rollout it shows, and the Events its transitions post."""

    history: tuple[HistoryEntry, ...]
    rollout: RevisionRollout | None
    events: tuple[Event, ...]
    #: A revision is being applied or judged, or a replica judges a candidate: look again soon.
    judging: bool


def follow(
    history: Sequence[HistoryEntry],
    *,
    desired_hash: str,
    generation: int,
    taken: bool,
    change: LastChange | None,
    outcomes: Sequence[ReplicaOutcome],
    views: Mapping[str, ReplicaRevisions],
    timestamp: str,
    restarting: bool = False,
    failed_restart: str = "",
) -> HistoryStep:
    """One pass's step of the history (newest first).

    `taken`: the desired config came into effect (committed, or some replica runs it or rolled it
    back): when its hash is not the newest revision's, it is the next revision (an older one not
    settled yet is superseded). The newest revision's outcome follows its replicas' verdicts
    until it is final; a final outcome never changes. `restarting`: a restart of the desired
    config is under way (it is not through until that is done); `failed_restart`: why its
    restart failed its gate, which rolls it back.
    """
    entries = list(history)
    if taken and (not entries or entries[0].config_hash != desired_hash):
        entries = _added(entries, desired_hash, generation, change, timestamp)
    verdicts: list[ReplicaVerdict] = []
    if entries:
        newest = entries[0]
        verdicts = verdicts_of(newest.config_hash, outcomes, views)
        unsettled = newest.outcome not in FINAL_OUTCOMES
        if unsettled and failed_restart and newest.config_hash == desired_hash:
            entries[0] = newest.model_copy(
                update={
                    "outcome": "RolledBack",
                    "reason": _clip(failed_restart),
                    "check": "restart",
                    "share_percent": None,
                }
            )
        elif unsettled and verdicts:
            outcome, decider = aggregate(verdicts)
            if restarting and outcome in GOOD_OUTCOMES:
                outcome, decider = "Applying", None  # through only once its restarts are
            update = _ended(outcome, decider)
            shares = [v.share_percent for v in verdicts if v.share_percent is not None]
            update["share_percent"] = min(shares) if outcome == "Canary" and shares else None
            entries[0] = newest.model_copy(update=update)
    events = transition_events(history, entries, verdicts)
    rollout = rollout_of(entries, verdicts)
    candidates = any(
        o.status is not None and o.status.candidate is not None
        for o in outcomes
        if o.state != "Replaced"
    )
    judging = bool(entries) and (entries[0].outcome in _UNSETTLED or candidates)
    return HistoryStep(tuple(entries), rollout, tuple(events), judging)


def _added(
    entries: list[HistoryEntry],
    config_hash: str,
    generation: int,
    change: LastChange | None,
    timestamp: str,
) -> list[HistoryEntry]:
    number = entries[0].revision + 1 if entries else 1
    settled = [
        e
        if e.outcome in FINAL_OUTCOMES
        else e.model_copy(
            update={
                "outcome": "Superseded",
                "reason": f"revision {number} came before its verdict",
                "check": None,
            }
        )
        for e in entries
    ]
    live: list[str] = []
    restart: list[RestartPathEntry] = []
    omitted = 0
    if change is not None and change.to_config_hash == config_hash:
        live, restart = list(change.live_paths), list(change.restart_paths)
        omitted = change.omitted_paths
    omitted += max(0, len(live) - MAX_PATHS) + max(0, len(restart) - MAX_PATHS)
    entry = HistoryEntry(
        revision=number,
        config_hash=config_hash,
        generation=generation,
        applied_at=timestamp,
        live_paths=live[:MAX_PATHS],
        restart_paths=restart[:MAX_PATHS],
        omitted_paths=omitted,
        outcome="Applying",
        restores=next((e.revision for e in entries if e.config_hash == config_hash), None),
    )
    return [entry, *settled][:KEEP]


def _ended(outcome: RevisionOutcome, decider: ReplicaVerdict | None) -> dict[str, object]:
    reason = ""
    if decider is not None and decider.reason:
        reason = decider.reason
        if outcome == "RolledBack":
            reason = f"replica {decider.replica}: {reason}"
    return {
        "outcome": outcome,
        "reason": _clip(reason),
        "check": (decider.check or None) if decider is not None else None,
    }


def rollout_of(
    entries: Sequence[HistoryEntry], verdicts: Sequence[ReplicaVerdict] = ()
) -> RevisionRollout | None:
    """The newest revision's rollout: the stable revision (the newest judged good, or applied
    with nothing to judge), the candidate (the newest, while it is applied or judged), the
    state, the canary's share, the deciding check and what was said."""
    if not entries:
        return None
    newest = entries[0]
    stable = next((e.revision for e in entries if e.outcome in GOOD_OUTCOMES), None)
    shares = [v.share_percent for v in verdicts if v.share_percent is not None]
    return RevisionRollout(
        stable=stable,
        candidate=newest.revision if newest.outcome in _UNSETTLED else None,
        state=newest.outcome,
        share_percent=min(shares) if newest.outcome == "Canary" and shares else None,
        check=newest.check,
        message=newest.reason or None,
        rolled_back_config_hash=newest.config_hash if newest.outcome == "RolledBack" else None,
    )


def transition_events(
    before: Sequence[HistoryEntry],
    after: Sequence[HistoryEntry],
    verdicts: Sequence[ReplicaVerdict] = (),
) -> list[Event]:
    """An Event for each revision whose outcome moved to Watching, Canary, Promoted, Unjudged or
    RolledBack since `before` (the history as the status held it: once per transition, across
    operator restarts too), and a `CanaryStep` for a canary whose share moved."""
    was = {e.revision: e for e in before}
    events = []
    for entry in reversed(after):
        earlier = was.get(entry.revision)
        if earlier is not None and earlier.outcome == entry.outcome:
            if entry.outcome == "Canary" and entry.share_percent != earlier.share_percent:
                events.append(_step(entry, verdicts))
            continue
        event = _event(entry, after, verdicts)
        if event is not None:
            events.append(event)
    return events


def _name(entry: HistoryEntry) -> str:
    return (
        f"revision {entry.revision} (generation {entry.generation}, config "
        f"{entry.config_hash[:12]})"
    )


def _step(entry: HistoryEntry, verdicts: Sequence[ReplicaVerdict]) -> Event:
    on = sorted(v.replica for v in verdicts if v.outcome == "Canary")
    where = f" on {', '.join(on)}" if on else ""
    return Event(
        "Normal",
        "CanaryStep",
        f"{_name(entry)} serves {entry.share_percent}% of the touched models' requests{where}: "
        "the earlier steps passed every check",
    )


def _event(
    entry: HistoryEntry, entries: Sequence[HistoryEntry], verdicts: Sequence[ReplicaVerdict]
) -> Event | None:
    name = _name(entry)
    figures = next((v.figures for v in verdicts if v.outcome == entry.outcome and v.figures), "")
    said = f"{entry.check}: {entry.reason}" if entry.check else entry.reason
    said += f" ({figures})" if figures else ""
    judged = sorted(v.replica for v in verdicts if v.outcome == entry.outcome)
    on = f" on {', '.join(judged)}" if judged else ""
    if entry.outcome == "Watching":
        return Event(
            "Normal",
            "Watching",
            f"{name} is watched{on}: judged by what it serves against the stable revision",
        )
    if entry.outcome == "Canary":
        share = next((v.share_percent for v in verdicts if v.share_percent is not None), None)
        part = f"{share}% of" if share is not None else "a share of"
        return Event(
            "Normal",
            "CanaryStarted",
            f"{name} serves {part} the touched models' requests{on}, judged against the stable "
            "revision",
        )
    if entry.outcome in ("Promoted", "Unjudged"):
        how = "promoted" if entry.outcome == "Promoted" else "promoted unjudged"
        return Event("Normal", "Promoted", f"{name} {how}: {said or 'every replica kept it'}")
    if entry.outcome == "RolledBack":
        stable = next(
            (e.revision for e in entries if e.outcome in GOOD_OUTCOMES and e is not entry), None
        )
        back = f"revision {stable} serves again" if stable is not None else "the stable config"
        return Event(
            "Warning",
            "RolledBack",
            f"{name} rolled back: {said}; {back}; it is applied no more until the spec asks for "
            "another config (docs/operator.md, Revisions)",
        )
    return None


def needs_logs(
    history: Sequence[HistoryEntry], desired_hash: str, outcomes: Sequence[ReplicaOutcome]
) -> bool:
    """Whether the replicas' logs have anything new to say: a config not yet a revision, a
    revision not settled, a candidate some replica judges, a config some replica rolled back.
    A settled pass reads none (an idle pass stays a few reads)."""
    newest = history[0] if history else None
    return (
        newest is None
        or newest.config_hash != desired_hash
        or newest.outcome not in FINAL_OUTCOMES
        or any(o.rolled_back for o in outcomes)
        or any(o.status is not None and o.status.candidate is not None for o in outcomes)
    )


# -- convergence ---------------------------------------------------------------------------------


def held_back(history: Sequence[HistoryEntry], desired_hash: str) -> HistoryEntry | None:
    """The newest revision when it is the desired config and an Edge rolled it back: the operator
    applies it no more (a new spec, with another hash, starts a new rollout)."""
    newest = history[0] if history else None
    if newest is not None and newest.config_hash == desired_hash and newest.outcome == "RolledBack":
        return newest
    return None


@dataclass(frozen=True, slots=True)
class Restore:
    """A replica to put back on the stable config, by its own revision of it."""

    replica: EdgeReplica
    #: Its revision of the stable config (`POST /refresh {"revision": N}`); None: it keeps none.
    revision: int | None
    stable_hash: str


def restores(
    rolled_back_hash: str,
    history: Sequence[HistoryEntry],
    outcomes: Sequence[ReplicaOutcome],
    views: Mapping[str, ReplicaRevisions],
    prefer: str = "",
) -> tuple[str, list[Restore]]:
    """(the stable config's hash, the replicas to put back on it): every asked replica that
    still serves `rolled_back_hash`. The stable config is `prefer` (the operator's own stable
    revision, what the ConfigMap holds) when given, else the one a replica that rolled the
    config back returned to (its own stable revision), else the cluster's stable revision."""
    stable_hash = prefer
    for view in () if prefer else views.values():
        rolled = view.newest_of(rolled_back_hash)
        stable = view.get(view.stable)
        if rolled is not None and rolled.outcome == "rolled_back" and stable is not None:
            stable_hash = stable.config_hash
            break
    if not stable_hash:
        stable_hash = next((e.config_hash for e in history if e.outcome in GOOD_OUTCOMES), "")
    if not stable_hash or stable_hash == rolled_back_hash:
        return stable_hash, []
    due = []
    for outcome in outcomes:
        if outcome.state == "Replaced" or outcome.config_hash != rolled_back_hash:
            continue
        found = views.get(outcome.replica.name)
        kept = found.newest_of(stable_hash) if found is not None else None
        due.append(Restore(outcome.replica, kept.number if kept is not None else None, stable_hash))
    return stable_hash, due


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 1] + "…"
