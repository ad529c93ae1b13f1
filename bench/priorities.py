"""Benchmark: priority classes on a saturated simulated GPU fleet, against no classes and the
vLLM router.

    uv run --frozen python -m bench.priorities [--loads 1 1.5 2] [--seconds 60] [--warmup 20]
        [--systems iop:classes iop:none vllm-router:cache_aware] [--chart docs/priorities.png]

The fleet is `bench.routing`'s (`--workload chat`: four `iop fake-upstream --gpu` servers, a
batch of 16 each, multi-turn conversations over shared system prompts), and so is "capacity":
the requests a second the fleet completes saturated. Three clients, each a principal of its own
with its own conversations (open loop, Poisson, `bench.routing.workload`):

- **interactive** (a chat product): a fixed `--interactive` share of the capacity at every load
  (0.25 by default); class `interactive`, priority 10;
- **standard** (an internal tool): `--standard` of the rest of the load (0.3 by default of what
  is left after interactive: 0.225 of the capacity at 1x, 0.525 at 2x); class `standard`,
  priority 0;
- **batch** (a nightly evaluation): the rest; class `batch`, priority -1 (sheddable). It honours
  a 429's `retry-after-ms` (then `Retry-After`) and sends the request again, up to `--retries`
  times, as the official clients do.

So at 1x the three fill the fleet, and at 1.5x and 2x the batch job alone is the excess. Each
cell: `--seconds` of arrivals, the first `--warmup` not measured; a request still unanswered
when the arrivals end plus `--drain` seconds is cut (counted as not completed).

Conversations are causal (`--turns causal`, the default): a turn's prompt holds the answer to
the turn before it, so it is sent at its time or when that answer came, whichever is later, and
not at all once a turn of its conversation failed for good or when that answer came after the
arrivals' end (counted as "not sent").
`--turns scheduled` sends every turn at its time whatever became of the one before, as this
benchmark did until 2026-12-05: a shed turn's successors then reach the servers before it.

Systems, in front of the same servers (run with `--gpu-scheduling-policy priority`, which
changes nothing for a request without a priority: first come first served), each cell after a
reset of the servers:
- `iop:classes`: `iop edge run` and one `iop node run`, `prefix_affinity`, capacity 16 a server
  (its batch: every request past it waits at the Edge, where the classes order it), the three
  classes applied live before each cell;
- `iop:none`: the same Edge with the classes removed live (every request in class `default`);
- `iop:classes@12`: the classes with 12 slots a server (not by default): room kept on every
  server, what an interactive request's first token gains from it and what the fleet loses;
- `iop:classes+engine`: the classes, and each provider's `engine_priority`: the servers get each
  request's class as vLLM's `priority` and schedule by it (their queue and prefill by class, a
  running request of a lower class preempted for a higher one's); `iop:classes+engine@20`: the
  same with 20 slots a server, so each server holds a short queue of its own that it orders;
- `vllm-router:<policy>`: the vLLM project's router (`bench.peers` installs it), which forwards
  every request at once and leaves the queue to the servers.

Also measured once per run: **interactive alone** (its own stream, no other client) through
`iop:classes`: the TTFT its class gets at 2x is compared with it.

Per cell and class: requests sent, completed, TTFT p50/p99 of those completed, 429s (and their
answer time p99), their honoured retries that succeeded (at the first retry, and within
`--retries`), other failures (503 displaced, 504 queue_wait_exceeded, cut); goodput, the
completion tokens of requests completed within the measured window per second, all classes.
Over that window also: the servers' tokens generated and prompt tokens (and of them cached),
their requests finished, their running requests (sampled every 0.2 s), and for each class the
tokens streamed to it and the share of its completed requests' prompts the servers had cached.
The machine's other work shares the cores, so cells of one run are compared with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop

from bench import benchkit, peers, routing
from bench.benchkit import nearest_rank
from bench.routing import SHAPES, Target, Turn, workload
from testkit import Client

CLASSES = ("interactive", "standard", "batch")
SYSTEMS = (
    "iop:classes",
    "iop:none",
    "vllm-router:cache_aware",
    "vllm-router:round_robin",
    "iop:classes@12",
    "iop:classes+engine",
    "iop:classes+engine@20",
)
#: Each class's client: its principal and API key.
CLIENTS = {name: Client(f"{name}-app", f"sk-bench-{name}", f"team-{name}") for name in CLASSES}
PRIORITY = {
    "classes": [
        {"name": "interactive", "priority": 10, "max_queue_wait_ms": 120_000},
        {"name": "standard", "priority": 0, "max_queue_wait_ms": 120_000},
        {"name": "batch", "priority": -1, "max_queue_wait_ms": 120_000},
    ],
    "default_class": "standard",
    "principals": [
        {"principal_ref": CLIENTS[name].principal_ref, "priority_class": name} for name in CLASSES
    ],
}
#: The capacity of each IOP provider: the server's batch, so the Edge holds the queue.
CAPACITY = 16


@dataclass
class Sample:
    klass: str
    at: float
    ttft: float
    end: float
    ok: bool
    tokens: int
    status: int = 0
    #: Tokens streamed to it within the measured window (its `data:` chunks with content).
    window_tokens: int = 0
    #: Its prompt's tokens, and those the server had in its prefix cache (its answer's usage).
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: Its conversation and turn, and when its last try was sent (seconds into the cell).
    conversation: int = 0
    index: int = 0
    sent: float = 0.0
    #: Seconds each 429 took to answer, and whether the retry after it succeeded.
    shed_answers: list[float] = field(default_factory=list)
    retried_ok_first: bool | None = None
    #: The statuses of its tries after a 429, each sent when the 429 said.
    retries: list[int] = field(default_factory=list)
    why: str = ""


@dataclass
class Cell:
    system: str
    load: float
    samples: list[Sample] = field(default_factory=list)
    span: float = 0.0
    #: Each class's counts at the Edge (`GET /status`'s `priority_classes`) over the cell, as
    #: (admitted, waited, waited_ms_total) ; None for a system that is not an Edge.
    edge: dict[str, tuple[int, int, float]] | None = None
    #: The servers' prefix-cache hits and queries over the cell (warm-up included), in tokens.
    hits: float = 0.0
    queries: float = 0.0
    #: The servers' running requests, summed over the fleet, sampled every 0.2 s from the end
    #: of the warm-up to the end of the arrivals.
    running: list[float] = field(default_factory=list)
    #: Turns not sent per class, their conversation ended by an earlier turn's failure or by
    #: its answer after the arrivals' end (`--turns causal`).
    abandoned: dict[str, int] = field(default_factory=dict)
    #: The servers' counters (`vllm:*_total`, summed over the fleet) gained over that window.
    window: dict[str, float] = field(default_factory=dict)

    @property
    def batch_queued(self) -> int | None:
        """Batch requests that waited in the Edge's queue during the cell."""
        return None if self.edge is None else self.edge.get("batch", (0, 0, 0.0))[1]

    def of(self, klass: str, warmup: float) -> list[Sample]:
        return [s for s in self.samples if s.klass == klass and s.at >= warmup]


def rates(args: argparse.Namespace, load: float, capacity: float) -> dict[str, float]:
    """Requests a second each class offers at `load` (a share of `capacity`)."""
    interactive = args.interactive * capacity
    rest = max(0.0, load * capacity - interactive)
    standard = args.standard * rest
    return {"interactive": interactive, "standard": standard, "batch": rest - standard}


def document_of(servers: list[Any]) -> dict[str, Any]:
    document = routing.iop_config(servers, CAPACITY, clients=list(CLIENTS.values()))
    document["models"][0]["dispatch"] = {"policy": "prefix_affinity"}
    # Every client dials from 127.0.0.1: the cap per client address would refuse the backlog
    # that builds without classes (429 too_many_requests_in_flight), not the classes.
    document["openai"]["max_requests_per_client"] = 1_000_000
    for entry in document["nodes"][0]["providers"]:
        entry["max_queue"] = 100_000
        entry["queue_timeout_ms"] = 600_000
    return document


async def apply(
    target: Target,
    document: dict[str, Any],
    classes: bool,
    capacity: int = CAPACITY,
    engine: bool = False,
) -> None:
    """Apply the classes (or none), the providers' `capacity` and whether they send the class to
    the server as its `priority` (`engine`) live through the admin API."""
    document["openai"]["priority"] = PRIORITY if classes else {}
    for entry in document["nodes"][0]["providers"]:
        entry["capacity"] = capacity
        entry["engine_priority"] = engine
    await routing.apply_config(target, document, "the classes")


async def edge_classes(target: Target) -> dict[str, tuple[int, int, float]] | None:
    """Each class's (admitted, waited, waited_ms_total) at the Edge since it started, from its
    `GET /status`; None for a system that is not an Edge."""
    if target.admin_url is None:
        return None
    status_url = f"{target.admin_url}/status"
    async with aiohttp.ClientSession() as session, session.get(status_url) as response:
        status = await response.json()
    return {
        name: (counts["admitted"], counts["waited"], counts["waited_ms_total"])
        for name, counts in status["priority_classes"].items()
    }


def edge_line(cell: Cell) -> str:
    """What each class's requests waited at the Edge over the cell (warm-up included)."""
    parts = []
    for klass in CLASSES:
        admitted, waited, total_ms = (cell.edge or {}).get(klass, (0, 0, 0.0))
        if admitted:
            mean = total_ms / waited if waited else 0.0
            parts.append(f"{klass} {waited}/{admitted} waited, mean {mean:,.0f} ms")
    return "; ".join(parts)


async def run_cell(
    target: Target,
    servers: list[Any],
    turns: dict[str, list[Turn]],
    cell: Cell,
    args: argparse.Namespace,
) -> None:
    url = f"{target.url}/v1/chat/completions"
    before = await edge_classes(target)
    async with routing.cell_session(target, servers, total=900) as session:
        loop = asyncio.get_running_loop()
        began = loop.time() + 0.5
        window = (began + args.warmup, began + args.seconds)

        async def once(klass: str, turn: Turn, sample: Sample) -> tuple[int, float, float, bytes]:
            """One try: (status, when its first byte came, when it ended (perf_counter), the
            answer's tail; for a 429, the seconds it says to wait instead)."""
            headers: dict[str, str] = {}  # the session's, and this class's key for an Edge
            if target.token is not None:
                headers["authorization"] = f"Bearer {CLIENTS[klass].key}"
            body = orjson.dumps(
                {
                    "model": target.model,
                    "messages": list(turn.messages),
                    "max_tokens": turn.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            first = 0.0
            async with session.post(url, data=body, headers=headers) as response:
                tail = b""
                async for piece in response.content.iter_any():
                    if not first:
                        first = time.perf_counter()
                    tail = (tail + piece)[-1000:]
                    if window[0] <= loop.time() <= window[1]:
                        sample.window_tokens += piece.count(b'"content":"')
                end = time.perf_counter()
                if response.status == 429:
                    wait_ms = response.headers.get("retry-after-ms")
                    wait = (
                        float(wait_ms) / 1000
                        if wait_ms
                        else float(response.headers.get("retry-after", "1"))
                    )
                    tail = str(wait).encode()
            return response.status, first or end, end, tail

        #: Each turn's outcome (completed or not), which the conversation's next turn waits for.
        outcomes: dict[tuple[str, int, int], asyncio.Future[bool]] = {
            (klass, turn.conversation, turn.index): loop.create_future()
            for klass, class_turns in turns.items()
            for turn in class_turns
        }

        async def send(klass: str, turn: Turn) -> None:
            outcome = outcomes[klass, turn.conversation, turn.index]
            try:
                await try_turn(klass, turn, outcome)
            finally:
                if not outcome.done():
                    outcome.set_result(False)

        async def try_turn(klass: str, turn: Turn, outcome: asyncio.Future[bool]) -> None:
            previous = outcomes.get((klass, turn.conversation, turn.index - 1))
            if args.turns == "causal" and previous is not None:
                # Its prompt holds the answer to the turn before: after a failure its
                # conversation ends; an answer that came after the arrivals' end ends it too.
                if not await previous or loop.time() > began + args.seconds:
                    cell.abandoned[klass] = cell.abandoned.get(klass, 0) + 1
                    return
            await asyncio.sleep(max(0.0, began + turn.at - loop.time()))
            sample = Sample(klass, turn.at, 0.0, 0.0, False, turn.max_tokens)
            sample.conversation, sample.index = turn.conversation, turn.index
            cell.samples.append(sample)
            arrived = time.perf_counter()
            try:
                for attempt in range(args.retries + 1):
                    tried = time.perf_counter()
                    sample.sent = loop.time() - began
                    status, first, end, tail = await once(klass, turn, sample)
                    sample.status = status
                    if attempt == 1:
                        sample.retried_ok_first = status == 200
                    if attempt:
                        sample.retries.append(status)
                    if status != 429 or attempt == args.retries:
                        break
                    sample.shed_answers.append(end - tried)
                    await asyncio.sleep(float(tail))
                sample.ttft = first - arrived
                sample.ok = status == 200 and tail.endswith(b"data: [DONE]\n\n")
                if sample.ok:
                    sample.prompt_tokens, sample.cached_tokens = usage_of(tail)
                if not sample.ok:
                    sample.why = f"HTTP {status}: {tail[-160:].decode(errors='replace')}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                sample.why = repr(exc)
            sample.end = loop.time() - began
            outcome.set_result(sample.ok)

        async def sample_running() -> None:
            await asyncio.sleep(max(0.0, window[0] - loop.time()))
            at_start = await server_totals(session, servers)
            while loop.time() < window[1]:  # the arrivals' time, not the drain's
                fleet = await server_totals(session, servers)
                cell.running.append(fleet.get("vllm:num_requests_running", 0.0))
                await asyncio.sleep(0.2)
            at_end = await server_totals(session, servers)
            cell.window = {
                name: at_end[name] - at_start.get(name, 0.0)
                for name in at_end
                if name.endswith("_total")
            }

        sampler = asyncio.ensure_future(sample_running())
        started = time.perf_counter()
        sends = [
            asyncio.ensure_future(send(klass, turn))
            for klass, class_turns in turns.items()
            for turn in class_turns
        ]
        deadline = began + args.seconds + args.drain
        _, pending = await asyncio.wait(sends, timeout=max(0.0, deadline - loop.time()))
        sampler.cancel()
        for task in pending:
            task.cancel()
        await asyncio.gather(sampler, *pending, return_exceptions=True)
        for sample in cell.samples:
            if not sample.ok and not sample.why:
                sample.why = "cut: no answer when the cell ended"
        cell.span = time.perf_counter() - started
        for server in servers:
            hits, queries, _, _ = await routing.server_counts(session, server)
            cell.hits += hits
            cell.queries += queries
    after = await edge_classes(target)
    if before is not None and after is not None:
        cell.edge = {}
        for name, (admitted, waited, total_ms) in after.items():
            was = before.get(name, (0, 0, 0.0))
            cell.edge[name] = (admitted - was[0], waited - was[1], total_ms - was[2])


def usage_of(tail: bytes) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) from a stream's last chunk with a usage."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage":{' in line:
            usage = orjson.loads(line[6:])["usage"]
            details = usage.get("prompt_tokens_details") or {}
            return int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)
    return 0, 0


async def server_totals(session: aiohttp.ClientSession, servers: list[Any]) -> dict[str, float]:
    """Each `vllm:*` metric of the servers, summed over the fleet."""
    totals: dict[str, float] = {}
    for server in servers:
        for name, value in (await routing.server_metrics(session, server)).items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


async def run(args: argparse.Namespace) -> tuple[list[Cell], float]:
    benchkit.cancel_on_sigterm()
    args.workload = "chat"
    capacity = routing.fleet_capacity(args, "round_robin")
    print(f"# fleet capacity (engine time, saturated): {capacity:.1f} requests/s", flush=True)
    routers = [s for s in args.systems if s.startswith("vllm-router:")]
    router = peers.ensure_vllm_router(args.cache) if routers else None
    cells: list[Cell] = []
    shape = SHAPES["chat"]

    def turns_at(load: float, only: str | None = None) -> dict[str, list[Turn]]:
        offered = rates(args, load, capacity)
        return {
            klass: workload(2000 + 100 * index + round(load * 10), rate, args.seconds, shape)
            for index, (klass, rate) in enumerate(offered.items())
            if rate > 0 and (only is None or klass == only)
        }

    async with contextlib.AsyncExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        servers = await routing.spawn_servers(stack, args, "--gpu-scheduling-policy", "priority")
        iop: tuple[Target, dict[str, Any]] | None = None
        if any(s.startswith("iop:") for s in args.systems) or args.alone:
            document = document_of(servers)
            iop = await stack.enter_async_context(
                routing.iop_stack(servers, CAPACITY, folder, document)
            )
        if args.alone:
            assert iop is not None
            await apply(*iop, classes=True)
            cell = Cell("iop:classes, interactive alone", 0.0)
            await run_cell(iop[0], servers, turns_at(max(args.loads), "interactive"), cell, args)
            cells.append(cell)
            show(cell, args)
        for load in args.loads:
            turns = turns_at(load)
            for system in args.systems:
                kind, _, setting = system.partition(":")
                cell = Cell(system, load)
                if kind == "iop":
                    assert iop is not None
                    name, _, size = setting.partition("@")
                    await apply(
                        *iop,
                        classes=name.startswith("classes"),
                        capacity=int(size or CAPACITY),
                        engine=name.endswith("+engine"),
                    )
                    await run_cell(iop[0], servers, turns, cell, args)
                else:
                    assert router is not None
                    async with routing.vllm_router(router, servers, setting, folder) as target:
                        await run_cell(target, servers, turns, cell, args)
                cells.append(cell)
                show(cell, args)
    return cells, capacity


def class_figures(cell: Cell, klass: str, args: argparse.Namespace) -> dict[str, Any]:
    samples = cell.of(klass, args.warmup)
    done = [s for s in samples if s.ok]
    shed = [answer for s in samples for answer in s.shed_answers]
    retried = [s for s in samples if s.retried_ok_first is not None]
    failed: dict[str, int] = {}
    for sample in samples:
        if not sample.ok:
            key = "cut" if sample.why.startswith("cut") else str(sample.status or "error")
            failed[key] = failed.get(key, 0) + 1
    return {
        "sent": len(samples),
        "completed": len(done),
        "ttft_p50_ms": nearest_rank([s.ttft for s in done], 50) * 1000,
        "ttft_p99_ms": nearest_rank([s.ttft for s in done], 99) * 1000,
        "shed": len(shed),
        "shed_p99_ms": nearest_rank(shed, 99) * 1000 if shed else float("nan"),
        "retry_first_ok": sum(1 for s in retried if s.retried_ok_first) / len(retried)
        if retried
        else float("nan"),
        "shed_then_ok": sum(1 for s in samples if s.shed_answers and s.ok)
        / max(1, sum(1 for s in samples if s.shed_answers)),
        "retries": sum(len(s.retries) for s in samples),
        "retries_ok": sum(1 for s in samples for status in s.retries if status == 200),
        "failed": failed,
    }


def goodput(cell: Cell, args: argparse.Namespace) -> float:
    """Completion tokens a second of the requests that completed within the measured window."""
    window: float = args.seconds - args.warmup
    tokens = sum(s.tokens for s in cell.samples if s.ok and args.warmup <= s.end <= args.seconds)
    return tokens / window


def show(cell: Cell, args: argparse.Namespace) -> None:
    parts = []
    for klass in CLASSES:
        figures = class_figures(cell, klass, args)
        if figures["sent"]:
            parts.append(
                f"{klass} {figures['completed']}/{figures['sent']} TTFT p50 "
                f"{figures['ttft_p50_ms']:.0f} p99 {figures['ttft_p99_ms']:.0f} ms, "
                f"429s {figures['shed']}, failed {figures['failed']}"
                + (
                    f", {cell.abandoned[klass]} turns not sent (an earlier turn failed, or "
                    "its answer came after the arrivals)"
                    if cell.abandoned.get(klass)
                    else ""
                )
            )
    print(
        f"  {cell.system} at {cell.load:g}x: goodput {goodput(cell, args):.0f} tokens/s, "
        f"prefix-cache hits {cell.hits / max(cell.queries, 1):.0%}, servers running "
        f"{statistics.fmean(cell.running) if cell.running else float('nan'):.1f} on average; "
        + "; ".join(parts),
        flush=True,
    )
    if cell.window:
        print(f"    over the window: {window_line(cell, args)}", flush=True)
    if cell.edge:
        print(f"    at the Edge: {edge_line(cell)}", flush=True)


def cached_share(samples: list[Sample]) -> float:
    return sum(s.cached_tokens for s in samples) / max(1, sum(s.prompt_tokens for s in samples))


def window_line(cell: Cell, args: argparse.Namespace) -> str:
    """What the servers did over the measured window (tokens generated and prefilled, requests
    finished, preemptions, a second), and the tokens each class was streamed in it."""
    span = args.seconds - args.warmup
    counts = cell.window
    parts = []
    for klass in CLASSES:
        mine = [s for s in cell.samples if s.klass == klass]
        done = [s for s in mine if s.ok and args.warmup <= s.end <= args.seconds]
        prompt = sum(s.prompt_tokens for s in done)
        shed = [s for s in done if s.shed_answers]
        ended = {(s.conversation, s.index): s.end for s in mine}
        early = [s for s in done if ended.get((s.conversation, s.index - 1), 0.0) > s.sent]
        parts.append(
            f"{klass} {sum(s.window_tokens for s in mine) / span:.0f} "
            f"(completed: {prompt / span:,.0f} prompt tokens/s, {cached_share(done):.0%} cached"
            + (f"; after a 429: {len(shed)}, {cached_share(shed):.0%} cached" if shed else "")
            + (
                f"; sent before the turn before it ended: {len(early)}, "
                f"{cached_share(early):.0%} cached"
                if args.turns == "scheduled"
                else ""
            )
            + ")"
        )
    streamed = ", ".join(parts)
    return (
        f"servers generated {counts.get('vllm:generation_tokens_total', 0) / span:.0f} tokens/s, "
        f"prompt tokens {counts.get('vllm:prompt_tokens_total', 0) / span:,.0f} "
        f"(cached {counts.get('vllm:prefix_cache_hits_total', 0) / span:,.0f}), "
        f"finished {counts.get('vllm:request_success_total', 0) / span:.1f} requests/s, "
        f"preempted {counts.get('vllm:num_preemptions_total', 0):.0f}; "
        f"streamed tokens/s: {streamed}"
    )


def report(cells: list[Cell], capacity: float, args: argparse.Namespace) -> None:
    print(
        "\n| load | system | class | sent | completed | TTFT p50 ms | TTFT p99 ms | 429s "
        "| 429 answered p99 ms | retries after a 429: ok / sent; first ok, ok in the end "
        "| other failures "
        "| goodput tokens/s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|")
    for cell in cells:
        for klass in CLASSES:
            figures = class_figures(cell, klass, args)
            if not figures["sent"]:
                continue
            failures = {k: v for k, v in figures["failed"].items() if k != "429"}
            retry = (
                f"{figures['retries_ok']}/{figures['retries']} honoured; first "
                f"{figures['retry_first_ok']:.0%}, in the end {figures['shed_then_ok']:.0%}"
                if figures["shed"]
                else ""
            )
            print(
                f"| {cell.load:g}x | {cell.system} | {klass} | {figures['sent']} | "
                f"{figures['completed']} | {figures['ttft_p50_ms']:,.0f} | "
                f"{figures['ttft_p99_ms']:,.0f} | {figures['shed']} | "
                f"{figures['shed_p99_ms']:.1f} | {retry} | "
                f"{', '.join(f'{k}: {v}' for k, v in sorted(failures.items())) or '-'} | "
                f"{goodput(cell, args):,.0f} |"
            )
    alone = next((c for c in cells if "alone" in c.system), None)
    top = max(args.loads)
    print("\nThe goals at the highest load:\n")
    for cell in [c for c in cells if c.load == top and c.system.startswith("iop:classes")]:
        print(f"{cell.system}:")
        mine = class_figures(cell, "interactive", args)
        if alone is not None:
            solo = class_figures(alone, "interactive", args)
            print(
                f"- interactive TTFT at {top:g}x against alone: p50 "
                f"{mine['ttft_p50_ms'] / solo['ttft_p50_ms']:.2f}x, p99 "
                f"{mine['ttft_p99_ms'] / solo['ttft_p99_ms']:.2f}x (goal <= 1.25x)"
            )
        batch = class_figures(cell, "batch", args)
        print(
            f"- interactive failures {mine['failed'] or 'none'}; batch requests that waited in "
            f"a queue: {cell.batch_queued}"
        )
        print(
            f"- batch 429s answered in p99 {batch['shed_p99_ms']:.1f} ms (goal < 50); the first "
            f"retry after a 429 succeeded {batch['retry_first_ok']:.0%}; of every retry sent when "
            f"a 429 said (before the cell ended), {batch['retries_ok']} of {batch['retries']} "
            "succeeded"
        )
        none = next((c for c in cells if c.load == top and c.system == "iop:none"), None)
        if none is not None:
            print(
                f"- goodput {goodput(cell, args):,.0f} tokens/s against "
                f"{goodput(none, args):,.0f} with no classes "
                f"({goodput(cell, args) / max(goodput(none, args), 1e-9):.2f}x, goal >= 1.00)"
            )


COLOURS = {
    "iop:classes": "#08306b",
    "iop:classes@12": "#6a51a3",
    "iop:classes+engine": "#e6550d",
    "iop:classes+engine@20": "#fd8d3c",
    "iop:none": "#9ecae1",
    "vllm-router:cache_aware": "#00441b",
    "vllm-router:round_robin": "#74c476",
}


def chart(cells: list[Cell], args: argparse.Namespace, path: Path) -> None:
    titles = ("interactive TTFT p50", "interactive TTFT p99", "goodput (completion tokens/s)")
    ylabel = "ms (log scale; dotted: alone, red: 1.25x alone)"
    suptitle = (
        "Priority classes on 4 simulated GPU servers: interactive "
        f"{args.interactive:g}x capacity at every load, standard and a sheddable batch job "
        "the rest (IOP solid, vLLM router dashed)"
    )
    xlabel = "offered load, x the fleet's capacity"
    with routing.load_chart(path, titles, xlabel, ylabel, suptitle, 4) as axes:
        for system in [s for s in SYSTEMS if any(c.system == s for c in cells)]:
            mine = sorted((c for c in cells if c.system == system), key=lambda c: c.load)
            loads = [c.load for c in mine]
            style = "-" if system.startswith("iop:") else "--"
            for ax, q in zip(axes[:2], ("ttft_p50_ms", "ttft_p99_ms"), strict=True):
                values = [class_figures(c, "interactive", args)[q] for c in mine]
                ax.plot(loads, values, style, marker="o", color=COLOURS[system], label=system)
            axes[2].plot(
                loads,
                [goodput(c, args) for c in mine],
                style,
                marker="o",
                color=COLOURS[system],
                label=system,
            )
        alone = next((c for c in cells if "alone" in c.system), None)
        if alone is not None:
            for ax, q in zip(axes[:2], ("ttft_p50_ms", "ttft_p99_ms"), strict=True):
                ax.axhline(
                    class_figures(alone, "interactive", args)[q], color="grey", linestyle=":"
                )
                ax.axhline(
                    1.25 * class_figures(alone, "interactive", args)[q], color="red", linestyle=":"
                )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    parser.add_argument("--seconds", type=float, default=60.0, help="arrivals per cell")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds not measured")
    parser.add_argument("--drain", type=float, default=10.0, help="seconds after the arrivals")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:3]))
    parser.add_argument("--interactive", type=float, default=0.25, help="share of capacity")
    parser.add_argument("--standard", type=float, default=0.3, help="share of the rest")
    parser.add_argument("--retries", type=int, default=5, help="a batch request's after 429s")
    parser.add_argument(
        "--turns",
        choices=("causal", "scheduled"),
        default="causal",
        help="causal: a conversation's turn is sent at its time or when the turn before it ends, "
        "whichever is later, and not at all after one that failed (its prompt holds that "
        "answer); scheduled: every turn at its time",
    )
    parser.add_argument(
        "--no-alone", dest="alone", action="store_false", help="skip interactive alone"
    )
    parser.add_argument("--max-batch", type=int, default=CAPACITY)
    parser.add_argument("--kv-tokens", type=int, default=None)
    routing.add_engine_arguments(parser)
    parser.add_argument("--chart", type=Path, help="draw the chart (PNG) here")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args(argv)
    print(
        f"{benchkit.opening('bench/priorities.py')}, vllm-router {peers.VLLM_ROUTER_VERSION}, "
        f"{args.seconds:g} s of arrivals a cell ({args.warmup:g} s warm-up, {args.drain:g} s "
        "drain)",
        flush=True,
    )
    cells, capacity = uvloop.run(run(args))
    print(benchkit.closing())
    report(cells, capacity, args)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "system": c.system,
                        "load": c.load,
                        "samples": [
                            [s.klass, s.at, s.ttft, s.end, s.ok, s.status, s.shed_answers, s.why]
                            for s in c.samples
                        ],
                    }
                    for c in cells
                ]
            )
        )
    if args.chart is not None:
        chart(cells, args, args.chart)


if __name__ == "__main__":
    main()
