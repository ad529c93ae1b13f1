"""What a pass tells: its Events, once each, and the status it writes.

The `Announcer` keeps, between passes, what the status says beyond one pass's findings: the last
change, the config last seen fully in effect (and since when), the cluster revisions as last
written. It builds the status from a pass's `Verdict` (`status/reporting.py`) and writes it only
when it changes something (`status/writing.py`); the pass's early ends (an invalid spec, a token
Secret missing, the Kubernetes API failing) write theirs through it too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from iop.edgeconfig import ChangeReport, ConfigError, config_hash

from .deciding import Observation, Plan, Verdict
from .documents import Owner
from .errors import KubeApiError
from .kubeapi import KubeApi
from .revisions import HistoryStep
from .status import (
    EdgeConfigStatus,
    EventPoster,
    HistoryEntry,
    LastChange,
    StatusWriter,
    build_status,
    change_summary,
    now,
    read_history,
    reconciling_status,
)
from .tokensecrets import TokenRead
from .values import EventType, Finding

logger = logging.getLogger(__name__)


class Announcer:
    """The Events and the status of one EdgeConfig's passes."""

    def __init__(self, api: KubeApi, events: EventPoster) -> None:
        self._events = events
        self._status = StatusWriter(api)
        self._said: set[tuple[str, str]] = set()
        self.last_change: LastChange | None = None
        #: The config hash last seen fully in effect (Applied=True), and since when.
        self.effective: str | None = None
        self._in_effect_since: tuple[str, float] | None = None
        #: The cluster revisions as last written (newest first), and the EdgeConfig they are of;
        #: read back from the status after an operator restart.
        self._history: tuple[HistoryEntry, ...] | None = None
        self._history_owner = ""

    def say(self, owner: Owner, kind: EventType, reason: str, message: str) -> None:
        """An Event, once per distinct reason and message (retries do not repeat it)."""
        key = (reason, message)
        if key in self._said:
            return
        if len(self._said) > 256:
            self._said.clear()
        self._said.add(key)
        self._events.post(owner, kind, reason, message)

    def forget(self, reasons: Collection[str]) -> None:
        """Events of these reasons are said again, even with a message said before."""
        self._said = {key for key in self._said if key[0] not in reasons}

    async def report(
        self,
        owner: Owner,
        verdict: Verdict,
        previous: Mapping[str, Any],
        step: HistoryStep,
        repairs: Sequence[str],
    ) -> None:
        """The Events of a pass (its verdict's, its history's, its repairs'), and its status."""
        for event in (*verdict.events, *step.events):
            self.say(owner, event.type, event.reason, event.message)
        for repair in repairs:
            self.say(owner, "Normal", "Repaired", repair)
        finding = verdict.finding
        newest = step.history[0] if step.history else None
        if (
            finding.stalled
            and newest is not None
            and newest.check == "restart"
            and newest.outcome == "RolledBack"
            and newest.config_hash == finding.desired_hash
        ):
            finding.stalled = (
                "RolledBack",
                f"revision {newest.revision} rolled back, its restart failed its gate: "
                f"{newest.reason}; apply a changed spec to start a new rollout (docs/rollout.md)",
            )
        if finding.applied:
            self.effective = finding.desired_hash
            if self._in_effect_since is None or self._in_effect_since[0] != finding.desired_hash:
                self._in_effect_since = (finding.desired_hash, time.monotonic())
        status = build_status(
            finding,
            previous,
            self.last_change,
            now(),
            history=step.history,
            rollout=step.rollout,
        )
        await self.write_status(owner, status, previous)
        self._history, self._history_owner = step.history, owner.uid

    async def mark_seen(
        self, owner: Owner, generation: int, previous: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """A generation seen for the first time: say so at once (kstatus: InProgress), so no
        reader takes the previous generation's Ready for this one's; the status as it now is."""
        if int(previous.get("observedGeneration") or 0) == generation:
            return previous
        status = reconciling_status(previous, generation, now())
        await self.write_status(owner, status, previous)
        return {**previous, **status.document()}

    async def refuse(
        self, owner: Owner, generation: int, error: ConfigError, previous: Mapping[str, Any]
    ) -> bool:
        """An invalid spec: every problem in the status and an Event; whether the status could
        be written."""
        count = len(error.problems)
        shown = "; ".join(str(p) for p in error.problems[:10])
        more = f" and {count - 10} more" if count > 10 else ""
        self.say(
            owner,
            "Warning",
            "InvalidSpec",
            f"generation {generation} refused, the running config is kept: {shown}{more}",
        )
        finding = Finding(generation, valid=False, problems=error.problems)
        try:
            await self.write_status(owner, build_status(finding, previous, None, now()), previous)
        except KubeApiError as again:
            logger.warning("%s/%s: cannot write status: %s", owner.namespace, owner.name, again)
            return False
        return True

    async def hold(
        self, owner: Owner, generation: int, tokens: TokenRead, previous: Mapping[str, Any]
    ) -> None:
        """A token Secret the spec names is missing (and not to be generated), or holds what
        cannot be a token: nothing changes until it is put right (its watch wakes the next
        pass). A missing one is retried meanwhile; a bad one waits for a person (Stalled)."""
        if tokens.invalid:
            reason, problems = "TokenSecretInvalid", [*tokens.invalid, *tokens.missing]
        else:
            reason, problems = "TokenSecretMissing", list(tokens.missing)
        message = "; ".join(problems)
        self.say(owner, "Warning", reason, message)
        finding = self._failed_finding(generation, reason, message, previous)
        if tokens.invalid:
            finding.stalled = (reason, f"{message}; nothing is applied until it is put right")
        await self.write_status(
            owner, build_status(finding, previous, self.last_change, now()), previous
        )

    async def api_failed(
        self, owner: Owner, generation: int, error: KubeApiError, previous: Mapping[str, Any]
    ) -> None:
        """The Kubernetes API failed a call: Degraded, retrying (said, and written if it can)."""
        self.say(owner, "Warning", "Degraded", str(error))
        finding = self._failed_finding(
            generation, "KubernetesAPIError", f"Kubernetes API: {error}", previous
        )
        finding.waiting = ("ApplyFailed", "the Kubernetes API refused a call; retrying")
        try:
            await self.write_status(
                owner, build_status(finding, previous, self.last_change, now()), previous
            )
        except KubeApiError as again:
            logger.warning("%s/%s: cannot write status: %s", owner.namespace, owner.name, again)

    def _failed_finding(
        self, generation: int, reason: str, message: str, previous: Mapping[str, Any]
    ) -> Finding:
        finding = Finding(generation, degraded=[message], degraded_reason=reason)
        finding.waiting = (reason, message)
        finding.applied_hash = self.effective or previous.get("appliedConfigHash") or ""
        return finding

    async def write_status(
        self, owner: Owner, status: EdgeConfigStatus, previous: Mapping[str, Any]
    ) -> None:
        await self._status.write(owner, status, previous)

    def history_of(self, owner: Owner, previous: Mapping[str, Any]) -> tuple[HistoryEntry, ...]:
        """The cluster revisions: as this operator last wrote them (the body of a pass may be
        older than its last write), else as the status holds them (after a restart)."""
        if self._history is not None and self._history_owner == owner.uid:
            return self._history
        return read_history(previous)

    def last_change_of(self, previous: Mapping[str, Any]) -> LastChange | None:
        if self.last_change is not None:
            return self.last_change
        try:
            return LastChange.model_validate(previous.get("lastChange"))
        except ValueError:
            return None

    def validated(self, owner: Owner, observation: Observation, current: Plan) -> None:
        """A new change: remembered for the status (`lastChange`), and said (Validated)."""
        base_hash = config_hash(observation.base) if observation.base is not None else ""
        change = current.change
        self.last_change = change_summary(
            change if change is not None else ChangeReport(),
            observation.generation,
            base_hash,
            observation.desired_hash,
        )
        self.say(owner, "Normal", "Validated", _plan_message(observation.generation, current))

    def in_effect_for(self, observation: Observation, previous: Mapping[str, Any]) -> float | None:
        """Seconds the desired config has been in effect; None: not yet. A config the status
        already says was in effect (an operator restart, a failover, a new generation that
        changes nothing) counts as long in effect: no new wait for the Nodes."""
        since = self._in_effect_since
        if since is not None and since[0] == observation.desired_hash:
            return time.monotonic() - since[1]
        if previous.get("appliedConfigHash") == observation.desired_hash:
            return float("inf")
        return None


def _plan_message(generation: int, current: Plan) -> str:
    """The Validated event: what the operator is about to do with a generation."""
    change = current.change
    if change is None:
        return f"generation {generation} is valid; first apply (no config applied before)"
    if not change.changed:
        return f"generation {generation} is valid; nothing in effect changes"
    live = len(change.live_paths)
    parts = [f"{live} live path{'s' if live != 1 else ''}"]
    if change.restart_scopes:
        parts.append(f"restart {', '.join(change.restart_scopes)}")
    return f"generation {generation} is valid: {'; '.join(parts)}"
