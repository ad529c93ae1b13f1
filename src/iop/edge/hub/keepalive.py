"""The node hub's liveness tick: heartbeats out, silent Nodes ended, late runs and stalls failed.

Every heartbeat interval `KeepAlive` visits the sessions that are due (`visits.py`: the busy
ones, and a quiet one at its next heartbeat or its deadline), sends each its heartbeat, ends a
session whose Node fell silent past its deadline, fails the runs its Node never accepted in
time and stops the streams whose client stalled (the nodes placed on the Edge too). It owns its
loop, the visits and the counters of what it ended. docs/reliability.md, "Liveness of the Node
links" and "Slow stream clients", says what it guarantees.
"""

from __future__ import annotations

import asyncio
import logging
import time

from iop.aiokits import guarded_task, stop_tasks
from iop.edgeconfig import EdgeConfig
from iop.wire import Liveness, Ticker, statuses
from iop.wire import runtime_pb2 as pb

from .localnodes import LocalNodes
from .nodesessions import NodeSession
from .visits import Visits


def stall_timeout_of(config: EdgeConfig) -> float:
    """Seconds a stream's client may leave its data unread: `openai.stream_stall_timeout_ms`."""
    return config.openai.stream_stall_timeout_ms / 1000


class KeepAlive:
    """The tick over the hub's sessions (and its nodes placed on the Edge), and its loop.
    `stall_timeout`: the config's `openai.stream_stall_timeout_ms` in seconds
    (`stall_timeout_of`), set by the hub on every swap."""

    def __init__(
        self,
        liveness: Liveness,
        first_event_timeout: float,
        stall_timeout: float,
        local: LocalNodes,
        logger: logging.Logger,
    ) -> None:
        self.liveness = liveness
        self.first_event_timeout = first_event_timeout
        self.stall_timeout = stall_timeout
        self._local = local
        self._logger = logger
        #: Which sessions the tick visits: busy ones, quiet ones when due (the hub tells it).
        self.visits: Visits[NodeSession] = Visits()
        self._task: asyncio.Task[None] | None = None
        #: Sessions ended because their node fell silent past the heartbeat deadline.
        self.silent_nodes = 0
        #: Runs failed because their node never accepted them in time.
        self.runs_not_accepted = 0
        #: Streams stopped because their client read too little for too long (their slots freed).
        self.streams_stalled = 0

    def start(self) -> None:
        self._task = guarded_task(self._keep_alive(), name="hub-liveness", logger=self._logger)

    async def stop(self) -> None:
        if self._task is not None:
            await stop_tasks([self._task])
            self._task = None

    async def _keep_alive(self) -> None:
        """Heartbeats to every node; ends silent sessions; fails runs never accepted in time.

        A tick that comes late (this Edge's own loop stalled) judges nobody: what the nodes sent
        meanwhile may still wait unread, and the readers catch up before the next tick. Only
        cancellation ends the loop: a failing tick is logged with its traceback and the next
        one runs, since an Edge without this loop would never notice a frozen node again.
        """
        ticker = Ticker(self.liveness.heartbeat_interval)
        while True:
            on_time = await ticker.tick()
            try:
                self._tick(on_time)
            except Exception:
                self._logger.exception("the hub's liveness tick failed; carrying on")

    def _tick(self, on_time: bool) -> None:
        liveness = self.liveness
        beat = pb.Heartbeat(sent_at=time.time())
        now = asyncio.get_running_loop().time()
        stall_timeout = self.stall_timeout
        self.streams_stalled += self._local.tick(now, stall_timeout)
        # A beat is due a little early rather than a whole tick late.
        early = liveness.heartbeat_interval / 2
        visits = self.visits
        for session in visits.due(now):
            quiet = session.quiet_when_idle
            idle = quiet and not session.runs
            # A quiet link whose beats go one way gets none from this side: its Node needs none.
            beats = not (idle and session.quiet_one_way)
            if beats and now - session.last_sent >= liveness.interval(idle) - early:
                session.writer_put(beat)
                session.last_sent = now
            if session.paused:
                self.streams_stalled += session.expire_stalled(now, stall_timeout)
            if on_time:
                self._judge(session, now, quiet)
            if session.runs or not quiet:
                visits.busy(session)
            else:  # a quiet link: next visited for its next beat (if it beats) or its deadline
                when = session.last_heard + liveness.idle_timeout
                if not session.quiet_one_way:
                    when = min(when, session.last_sent + liveness.idle_interval - early)
                visits.later(session, max(when, now + early))

    def _judge(self, session: NodeSession, now: float, quiet: bool) -> None:
        """End `session` if its Node fell silent past its deadline (closed, the hub's reader of
        it ends and the hub drops it); fail its runs not accepted in time."""
        liveness = self.liveness
        # The Node keeps the link quiet until it has a run: until it accepted one (its message
        # saying so is heard), a run sent is its first-event deadline's to judge.
        silent = now - session.last_heard
        if silent > liveness.timeout(quiet and len(session.runs) == len(session.unaccepted)):
            if not session.closing.done():
                self.silent_nodes += 1
                self._logger.warning(
                    "node %s (instance %s) sent nothing for %.1fs: ending its session",
                    session.node_id,
                    session.instance_id,
                    silent,
                )
            session.close(statuses.SILENT, f"no message from the node for {silent:.1f}s")
        elif session.unaccepted:
            self.runs_not_accepted += session.expire_unaccepted(now, self.first_event_timeout)
