"""Every config this Edge has run, numbered: the revision history and which one is good.

Revision 1 is the config the Edge started with; each apply that changed something is the next
number, with its hash, the Edge's snapshot generation, who asked, what changed (the classified
paths), the models it touched, and how it ended (`Outcome`). The log keeps the last `keep`
revisions (the configs of the last `KEEP_CONFIGS`, of the stable one and of the candidate stay in
memory for going back to them, and are never shown), and
names the stable revision (the last good one, what a rollback returns to) and the candidate
(the change being watched), if any.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from iop.edgeconfig import ChangeReport, EdgeConfig
from iop.verdicts import Judgement

#: started: the config the Edge started with; watching: being judged now; promoted: judged
#: good; unjudged: promoted with too little traffic to judge; kept: applied with no watch
#: (nothing served changed, or `rollout.mode: off`); rolled_back: a check failed (or a caller
#: aborted it) and the stable revision was put back; superseded: another change came before
#: its verdict.
Outcome = Literal[
    "started", "watching", "promoted", "unjudged", "kept", "rolled_back", "superseded"
]

#: Revisions the log keeps by default.
KEEP: Final = 20
#: Of those, the newest whose config stays in memory for going back (besides the stable one and
#: the candidate): a config of the largest documented size holds about 5 MiB.
KEEP_CONFIGS: Final = 5


@dataclass(frozen=True, slots=True)
class Revision:
    number: int
    config_hash: str
    #: The Edge's snapshot generation the revision came into effect as.
    generation: int
    applied_at: float
    requested_by: str
    source: str
    change: ChangeReport
    #: The models whose serving the change altered (what the watch judges).
    touched: tuple[str, ...]
    outcome: Outcome
    reason: str = ""
    #: The judgement that ended the watch (figures of the candidate and the baseline).
    judgement: Judgement | None = None
    #: How it went on trial (`planning.Plan.describe`): which models take a canary, which apply
    #: to all at once.
    plan: str = ""
    #: A canary's share of its models' requests now, in percent (None: no canary).
    share: int | None = None
    #: The earlier revision whose config this one is again (the same hash), if any.
    restores: int | None = None
    ended_at: float | None = None
    config: EdgeConfig | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The admin API's view: no config value, only hashes and paths."""
        return {
            "revision": self.number,
            "config_hash": self.config_hash,
            "generation": self.generation,
            "applied_at": self.applied_at,
            "requested_by": self.requested_by,
            "source": self.source,
            "live_paths": list(self.change.live_paths),
            "restart_required_paths": [p.as_dict() for p in self.change.restart_required_paths],
            "touched_models": list(self.touched),
            "plan": self.plan,
            "share_percent": self.share,
            "outcome": self.outcome,
            "reason": self.reason,
            "judgement": self.judgement.as_dict() if self.judgement is not None else None,
            "restores": self.restores,
            "ended_at": self.ended_at,
        }


class RevisionLog:
    """The last `keep` revisions, the stable one and the candidate; see the module."""

    def __init__(self, keep: int = KEEP) -> None:
        self._revisions: collections.deque[Revision] = collections.deque(maxlen=keep)
        self._next = 1
        self.stable: Revision | None = None
        self.candidate: Revision | None = None
        #: How many revisions ended each way since the Edge started (the metrics read it).
        self.ended: collections.Counter[str] = collections.Counter()

    def __iter__(self) -> Iterator[Revision]:
        return iter(self._revisions)

    def get(self, number: int) -> Revision | None:
        for revision in self._revisions:
            if revision.number == number:
                return revision
        return None

    def add(self, revision: Revision) -> Revision:
        """Number `revision` (its `number` is ignored) and keep it; it ends a candidate that was
        still watched (superseded). Returns the revision as kept."""
        if self.candidate is not None:
            self.end(self.candidate.number, "superseded", "another change came before its verdict")
        earlier = next(
            (r.number for r in reversed(self._revisions) if r.config_hash == revision.config_hash),
            None,
        )
        kept = replace(revision, number=self._next, restores=earlier)
        self._next += 1
        self._revisions.append(kept)
        if kept.outcome == "watching":
            self.candidate = kept
        else:
            self.stable = kept
        self._forget_old_configs()
        return kept

    def _forget_old_configs(self) -> None:
        held = {r.number for r in (self.stable, self.candidate) if r is not None}
        old = list(self._revisions)[:-KEEP_CONFIGS]
        if any(r.config is not None and r.number not in held for r in old):
            self._revisions = collections.deque(
                (
                    replace(r, config=None) if r in old and r.number not in held else r
                    for r in self._revisions
                ),
                maxlen=self._revisions.maxlen,
            )

    def step(self, number: int, share: int, judgement: Judgement) -> None:
        """Revision `number`'s canary moved to `share` percent after `judgement`."""
        revision = self.get(number)
        if revision is not None:
            self._replace(replace(revision, share=share, judgement=judgement))
            if self.candidate is not None and self.candidate.number == number:
                self.candidate = self.get(number)

    def _replace(self, revision: Revision) -> None:
        self._revisions = collections.deque(
            (revision if r.number == revision.number else r for r in self._revisions),
            maxlen=self._revisions.maxlen,
        )

    def end(
        self,
        number: int,
        outcome: Outcome,
        reason: str = "",
        judgement: Judgement | None = None,
    ) -> Revision | None:
        """Record how revision `number` ended; a promoted (or unjudged) one becomes stable."""
        revision = self.get(number)
        if revision is None:
            return None
        ended = replace(
            revision, outcome=outcome, reason=reason, judgement=judgement, ended_at=time.time()
        )
        self._replace(ended)
        self.ended[outcome] += 1
        if self.candidate is not None and self.candidate.number == number:
            self.candidate = None
        if outcome in ("promoted", "unjudged"):
            self.stable = ended
        return ended

    def as_dict(self) -> dict[str, Any]:
        return {
            "stable": self.stable.number if self.stable is not None else None,
            "candidate": self.candidate.number if self.candidate is not None else None,
            "revisions": [r.as_dict() for r in reversed(self._revisions)],
        }
