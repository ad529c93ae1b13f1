"""The simulated GPU server on the wall clock: one task steps `simulating.GpuEngine`, waits out each
step's duration and hands each request the tokens the step gave it, so a completion is answered
as a GPU server would time it (docs/architecture.md, "The fakes")."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import replace

import orjson

from iop.aiokits import guarded_task

from ..answers import Completion, error_body, tokens
from ..simulating import GpuEngine, GpuSettings, render_answer, render_chat
from .connection import Connection, Request
from .streaming import completion_chunks, completion_end

logger = logging.getLogger(__name__)


class GpuClock:
    """One `GpuEngine` run in real time, and the completions it times."""

    def __init__(self, settings: GpuSettings) -> None:
        self.settings = settings
        self.engine = GpuEngine(settings)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        #: Simulated request id -> where its tokens go (a count per step, -1 at its end).
        self._sims: dict[int, asyncio.Queue[int]] = {}

    def reset(self) -> None:
        """A new engine, its cache empty (call it while no request is in flight)."""
        self.engine = GpuEngine(self.settings)
        self._wake.set()

    def detach(self) -> list[asyncio.Task[None]]:
        """The clock's task, for its server to stop (the next completion starts another)."""
        task, self._task = self._task, None
        return [task] if task is not None else []

    async def answer(
        self, connection: Connection, request: Request, completion: Completion
    ) -> None:
        """Answer as the simulated GPU server times it: the first token when its prefill is
        done, one more per engine step; the whole body at the end when it does not stream."""
        engine = self.engine
        document = orjson.loads(request.body)
        priority = document.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            refusal = error_body(
                "priority must be an integer", type="BadRequestError", param="priority"
            )
            connection.write_response(400, refusal, request.keep_alive)
            return
        if priority and not engine.settings.by_priority:
            # vLLM's words for a priority sent to a server that schedules first come first served.
            refusal = error_body(
                f"Got priority {priority} but Priority scheduling is not enabled.",
                type="BadRequestError",
                param="priority",
            )
            connection.write_response(400, refusal, request.keep_alive)
            return
        if completion.kind == "chat":
            prompt = render_chat(document.get("messages") or [])
        else:
            raw = document.get("prompt")
            prompt = (raw if isinstance(raw, str) else orjson.dumps(raw).decode()).encode()
        text = "".join(tokens(completion.completion_tokens))
        adapter = completion.model if completion.model in engine.settings.adapters else None
        sim = engine.submit(
            prompt, completion.completion_tokens, render_answer(text), adapter, priority
        )
        queue: asyncio.Queue[int] = asyncio.Queue()
        self._sims[sim.id] = queue
        self._wake.set()
        if self._task is None:
            self._task = guarded_task(self._drive(), name="fake-upstream-gpu", logger=logger)
        try:
            first = await queue.get()
            completion = replace(
                completion, prompt_tokens=sim.prompt_tokens, cached_tokens=sim.cached_tokens
            )
            words = tokens(completion.completion_tokens)
            if not completion.stream:
                while first != -1:
                    first = await queue.get()
                connection.write_response(200, completion.response(), request.keep_alive)
                return
            out = [connection.stream_head(request.keep_alive)]
            count = first
            while count != -1:
                out += completion_chunks(
                    completion, itertools.islice(words, count), first=len(out) == 1
                )
                await connection.write(b"".join(out))
                out.clear()
                count = await queue.get()
            out += completion_end(completion)
            await connection.write(b"".join(out))
        finally:
            self._sims.pop(sim.id, None)
            engine.cancel(sim)  # nothing once it is done; frees its cache when its client left

    async def _drive(self) -> None:
        """The simulated server's clock: a step, its duration, then the tokens it gave.

        Steps end on a schedule (each one its duration after the one before), not a sleep after
        each: a process that wakes late, on a busy machine, catches up on its next steps, so
        the server keeps the speed it simulates, as a GPU does whatever its host's CPUs do.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            step = self.engine.step()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()  # idle until now: the next step starts now
                continue
            deadline = max(deadline, loop.time() - step.duration_s) + step.duration_s
            await asyncio.sleep(deadline - loop.time())
            sims = self._sims
            for sim, count in step.tokens:
                queue = sims.get(sim.id)
                if queue is not None:
                    queue.put_nowait(count)
            for sim in step.finished:
                queue = sims.get(sim.id)
                if queue is not None:
                    queue.put_nowait(-1)
