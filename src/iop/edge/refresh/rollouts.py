"""Each applied change a revision, watched while it serves, rolled back when it hurts.

`Rollouts` is the `Refresher`'s companion. Before an apply swaps a change in, `trial` plans it
(`iop.edgeconfig.plan_trial`: which models it touches, which of them take a canary) and gives
the `Split`
the dispatcher swaps in with it; after, `applied` records the revision and, when the change
altered how some models are served and `rollout.mode` is not `off`, starts the watch: every
`TICK_S` it reads the outcome tally and judges the requests the change served on the touched
models against those the stable revision served (`iop.verdicts.judging`); a canary moves through its
steps (`Dispatcher.set_share`), and the change is promoted (`Dispatcher.end_split`) or the
stable revision's config is put back through the refresher's own apply (`restore`), so a
rollback swaps and pushes like any apply. A caller may end a watch by hand (`promote`,
`roll_back`). docs/rollout.md has the model.
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

from iop.edgeconfig import ChangeReport, EdgeConfig, Trial, config_hash, plan_trial
from iop.verdicts import Judgement, judge, judge_step

from ..pool import CANDIDATE, STABLE, Dispatcher, OutcomeTally, PoolSnapshot, Reading, Split
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

    def __init__(
        self, dispatcher: Dispatcher, outcomes: OutcomeTally | None, restore: Restore
    ) -> None:
        self.log = RevisionLog()
        self._dispatcher = dispatcher
        self._outcomes = outcomes if outcomes is not None else OutcomeTally()
        self._restore = restore
        self._watch: asyncio.Task[None] | None = None
        #: The tally when the stable revision's figures started to count (its side only counts
        #: requests the stable revision served, canary or not).
        self._stable_since = Reading()
        #: Configs rolled back since the last new revision, by hash: an apply of one again is
        #: refused (what keeps a caller that reapplies its desired config from undoing a
        #: rollback), until another config is applied.
        self._rolled_back: dict[str, Revision] = {}
        #: When this process started counting (Unix seconds).
        self._since = round(time.time(), 3)

    def started(self, snapshot: PoolSnapshot, source: str) -> None:
        """Revision 1: the config the Edge started with."""
        self.log.add(_revision(snapshot, ChangeReport(), (), "started", "", source))

    def reading(self) -> Reading:
        """The outcome tally now (the refresher takes one as it swaps a change in)."""
        return self._outcomes.reading()

    def stable_config(self) -> EdgeConfig:
        """The config of the revision a change goes on trial against now (see `trial`)."""
        split = self._dispatcher.split
        return (split.stable if split is not None else self._dispatcher.snapshot).config

    def trial(
        self, after: PoolSnapshot, planned: tuple[EdgeConfig, Trial] | None = None
    ) -> tuple[Trial, Split | None]:
        """How `after` goes on trial against the stable revision (the one serving beside a
        candidate, if a change is on trial now), and the split to swap in with it (None: not
        watched). `planned`: the trial already planned against a stable config (in a worker
        thread), used while that config is still the stable one."""
        split = self._dispatcher.split
        stable = split.stable if split is not None else self._dispatcher.snapshot
        if planned is not None and planned[0] is stable.config:
            trial = planned[1]
        else:
            trial = plan_trial(stable.config, after.config)
        rules = after.config.rollout
        if not trial.touched or rules.mode == "off":
            return trial, None
        share = rules.steps[0] if trial.shared else 100
        return trial, Split(stable, frozenset(trial.touched), frozenset(trial.shared), share)

    def applied(
        self,
        report: RefreshReport,
        after: PoolSnapshot,
        trial: Trial,
        split: Split | None,
        at_swap: Reading,
    ) -> Revision:
        """A change swapped in with `split` when the tally read `at_swap` (called under the
        refresher's lock): its revision, watched when `split` says so."""
        self._stop_watch()
        self._rolled_back.clear()
        rules = after.config.rollout
        reason = ""
        if not trial.touched:
            reason = "nothing served changed"
        elif report.change.restart_required_paths:
            reason = "restart-required: the caller's restart of its nodes rolls it out"
        elif split is None:
            reason = "rollout.mode is off"
        revision = self.log.add(
            _revision(
                after,
                report.change,
                trial.touched,
                "watching" if split is not None else "kept",
                report.requested_by,
                report.source,
                reason,
                trial.describe(rules.steps) if split is not None else "",
                split.share if split is not None and split.shared else None,
            )
        )
        if split is None:
            return revision
        self._watch = asyncio.create_task(
            self._judge_until_done(revision, trial, at_swap),
            name=f"edge-rollout-watch-{revision.number}",
        )
        logger.info(
            "revision %d on trial: %s; at most %.0fs",
            revision.number,
            revision.plan,
            rules.max_wait_ms / 1000,
        )
        return revision

    def status(self) -> dict[str, Any]:
        return self.log.as_dict()

    def served(self) -> dict[str, Any]:
        """What this process served since it started, every model and revision together, in
        counts (`Figures.counts`): what the operator holds a new Edge pod to the old ones by."""
        return {"since": self._since, "figures": self.reading().total().counts()}

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
        return self._promote(candidate, "promoted", f"promoted by hand ({requested_by})", None)

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

    async def _judge_until_done(self, revision: Revision, trial: Trial, at_apply: Reading) -> None:
        try:
            await self._judge(revision, trial, at_apply)
        except Exception as error:  # a bug: never leave a candidate serving beside stable
            logger.exception("revision %d: the watch failed; rolling back", revision.number)
            with contextlib.suppress(NoCandidate):
                await self._roll_back(revision, f"the watch failed: {error!r}", None)

    async def _judge(self, revision: Revision, trial: Trial, at_apply: Reading) -> None:
        rules = revision.config.rollout if revision.config is not None else None
        assert rules is not None
        touched = trial.touched
        started = step_started = time.monotonic()
        step = 0
        # What the touched models came to before: summed once, not at every tick (a change may
        # touch every model of thousands).
        candidate_before = at_apply.of(touched, CANDIDATE)
        since = self._stable_since
        stable_before = since.of(touched, STABLE)
        while True:
            await asyncio.sleep(TICK_S)
            if self._stable_since is not since:
                since = self._stable_since
                stable_before = since.of(touched, STABLE)
            candidate = self._outcomes.of(touched, CANDIDATE) - candidate_before
            baseline = self._outcomes.of(touched, STABLE) - stable_before
            clock = time.monotonic()
            if trial.shared:
                judgement = judge_step(
                    rules, baseline, candidate, step, clock - step_started, clock - started
                )
            else:
                judgement = judge(rules, baseline, candidate, clock - started)
            if judgement.verdict == "wait":
                continue
            if judgement.verdict == "next":
                step, step_started = step + 1, clock
                share = rules.steps[step]
                self._dispatcher.set_share(share)
                self.log.step(revision.number, share, judgement)
                logger.info(
                    "revision %d: canary at %d%% (%s)", revision.number, share, judgement.message
                )
                continue
            if judgement.verdict == "roll_back":
                with contextlib.suppress(NoCandidate):
                    await self._roll_back(revision, judgement.message, judgement)
            else:
                outcome: Outcome = "promoted" if judgement.verdict == "promote" else "unjudged"
                self._promote(revision, outcome, judgement.message, judgement)
            return

    def _promote(
        self, revision: Revision, outcome: Outcome, reason: str, judgement: Judgement | None
    ) -> Revision:
        """The candidate serves everything from now on and is the stable revision."""
        self._dispatcher.end_split()
        self._stable_since = self._outcomes.reading()
        ended = self.log.end(revision.number, outcome, reason, judgement)
        assert ended is not None
        logger.info("revision %d %s: %s", revision.number, outcome, reason)
        return ended

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


def _revision(
    snapshot: PoolSnapshot,
    change: ChangeReport,
    touched: tuple[str, ...],
    outcome: Outcome,
    requested_by: str,
    source: str,
    reason: str = "",
    trial: str = "",
    share: int | None = None,
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
        plan=trial,
        share=share,
        config=snapshot.config,
    )
