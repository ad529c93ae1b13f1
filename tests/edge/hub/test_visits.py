"""Which sessions the hub's liveness tick visits: busy ones every tick, quiet ones when due."""

from __future__ import annotations

from iop.edge.hub.visits import Visits


def test_a_busy_session_is_visited_on_every_tick() -> None:
    visits: Visits[str] = Visits()
    visits.busy("a")
    assert visits.due(1.0) == ["a"]
    assert visits.due(1.5) == ["a"]


def test_a_quiet_session_is_visited_once_its_time_came_and_not_before() -> None:
    visits: Visits[str] = Visits()
    visits.later("a", 10.0)
    visits.later("b", 5.0)
    assert visits.due(4.9) == []
    assert visits.due(5.0) == ["b"]
    assert visits.due(9.0) == []
    assert visits.due(12.0) == ["a"]
    assert visits.due(20.0) == []  # taken off: the visit schedules it again
    assert len(visits) == 0


def test_a_quiet_session_given_a_run_is_busy_and_its_quiet_visit_dropped() -> None:
    visits: Visits[str] = Visits()
    visits.later("a", 10.0)
    visits.busy("a")
    assert visits.due(11.0) == ["a"]  # once, as a busy session


def test_a_rescheduled_session_keeps_only_its_latest_time() -> None:
    visits: Visits[str] = Visits()
    visits.later("a", 1.0)
    visits.later("a", 3.0)
    assert visits.due(2.0) == []
    assert visits.due(3.0) == ["a"]


def test_an_ended_session_is_never_visited_again() -> None:
    visits: Visits[str] = Visits()
    visits.later("a", 1.0)
    visits.busy("b")
    visits.forget("a")
    visits.forget("b")
    assert visits.due(5.0) == []
    assert len(visits) == 0


def test_stale_entries_do_not_pile_up() -> None:
    visits: Visits[int] = Visits()
    for when in range(5):  # each reschedule leaves the previous entry stale
        for session in range(1000):
            visits.later(session, 100.0 + when)
    visits.due(0.0)
    assert len(visits._heap) == 1000
    assert visits.due(104.0) == list(range(1000))
