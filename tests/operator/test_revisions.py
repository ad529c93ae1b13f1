"""The cluster's revisions, driven without a cluster: numbering, bounds, a restart that reads
the status back, outcomes across replicas, Events once per transition, and which replicas go
back to the stable config when one rolled a revision back."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from iop.operator.revisions import (
    KEEP,
    HistoryStep,
    ReplicaVerdict,
    aggregate,
    follow,
    held_back,
    needs_logs,
    restores,
    verdicts_of,
)
from iop.operator.status import LastChange, read_history
from iop.operator.status.model import EdgeConfigStatus, HistoryEntry, RestartPathEntry
from iop.operator.values import (
    CandidateView,
    EdgeReplica,
    EdgeRevision,
    ReplicaOutcome,
    ReplicaRevisions,
    ReplicaStatus,
)

STAMP = "2026-01-02T03:04:05Z"


def digest(n: int) -> str:
    return f"{n:064x}"


def replica(name: str) -> EdgeReplica:
    return EdgeReplica(name, name, f"http://{name}:9090", True, None)


def runs(name: str, config_hash: str, candidate: CandidateView | None = None) -> ReplicaOutcome:
    status = ReplicaStatus(config_hash, 2, (), candidate=candidate)
    return ReplicaOutcome(replica(name), "Applied", status=status)


def log(
    name: str,
    *revisions: tuple[int, str, str],
    stable: int | None = None,
    candidate: int | None = None,
    check: str = "",
) -> ReplicaRevisions:
    """A replica's log; `revisions` are (number, hash, outcome), newest first."""
    return ReplicaRevisions(
        replica(name),
        stable,
        candidate,
        tuple(
            EdgeRevision(n, h, o, reason=f"{o} on {name}", check=check if o != "started" else "")
            for n, h, o in revisions
        ),
    )


def change(to_hash: str, paths: int = 1) -> LastChange:
    return LastChange(
        generation=1,
        from_config_hash="",
        to_config_hash=to_hash,
        live_paths=[f"nodes[n].providers[p{i}].capacity" for i in range(paths)],
        restart_paths=[RestartPathEntry(path="edge.listen", scope="edge")],
        restart_scopes=["edge"],
        changed_nodes=[],
        changed_providers=[],
        changed_models=[],
        omitted_paths=0,
    )


def apply_change(
    history: Sequence[HistoryEntry], n: int, outcome: str = "kept"
) -> tuple[HistoryEntry, ...]:
    """Config `n` taken by one replica, which ended it as `outcome`."""
    step = follow(
        history,
        desired_hash=digest(n),
        generation=n,
        taken=True,
        change=change(digest(n)),
        outcomes=[runs("a", digest(n))],
        views={"a": log("a", (n, digest(n), outcome), stable=n)},
        timestamp=STAMP,
    )
    return step.history


def through_the_status(history: Sequence[HistoryEntry]) -> tuple[HistoryEntry, ...]:
    """What a restarted operator reads back: the status as the API server stores it."""
    document = EdgeConfigStatus(history=list(history)).document()
    return read_history(document)


def test_25_changes_keep_the_newest_20_and_a_restart_numbers_on() -> None:
    history: tuple[HistoryEntry, ...] = ()
    for n in range(1, 26):
        history = apply_change(history, n)

    assert len(history) == KEEP == 20
    assert [e.revision for e in history] == list(range(25, 5, -1))
    assert {e.outcome for e in history} == {"Applied"}
    assert history[0].config_hash == digest(25) and history[0].generation == 25

    restarted = through_the_status(history)
    assert restarted == history
    after = apply_change(restarted, 26)
    assert [e.revision for e in after[:2]] == [26, 25]
    assert len(after) == 20


def test_an_entry_is_small_and_says_how_many_paths_it_left_out() -> None:
    step = follow(
        (),
        desired_hash=digest(1),
        generation=3,
        taken=True,
        change=change(digest(1), paths=14),
        outcomes=[runs("a", digest(1))],
        views={},
        timestamp=STAMP,
    )
    (entry,) = step.history
    assert len(entry.live_paths) == 10 and entry.omitted_paths == 4
    assert entry.restart_paths == [RestartPathEntry(path="edge.listen", scope="edge")]
    assert (entry.revision, entry.generation, entry.applied_at) == (1, 3, STAMP)
    assert entry.outcome == "Applied"  # an Edge that keeps no log and runs it: applied


def test_the_same_config_again_is_no_revision_and_an_earlier_one_restores_it() -> None:
    history = apply_change(apply_change((), 1), 2)
    assert apply_change(history, 2) == history
    again = apply_change(history, 1)
    assert (again[0].revision, again[0].restores) == (3, 1)


def test_a_config_not_taken_yet_is_no_revision() -> None:
    history = apply_change((), 1)
    step = follow(
        history,
        desired_hash=digest(2),
        generation=2,
        taken=False,
        change=change(digest(2)),
        outcomes=[ReplicaOutcome(replica("a"), "Unreachable", "refused")],
        views={},
        timestamp=STAMP,
    )
    assert step.history == history


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        pytest.param(["promoted", "promoted"], "Promoted", id="all-promoted"),
        pytest.param(["promoted", "unjudged", "kept"], "Promoted", id="promoted-unjudged-kept"),
        pytest.param(["unjudged", "kept"], "Unjudged", id="unjudged-and-kept"),
        pytest.param(["kept", "started"], "Applied", id="nothing-to-judge"),
        pytest.param(["promoted", "watching"], "Watching", id="one-still-watching"),
        pytest.param(["promoted", "rolled_back"], "RolledBack", id="one-rolled-back"),
        pytest.param(["watching", "rolled_back"], "RolledBack", id="rolled-back-beats-watching"),
        pytest.param(["promoted", None], "Applying", id="one-has-not-taken-it"),
        pytest.param(["promoted", "superseded"], "Superseded", id="one-saw-another-first"),
    ],
)
def test_outcome_across_replicas(words: list[str | None], expected: str) -> None:
    h = digest(7)
    outcomes, views = [], {}
    for i, word in enumerate(words):
        name = f"edge-{i}"
        if word is None:
            outcomes.append(runs(name, digest(6)))
            views[name] = log(name, (1, digest(6), "started"), stable=1)
        else:
            outcomes.append(runs(name, h))
            views[name] = log(name, (2, h, word), (1, digest(6), "started"), stable=1)
    outcome, _ = aggregate(verdicts_of(h, outcomes, views))
    assert outcome == expected


def test_a_canary_says_its_share() -> None:
    h = digest(7)
    candidate = CandidateView(2, h, mode="canary", share_percent=5)
    outcomes = [runs("a", h, candidate), runs("b", h, CandidateView(4, h, "canary", 25))]
    views = {
        "a": log("a", (2, h, "watching"), (1, digest(6), "started"), stable=1, candidate=2),
        "b": log("b", (4, h, "watching"), (3, digest(6), "kept"), stable=3, candidate=4),
    }
    step = follow(
        apply_change((), 6),
        desired_hash=h,
        generation=7,
        taken=True,
        change=None,
        outcomes=outcomes,
        views=views,
        timestamp=STAMP,
    )
    assert step.history[0].outcome == "Canary"
    assert step.rollout is not None
    assert (step.rollout.state, step.rollout.share_percent) == ("Canary", 5)
    assert (step.rollout.stable, step.rollout.candidate) == (1, 2)
    assert [e.reason for e in step.events] == ["CanaryStarted"]
    assert "5% of the touched models' requests on a, b" in step.events[0].message
    assert step.judging


def test_each_canary_step_posts_one_event_across_restarts() -> None:
    h = digest(7)
    history: tuple[HistoryEntry, ...] = apply_change((), 6)
    seen: list[str] = []
    for share in (5, 5, 25, 25, 100):
        candidate = CandidateView(2, h, mode="canary", share_percent=share)
        step = follow(
            history,
            desired_hash=h,
            generation=7,
            taken=True,
            change=None,
            outcomes=[runs("a", h, candidate)],
            views={"a": log("a", (2, h, "watching"), (1, digest(6), "started"), candidate=2)},
            timestamp=STAMP,
        )
        seen += [f"{e.reason} {e.message.split(' serves ')[1][:4]}" for e in step.events]
        history = through_the_status(step.history)  # the next pass may be a restarted operator
    assert seen == ["CanaryStarted 5% o", "CanaryStep 25% ", "CanaryStep 100%"]
    assert history[0].share_percent == 100


def test_a_rollback_by_a_refusal_alone_still_counts() -> None:
    """An Edge whose log no longer holds the revision says so by refusing it (409)."""
    refused = ReplicaOutcome(replica("a"), "Failed", "it rolled this config back", rolled_back=True)
    (verdict,) = verdicts_of(digest(2), [refused], {})
    assert verdict == ReplicaVerdict("a", "RolledBack", reason="it rolled this config back")


def watched_then(word: str, check: str) -> tuple[list[ReplicaOutcome], dict[str, ReplicaRevisions]]:
    h = digest(2)
    return [runs("a", h), runs("b", h)], {
        "a": log("a", (2, h, word), (1, digest(1), "started"), stable=1, check=check),
        "b": log("b", (2, h, "promoted"), (1, digest(1), "started"), stable=2, check="bake"),
    }


def test_each_transition_posts_its_event_once_and_never_again_after_a_restart() -> None:
    h = digest(2)
    history = apply_change((), 1, "started")
    seen: list[str] = []
    steps = [
        watched_then("watching", ""),
        watched_then("watching", ""),
        watched_then("promoted", "bake"),
        watched_then("promoted", "bake"),
    ]
    for outcomes, views in steps:
        step = follow(
            history,
            desired_hash=h,
            generation=2,
            taken=True,
            change=change(h),
            outcomes=outcomes,
            views=views,
            timestamp=STAMP,
        )
        seen += [e.reason for e in step.events]
        history = through_the_status(step.history)  # the next pass may be a restarted operator

    assert seen == ["Watching", "Promoted"]
    assert history[0].outcome == "Promoted" and history[0].check == "bake"
    promoted = follow(
        history[1:],
        desired_hash=h,
        generation=2,
        taken=True,
        change=change(h),
        outcomes=steps[-1][0],
        views=steps[-1][1],
        timestamp=STAMP,
    )
    (event,) = promoted.events
    assert event.message.startswith(
        f"revision 2 (generation 2, config {h[:12]}) promoted: bake: promoted on a"
    )


def test_a_rollback_is_final_names_the_check_and_holds_the_config_back() -> None:
    h = digest(2)
    history = apply_change((), 1, "started")
    outcomes, views = watched_then("rolled_back", "errors")
    step = follow(
        history,
        desired_hash=h,
        generation=2,
        taken=True,
        change=change(h),
        outcomes=outcomes,
        views=views,
        timestamp=STAMP,
    )
    entry = step.history[0]
    assert (entry.outcome, entry.check) == ("RolledBack", "errors")
    assert entry.reason == "replica a: rolled_back on a"
    (event,) = step.events
    assert (event.type, event.reason) == ("Warning", "RolledBack")
    assert "revision 2 (generation 2" in event.message and "errors: " in event.message
    assert "revision 1 serves again" in event.message
    assert step.rollout is not None
    assert (step.rollout.state, step.rollout.stable, step.rollout.candidate) == (
        "RolledBack",
        1,
        None,
    )
    assert step.rollout.rolled_back_config_hash == h
    assert held_back(step.history, h) == entry
    assert held_back(step.history, digest(3)) is None

    # Final: a replica that later says otherwise (a new pod started from it) changes nothing.
    later = follow(
        step.history,
        desired_hash=h,
        generation=2,
        taken=True,
        change=None,
        outcomes=[runs("c", h)],
        views={"c": log("c", (1, h, "started"), stable=1)},
        timestamp=STAMP,
    )
    assert later.history == step.history and later.events == ()


def test_a_new_revision_supersedes_one_still_watched() -> None:
    history = apply_change(apply_change((), 1), 2, "watching")
    assert history[0].outcome == "Watching"
    after = apply_change(history, 3)
    assert [(e.revision, e.outcome) for e in after] == [
        (3, "Applied"),
        (2, "Superseded"),
        (1, "Applied"),
    ]
    assert after[1].reason == "revision 3 came before its verdict"


def test_settled_passes_read_no_logs() -> None:
    history = apply_change((), 1)
    assert not needs_logs(history, digest(1), [runs("a", digest(1))])
    assert needs_logs(history, digest(2), [runs("a", digest(1))])
    assert needs_logs((), digest(1), [runs("a", digest(1))])
    watched = runs("a", digest(1), CandidateView(3, digest(1)))
    assert needs_logs(history, digest(1), [watched])


def test_replicas_still_serving_a_rolled_back_config_go_back_to_the_stable_one() -> None:
    """a rolled revision 2 back; b promoted it; c still watches it; d never took it."""
    bad, good = digest(2), digest(1)
    outcomes = [
        ReplicaOutcome(replica("a"), "Failed", "refused", rolled_back=True),
        runs("b", bad),
        runs("c", bad, CandidateView(5, bad)),
        runs("d", good),
        runs("e", bad),
    ]
    views = {
        "a": log("a", (2, bad, "rolled_back"), (1, good, "started"), stable=1),
        "b": log("b", (2, bad, "promoted"), (1, good, "started"), stable=2),
        "c": log("c", (5, bad, "watching"), (4, good, "kept"), (3, bad, "kept"), stable=4),
        "d": log("d", (1, good, "started"), stable=1),
        "e": log("e", (1, bad, "started"), stable=1),  # started from it: nothing to go back to
    }
    stable, due = restores(bad, apply_change((), 1), outcomes, views)
    assert stable == good
    assert [(r.replica.name, r.revision) for r in due] == [("b", 1), ("c", 4), ("e", None)]
    # The operator's own stable revision, when it has one, is the one they go back to (by
    # the operator's copy where a replica keeps no revision of it).
    stable, due = restores(bad, apply_change((), 1), outcomes, views, prefer=digest(3))
    assert stable == digest(3)
    assert [(r.replica.name, r.revision) for r in due] == [("b", None), ("c", None), ("e", None)]


def test_without_a_replica_that_rolled_back_the_stable_config_is_the_clusters() -> None:
    bad = digest(2)
    history = apply_change(apply_change((), 1), 2, "rolled_back")
    views = {"b": log("b", (2, bad, "promoted"), (1, digest(1), "started"), stable=2)}
    stable, due = restores(bad, history, [runs("b", bad)], views)
    assert stable == digest(1)
    assert [(r.replica.name, r.revision) for r in due] == [("b", 1)]


def test_a_restart_is_through_only_when_done_and_a_failed_gate_rolls_it_back() -> None:
    history = apply_change((), 1)

    def step(restarting: bool, failed: str = "") -> HistoryStep:
        return follow(
            history,
            desired_hash=digest(2),
            generation=2,
            taken=True,
            change=change(digest(2)),
            outcomes=[runs("a", digest(2))],
            views={"a": log("a", (2, digest(2), "kept"), (1, digest(1), "kept"), stable=2)},
            timestamp=STAMP,
            restarting=restarting,
            failed_restart=failed,
        )

    rolling = step(restarting=True)
    assert [(e.revision, e.outcome) for e in rolling.history] == [(2, "Applying"), (1, "Applied")]
    assert rolling.judging and rolling.events == ()
    assert step(restarting=False).history[0].outcome == "Applied"

    history = rolling.history
    failed = step(restarting=True, failed="Deployment/demo-edge (edge): progress deadline")
    entry = failed.history[0]
    assert (entry.outcome, entry.check) == ("RolledBack", "restart")
    assert entry.reason == "Deployment/demo-edge (edge): progress deadline"
    (event,) = failed.events
    assert (event.type, event.reason) == ("Warning", "RolledBack")
    assert "rolled back: restart: Deployment/demo-edge" in event.message
    assert "revision 1 serves again" in event.message
    assert held_back(failed.history, digest(2)) is not None
