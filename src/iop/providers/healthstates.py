"""One provider's health as its runner judges it: probe results and real requests in, a verdict out.

Pure state, no I/O: `probing.py` feeds it probe results, the runner (in a Node, or in the Edge
for a node placed there) feeds it how real requests ended, and whoever fed it reports the new
`ProviderHealth` when a call returns True. `HealthPolicy` holds the numbers: a probed provider
starts out (`not_probed`); `failure_threshold` failed probes or `request_failure_threshold`
failed requests in a row take it out (`probe_failed`, `request_failures`); `success_threshold`
passing probes bring it back, whatever took it out; a provider with no probe is healthy.
docs/edge.md, "Health", gives the rules and why.
"""

from __future__ import annotations

from iop.edgeconfig import HealthPolicy
from iop.wire import (
    NOT_PROBED,
    PROBE_FAILED,
    REQUEST_FAILURES,
    ProviderHealth,
    RunDone,
    RunFailed,
    statuses,
)

#: Failures of a real run that say the upstream is in trouble: 5xx, connection refused or reset,
#: a malformed answer, a timeout.
_UPSTREAM_FAULTS = frozenset(
    {statuses.UPSTREAM_UNAVAILABLE, statuses.UPSTREAM_ERROR, statuses.UPSTREAM_TIMEOUT}
)
#: Failures that are the upstream's answer (it refused the request, the rate or the key): it is
#: up. A full connection pool, a cancelled run or a bug says nothing either way.
_UPSTREAM_ANSWERS = frozenset(
    {statuses.BAD_REQUEST, statuses.UPSTREAM_RATE_LIMITED, statuses.UPSTREAM_AUTH}
)


class HealthState:
    """The health of one provider; every `record_*` call returns True when the verdict changed."""

    __slots__ = (
        "_detail",
        "_healthy",
        "_probe_failures",
        "_probe_successes",
        "_reason",
        "_request_failures",
        "policy",
        "probed",
        "provider_id",
    )

    def __init__(self, provider_id: str, policy: HealthPolicy, *, probed: bool) -> None:
        self.provider_id = provider_id
        self.policy = policy
        #: Whether a probe judges this provider (it has an upstream, and probing is on).
        self.probed = probed and policy.probing
        self._healthy = not self.probed
        self._reason = "" if self._healthy else NOT_PROBED
        self._detail = "" if self._healthy else "the upstream has not been probed yet"
        self._probe_failures = 0
        self._probe_successes = 0
        self._request_failures = 0

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def health(self) -> ProviderHealth:
        return ProviderHealth(self.provider_id, self._healthy, self._detail, self._reason)

    def reconfigure(self, policy: HealthPolicy, *, probed: bool) -> bool:
        """A new policy (a pushed config). Counts and verdict carry over while probing stays on;
        a provider no longer probed is healthy, one probed anew is judged from its next probe."""
        self.policy = policy
        probed = probed and policy.probing
        if probed == self.probed:
            return False
        self.probed = probed
        self._probe_failures = self._probe_successes = self._request_failures = 0
        if not probed:
            return self._set(True, "", "")
        return False  # it served until now: the probes' thresholds judge it from here

    def record_probe(self, failure: str | None) -> bool:
        """One probe's result: None when it passed, else what went wrong."""
        if not self.probed:
            return False
        if failure is None:
            self._probe_failures = 0
            self._probe_successes += 1
            if self._healthy:
                return False
            if self._reason == NOT_PROBED or self._probe_successes >= self.policy.success_threshold:
                self._request_failures = 0
                return self._set(True, "", "")
            return False
        self._probe_successes = 0
        self._probe_failures += 1
        if self._reason != NOT_PROBED and self._probe_failures < self.policy.failure_threshold:
            return False
        return self._set(False, PROBE_FAILED, f"probe failed: {failure}")

    def record_run(self, end: RunDone | RunFailed, *, past_deadline: bool = False) -> bool:
        """How a real run ended (its terminal event). `past_deadline`: it ended at or after the
        run's own deadline, so a timeout is the client's deadline running out, not the
        upstream's fault, and does not count."""
        if isinstance(end, RunDone) or end.code in _UPSTREAM_ANSWERS:
            return self._record_request(None)
        if end.code not in _UPSTREAM_FAULTS:
            return False
        if end.code == statuses.UPSTREAM_TIMEOUT and past_deadline:
            return False
        return self._record_request(end.message)

    def _record_request(self, failure: str | None) -> bool:
        if failure is None:
            self._request_failures = 0
            return False
        self._request_failures += 1
        threshold = self.policy.request_failure_threshold
        if not self.probed or not threshold or not self._healthy:
            return False
        if self._request_failures < threshold:
            return False
        self._probe_successes = 0
        detail = f"{threshold} request(s) in a row failed on the upstream; last: {failure}"
        return self._set(False, REQUEST_FAILURES, detail)

    def _set(self, healthy: bool, reason: str, detail: str) -> bool:
        if (healthy, reason, detail) == (self._healthy, self._reason, self._detail):
            return False
        self._healthy, self._reason, self._detail = healthy, reason, detail
        return True
