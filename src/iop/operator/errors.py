"""The operator's one exception hierarchy.

Third-party errors (aiohttp, the Kubernetes API's statuses, the Edge admin API's answers) are
translated once, where they happen (`kubeapi.py`, `adminapi.py`), into these; the reconcile
decides on these alone what is retried, what is reported, and what is the spec's fault.
"""

from __future__ import annotations


class OperatorError(Exception):
    """Anything the operator itself raises."""


class KubeApiError(OperatorError):
    """A Kubernetes API call failed: `status` (0 when no answer came), `reason` (the API's
    Status reason, like `NotFound`) and the API's message."""

    def __init__(self, status: int, reason: str, message: str, *, what: str = "") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.what = what
        super().__init__(f"{what}: {status} {reason}: {message}" if what else message)


class KubeNotFound(KubeApiError):
    """404: the object (or its namespace) does not exist."""


class KubeConflict(KubeApiError):
    """409: it exists already, or it changed since it was read."""


class KubeForbidden(KubeApiError):
    """403: the operator's ServiceAccount lacks a verb (docs/operator.md lists the RBAC)."""


class KubeUnavailable(KubeApiError):
    """No answer, a 5xx or 429: the API server may be back soon."""


class AdminApiError(OperatorError):
    """A call to one Edge replica's admin API failed; `replica` names it (pod name)."""

    def __init__(self, replica: str, reason: str) -> None:
        self.replica = replica
        self.reason = reason
        super().__init__(f"{replica}: {reason}")


class AdminUnreachable(AdminApiError):
    """The replica did not answer (refused, reset, timed out)."""


class AdminRefused(AdminApiError):
    """The replica answered but did not apply: wrong token, invalid config, or a restart-required
    change by its own classification (`restart_scopes` then names the restarts it needs)."""

    def __init__(
        self,
        replica: str,
        reason: str,
        *,
        status: int,
        restart_scopes: tuple[str, ...] = (),
        rolled_back: bool = False,
    ) -> None:
        super().__init__(replica, reason)
        self.status = status
        self.restart_scopes = restart_scopes
        #: The replica rolled this very config back (docs/rollout.md) and refuses it again.
        self.rolled_back = rolled_back
