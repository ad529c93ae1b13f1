"""A provider's health verdict from probes and real runs: the thresholds, case by case, and a
property over any sequence of results."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from iop.edgeconfig import HealthPolicy
from iop.providers.healthstates import HealthState
from iop.wire import RunDone, RunFailed, nodestates, statuses

POLICY = HealthPolicy(failure_threshold=3, success_threshold=2, request_failure_threshold=4)
REFUSED = statuses.failure(statuses.UPSTREAM_UNAVAILABLE, "cannot connect: Connection refused")
FIVE_HUNDRED = statuses.failure(statuses.UPSTREAM_ERROR, "upstream answered HTTP 500", status=500)
DONE = RunDone("stop")


def started(policy: HealthPolicy = POLICY) -> HealthState:
    """A probed provider that passed its first probe."""
    state = HealthState("p1", policy, probed=True)
    assert state.record_probe(None)
    assert state.healthy
    return state


def test_a_probed_provider_starts_unhealthy_and_its_first_passing_probe_brings_it_in() -> None:
    state = HealthState("p1", POLICY, probed=True)
    assert (state.healthy, state.health.reason) == (False, nodestates.NOT_PROBED)
    assert state.record_probe(None)  # one is enough, whatever success_threshold says
    assert state.health.healthy and state.health.reason == ""


def test_a_first_failing_probe_says_why_at_once() -> None:
    state = HealthState("p1", POLICY, probed=True)
    assert state.record_probe("cannot connect to http://h:1/v1/models: Connection refused")
    health = state.health
    assert (health.healthy, health.reason) == (False, nodestates.PROBE_FAILED)
    assert "Connection refused" in health.detail
    # Having failed, it now needs success_threshold passing probes like any unhealthy one.
    assert not state.record_probe(None)
    assert state.record_probe(None)
    assert state.healthy


def test_failure_threshold_probes_in_a_row_take_it_out_and_a_pass_resets_the_count() -> None:
    state = started()
    assert not state.record_probe("timeout")
    assert not state.record_probe("timeout")
    assert not state.record_probe(None)  # the run of failures is broken
    assert not state.record_probe("timeout")
    assert not state.record_probe("timeout")
    assert state.healthy
    assert state.record_probe("timeout")  # the third in a row
    assert (state.healthy, state.health.reason) == (False, nodestates.PROBE_FAILED)
    assert state.health.detail == "probe failed: timeout"
    assert not state.record_probe("timeout")  # the same verdict: nothing to report


def test_success_threshold_probes_in_a_row_bring_it_back() -> None:
    state = started()
    for _ in range(3):
        state.record_probe("refused")
    assert not state.record_probe(None)
    assert not state.record_probe("refused")  # breaks the run of passes, stays out
    assert not state.record_probe(None)
    assert state.record_probe(None)
    assert state.healthy


def test_request_failures_in_a_row_take_it_out_and_only_probes_bring_it_back() -> None:
    state = started()
    for _ in range(3):
        assert not state.record_run(REFUSED)
    assert not state.record_run(DONE)  # an answer breaks the run
    for _ in range(3):
        assert not state.record_run(FIVE_HUNDRED)
    assert state.record_run(FIVE_HUNDRED)  # the fourth in a row
    health = state.health
    assert (health.healthy, health.reason) == (False, nodestates.REQUEST_FAILURES)
    assert health.detail.startswith("4 request(s) in a row failed on the upstream; last: ")
    # A run that still succeeds on it (it was in flight) does not bring it back; probes do.
    assert not state.record_run(DONE)
    assert not state.record_probe(None)
    assert state.record_probe(None)
    assert state.healthy


def test_probes_failing_after_requests_did_say_so() -> None:
    state = started(HealthPolicy(failure_threshold=2, request_failure_threshold=1))
    assert state.record_run(REFUSED)
    assert state.health.reason == nodestates.REQUEST_FAILURES
    assert not state.record_probe("refused")  # below failure_threshold: the reason stands
    assert state.record_probe("refused")
    assert state.health.reason == nodestates.PROBE_FAILED


def test_what_says_nothing_about_the_upstream_counts_for_nothing() -> None:
    state = started(HealthPolicy(request_failure_threshold=1))
    nothing = [
        statuses.failure(statuses.PROVIDER_BUSY, "all connections are busy"),
        statuses.failure(statuses.INTERNAL_ERROR, "a bug"),
        statuses.failure(statuses.CANCELLED, "the client left"),
    ]
    for failed in nothing:
        assert not state.record_run(failed)
    timeout = statuses.failure(statuses.UPSTREAM_TIMEOUT, "the run's deadline passed")
    assert not state.record_run(timeout, past_deadline=True)
    assert state.healthy
    assert state.record_run(timeout)  # a timeout before the deadline is the upstream's


def test_an_upstream_that_refuses_a_request_is_up() -> None:
    state = started(HealthPolicy(request_failure_threshold=2))
    state.record_run(REFUSED)
    refused = statuses.upstream_http_failure(400, b'{"error": {"message": "bad"}}')
    assert not state.record_run(refused)  # it answered: the run of failures is broken
    assert not state.record_run(REFUSED)
    assert state.healthy


def test_an_unprobed_provider_is_healthy_whatever_its_runs_do() -> None:
    for state in (
        HealthState("p1", POLICY, probed=False),  # no upstream (the fake adapter)
        HealthState("p1", HealthPolicy(interval_ms=0), probed=True),  # probing off
    ):
        assert state.healthy and not state.probed
        for _ in range(10):
            assert not state.record_run(REFUSED)
            assert not state.record_probe("refused")
        assert state.healthy


def test_a_new_policy_keeps_the_verdict_and_probing_turned_off_makes_it_healthy() -> None:
    state = started()
    for _ in range(3):
        state.record_probe("refused")
    assert not state.reconfigure(HealthPolicy(failure_threshold=5), probed=True)
    assert not state.healthy
    assert state.reconfigure(HealthPolicy(interval_ms=0), probed=True)
    assert state.health.healthy and not state.probed
    # Turned on again: it served until now, so the probes' thresholds judge it from here.
    assert not state.reconfigure(POLICY, probed=True)
    assert state.health.healthy and state.probed


results = st.lists(
    st.one_of(
        st.none().map(lambda _: ("probe", None)),
        st.just(("probe", "refused")),
        st.just(("run", DONE)),
        st.just(("run", REFUSED)),
    ),
    max_size=60,
)


@given(
    results,
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 4),
)
def test_the_verdict_follows_the_rules_for_any_sequence(
    sequence: list[tuple[str, object]], failures: int, successes: int, requests: int
) -> None:
    """Out only after `failures` failed probes or `requests` failed runs in a row; back only
    after `successes` passing probes in a row (one, the first time); a change is reported."""
    policy = HealthPolicy(
        failure_threshold=failures, success_threshold=successes, request_failure_threshold=requests
    )
    state = HealthState("p1", policy, probed=True)
    probe_fails = probe_passes = run_fails = 0
    probed_once = False
    for kind, value in sequence:
        before = state.health
        if kind == "probe":
            changed = state.record_probe(value if isinstance(value, str) else None)
            if value is None:
                probe_passes, probe_fails = probe_passes + 1, 0
            else:
                probe_fails, probe_passes = probe_fails + 1, 0
        else:
            assert isinstance(value, RunDone | RunFailed)
            changed = state.record_run(value)
            run_fails = 0 if isinstance(value, RunDone) else run_fails + 1
        after = state.health
        assert changed == (after != before)
        if before.healthy and not after.healthy:
            assert (kind == "probe" and probe_fails >= failures) or (
                kind == "run" and requests and run_fails >= requests
            )
            probe_passes = 0
        if not before.healthy and after.healthy:
            assert kind == "probe" and (probe_passes >= successes or not probed_once)
            run_fails = 0
        if kind == "probe":
            probed_once = True
