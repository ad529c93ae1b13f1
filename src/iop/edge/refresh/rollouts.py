"""Each applied change a revision, watched while it serves, rolled back when it hurts.

`Rollouts` is the `Refresher`'s companion: the refresher tells it of every apply that changed
something (`applied`), and it records the revision and, when the change altered how some models
are served and `rollout.mode` is `watch`, starts a watch: every `TICK_S` it reads the outcome
tally, judges the touched models' requests since the apply against theirs under the stable
revision (`judging.judge`), and promotes the change or puts the stable revision's config back
through the refresher's own apply (`restore`), so a rollback swaps and pushes like any apply.
A caller may end a watch by hand (`promote`, `roll_back`). docs/rollout.md has the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop.edgeconfig import ChangeReport, EdgeConfig, config_hash

from ..pool import Figures, OutcomeTally, PoolSnapshot, Reading
from .judging import Judgement, judge
from .reports import RefreshReport
from .revisions import Outcome, Revision, RevisionLog

logger = logging.getLogger(__name__)

#: How often a watched change is judged.
TICK_S: Final = 0.5

#: Puts the stable revision back in effect in place of a candidate (the refresher's apply, under
#: its lock), with a reason; None when, by the time it holds the lock, that candidate is no
#: longer the one watched (another change superseded it): nothing is done then.
Restore = Callable[[Revision, Revision, str], Awaitable[RefreshReport | None]]


class NoCandidate(Exception):
    """A promote or a rollback by hand with no change being watched."""


class Rollouts:
    """The revision log and the watch of the candidate; see the module docstring."""

    def __init__(self, outcomes: OutcomeTally | None, restore: Restore) -> None:
        self.log = RevisionLog()
        self._outcomes = outcomes if outcomes is not None else OutcomeTally()
        self._restore = restore
        self._watch: asyncio.Task[None] | None = None
        #: The tally when the stable revision's figures started to count.
        self._stable_since = Reading()
        #: Configs rolled back since the last new revision, by hash: an apply of one again is
        #: refused (what keeps a caller that reapplies its desired config from undoing a
        #: rollback), until another config is applied.
        self._rolled_back: dict[str, Revision] = {}

    def started(self, snapshot: PoolSnapshot, source: str) -> None:
        """Revision 1: the config the Edge started with."""
        self.log.add(_revision(snapshot, ChangeReport(), (), "started", "", source))

    def reading(self) -> Reading:
        """The outcome tally now (the refresher takes one as it swaps a change in)."""
        return self._outcomes.reading()

    def applied(
        self, report: RefreshReport, before: PoolSnapshot, after: PoolSnapshot, at_swap: Reading
    ) -> Revision:
        """A change swapped in when the tally read `at_swap` (called under the refresher's
        lock): its revision, watched when it touched what is served and the new config says
        `rollout.mode: watch`."""
        self._stop_watch()
        self._rolled_back.clear()
        touched = _touched(before, after)
        rules = after.config.rollout
        watched = bool(touched) and rules.mode == "watch"
        reason = ""
        if not watched:
            reason = "rollout.mode is off" if touched else "nothing served changed"
        revision = self.log.add(
            _revision(
                after,
                report.change,
                touched,
                "watching" if watched else "kept",
                report.requested_by,
                report.source,
                reason,
            )
        )
        if not watched:
            return revision
        at_apply = at_swap
        baseline = at_apply.of(touched) - self._stable_since.of(touched)
        self._watch = asyncio.create_task(
            self._judge_until_done(revision, at_apply, baseline),
            name=f"edge-rollout-watch-{revision.number}",
        )
        logger.info(
            "revision %d watched: %d model(s) touched (%s), bake %.0fs, at most %.0fs",
            revision.number,
            len(touched),
            ", ".join(touched[:8]),
            rules.bake_ms / 1000,
            rules.max_wait_ms / 1000,
        )
        return revision

    def status(self) -> dict[str, Any]:
        return self.log.as_dict()

    def refusal(self, config: EdgeConfig) -> str:
        """Why an apply of `config` is refused now, or "" (see `_rolled_back`); hashes it only
        when some config was rolled back."""
        if not self._rolled_back:
            return ""
        revision = self._rolled_back.get(config_hash(config))
        if revision is None:
            return ""
        return (
            f"refused: this config was rolled back as revision {revision.number} "
            f"({revision.reason}); apply a changed config (rollout.mode: off keeps it unjudged)"
        )

    async def promote(self, requested_by: str) -> Revision:
        """Promote the candidate by hand, unjudged."""
        candidate = self._candidate()
        self._stop_watch()
        self._stable_since = self._outcomes.reading()
        ended = self.log.end(candidate.number, "promoted", f"promoted by hand ({requested_by})")
        assert ended is not None
        return ended

    async def roll_back(self, requested_by: str) -> Revision:
        """Abort the candidate by hand: the stable revision's config goes back in effect."""
        candidate = self._candidate()
        self._stop_watch()
        return await self._roll_back(candidate, f"rolled back by hand ({requested_by})", None)

    async def aclose(self) -> None:
        task, self._watch = self._watch, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the watch -------------------------------------------------------------------------------

    def _candidate(self) -> Revision:
        if self.log.candidate is None:
            raise NoCandidate("no change is being watched")
        return self.log.candidate

    def _stop_watch(self) -> None:
        task, self._watch = self._watch, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _judge_until_done(
        self, revision: Revision, at_apply: Reading, baseline: Figures
    ) -> None:
        rules = revision.config.rollout if revision.config is not None else None
        assert rules is not None
        started = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            candidate = self._outcomes.reading().of(revision.touched) - at_apply.of(
                revision.touched
            )
            judgement = judge(rules, baseline, candidate, time.monotonic() - started)
            if judgement.verdict == "wait":
                continue
            if judgement.verdict == "roll_back":
                with contextlib.suppress(NoCandidate):
                    await self._roll_back(revision, judgement.message, judgement)
            else:
                self._stable_since = at_apply
                outcome: Outcome = "promoted" if judgement.verdict == "promote" else "unjudged"
                self.log.end(revision.number, outcome, judgement.message, judgement)
                logger.info("revision %d %s: %s", revision.number, outcome, judgement.message)
            return

    async def _roll_back(
        self, revision: Revision, reason: str, judgement: Judgement | None
    ) -> Revision:
        stable = self.log.stable
        assert stable is not None and stable.config is not None
        report = await self._restore(stable, revision, f"revision {revision.number}: {reason}")
        if report is None:
            raise NoCandidate(f"revision {revision.number} was superseded by another change")
        logger.warning(
            "revision %d rolled back to revision %d: %s", revision.number, stable.number, reason
        )
        self._stable_since = self._outcomes.reading()
        why = reason if report.applied else f"{reason}; the rollback failed: {report.message}"
        ended = self.log.end(revision.number, "rolled_back", why, judgement)
        assert ended is not None
        self._rolled_back[ended.config_hash] = ended
        return ended


class RolloutCollector(Collector):
    """The revisions as metrics, read when Prometheus scrapes."""

    def __init__(self, rollouts: Rollouts) -> None:
        self._log = rollouts.log

    def collect(self) -> Iterator[Metric]:
        revision = GaugeMetricFamily(
            "iop_edge_revision",
            "The number of the stable revision and of the candidate being watched (0: none).",
            labels=["role"],
        )
        for role, held in (("stable", self._log.stable), ("candidate", self._log.candidate)):
            revision.add_metric([role], held.number if held is not None else 0)
        yield revision
        ended = CounterMetricFamily(
            "iop_edge_revisions_ended",
            "Revisions that ended, by outcome: promoted, unjudged, rolled_back, superseded.",
            labels=["outcome"],
        )
        for outcome in ("promoted", "unjudged", "rolled_back", "superseded"):
            ended.add_metric([outcome], self._log.ended[outcome])
        yield ended


def _touched(before: PoolSnapshot, after: PoolSnapshot) -> tuple[str, ...]:
    """The models whose dispatch view differs (candidates, their limits and served names, the
    policy, fallbacks, timeouts), added or removed."""
    names = set(before.models) | set(after.models)
    return tuple(sorted(m for m in names if before.models.get(m) != after.models.get(m)))


def _revision(
    snapshot: PoolSnapshot,
    change: ChangeReport,
    touched: tuple[str, ...],
    outcome: Outcome,
    requested_by: str,
    source: str,
    reason: str = "",
) -> Revision:
    return Revision(
        number=0,
        config_hash=snapshot.config_hash,
        generation=snapshot.generation,
        applied_at=time.time(),
        requested_by=requested_by,
        source=source,
        change=change,
        touched=touched,
        outcome=outcome,
        reason=reason,
        config=snapshot.config,
    )
