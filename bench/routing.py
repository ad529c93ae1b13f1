"""Benchmark: dispatch policies on a simulated GPU fleet, IOP against the vLLM router.

    uv run --frozen python -m bench.routing [--loads 0.5 0.8 0.95] [--seconds 90]
        [--systems iop:round_robin ... vllm-router:cache_aware] [--chart docs/routing-ttft.png]
        [--workload chat|long]

The fleet: `iop fake-upstream --gpu` processes, simulated GPU servers (`iop.fakes.
simulating`: a KV/prefix cache of `--kv-tokens` with LRU eviction by blocks, prefill of the
prompt tokens not in the cache, decoding that slows as the batch grows, a batch of at most
`--max-batch` and a waiting queue), each with its own seed: four of 96,000 tokens of KV cache
(`--workload chat`, the default), or eight of 32,000 (`--workload long`, `SHAPES`).

The workload (one seed per load, the same for every system): conversations open as a Poisson
process; each picks one of the workload's shared system prompts (8; `long`: 16) and has 3 to 8
turns (`long`: 6 to 16), a user message of 50 to 200 tokens each, answers of 16 to 48 tokens,
and a think time (exponential, mean `THINK_S`) between one turn's send and the next. Every turn
is sent at its scheduled time whether or not the turn before it has ended (open loop): a fleet
that falls behind gets no respite. A turn's prompt is the conversation so far (the fake's
answers are deterministic, so the client knows them ahead). The rate of requests climbs to its
mark within the length of a conversation (about 25 s; `long`: about 45 s): the first
`--warmup` seconds, which also warm the caches, are not measured.

The fleet's capacity (what 100% load means): the requests per second the servers complete
in the engines' own time (no network, no clock), saturated (`SATURATION` conversations a server
taking their turns back to back) with every turn sent to the next server in turn: what the fleet
serves under round-robin, the specification's rule, which finds a conversation's earlier turns
in a server's cache only by chance. The same measure with each conversation kept on one server
is printed beside it: what the same fleet serves when routing keeps the caches warm.

Systems, all in front of the same servers, each cell after a reset of the servers
(`POST /fake/reset`: empty caches, counts from zero), load by load and every system in turn
within a load (the machine's other work drifts; this spreads it over the systems alike):
- `iop:<policy>`: `iop edge run` and one `iop node run` with an `openai` provider a server,
  capacity `--capacity` each (24: a server's batch of 16 and a short queue of its own; IOP never
  sends a server more), the policy and capacity applied live through the admin API before each
  cell (through `round_robin`, so `prefix_affinity` starts each cell with no memory; `rollout`
  off, so the policy serves the whole cell rather than a canary's share of its start);
  `iop:<policy>@N`: the same with capacity N (`@16`: the batch, so every request past it waits
  at the Edge and takes the first slot that frees, wherever its cache is);
- `vllm-router:<policy>`: the vLLM project's router (Rust; PyPI `vllm-router`, pinned, its own
  virtual environment, as `bench.peers` installs it) with `round_robin`, `power_of_two` or
  `cache_aware` (its defaults), started afresh for each cell.

Measured per cell: TTFT (request to the first byte of the stream, which carries the first token)
and end-to-end latency, p50 and p99; throughput; the servers' prefix-cache hit rate (their
`vllm:prefix_cache_hits_total` over `..._queries_total`); the spread of requests over the
servers; each server's peak of requests at once (running and waiting). It prints a markdown
table per load, the ratios of IOP's best policy to the router's best, and draws a chart
(`--chart`). The machine's other work shares the cores, so cells of one run are compared with
each other, never with another run's.

`bench.lora` and `bench.priorities` run on this fleet with this module's parts: the servers
(`spawn_gpu_servers`), the Edge (`gpu_providers`, `iop_stack`, `apply_config`), the router
(`vllm_router`), a cell's open loop (`cell_session`, `replay`) and the charts (`load_chart`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop

from bench import benchkit, peers
from bench.benchkit import nearest_rank
from iop.fakes import tokens
from iop.fakes.simulating import GpuEngine, GpuSettings, render_answer, render_chat
from iop.processes import UpstreamProcess, spawn_fake_upstream
from testkit import CLIENT_TOKEN, edge_document, provider

MODEL = "bench"
SERVED = "served"
THINK_S = 4.0
SATURATION = 32
SYSTEMS = (
    "iop:round_robin",
    "iop:least_load",
    "iop:prefix_affinity",
    "iop:prefix_affinity@16",
    "vllm-router:round_robin",
    "vllm-router:power_of_two",
    "vllm-router:cache_aware",
)
WORDS = (
    "apollo lunar module orbit guidance computer descent engine telemetry capsule booster "
    "stage crew mission control trajectory burn docking hatch suit heat shield splashdown"
).split()


# -- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A fleet and its conversations: what `--workload` names."""

    name: str
    servers: int
    kv_tokens: int
    system_prompts: int
    #: Turns of a conversation, at least and at most.
    turns: tuple[int, int]

    @property
    def mean_turns(self) -> float:
        return sum(self.turns) / 2


#: `chat`: four servers with room for every live conversation; `long`: twice the servers, a
#: third of the cache each and conversations twice as long, so a server keeps only some of its
#: conversations and a moved one pays more.
SHAPES = {
    "chat": Shape("chat", servers=4, kv_tokens=96_000, system_prompts=8, turns=(3, 8)),
    "long": Shape("long", servers=8, kv_tokens=32_000, system_prompts=16, turns=(6, 16)),
}


@dataclass(frozen=True)
class Turn:
    at: float
    conversation: int
    index: int
    #: The request body (the conversation so far), ready to send.
    messages: tuple[dict[str, str], ...]
    max_tokens: int


def text_of(rng: random.Random, tokens_wanted: int) -> str:
    """About `tokens_wanted` tokens (4 bytes each) of words."""
    words: list[str] = []
    size = 0
    while size < tokens_wanted * 4:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def system_prompts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"System prompt {i}. You are assistant {i} of the archive. "
        + text_of(rng, rng.randint(500, 1500))
        for i in range(count)
    ]


def workload(seed: int, rate: float, seconds: float, shape: Shape = SHAPES["chat"]) -> list[Turn]:
    """Every turn sent in [0, seconds] at an average of `rate` requests a second (see above)."""
    rng = random.Random(seed)
    systems = system_prompts(seed, shape.system_prompts)
    mean_turns = shape.mean_turns
    opening = 0.0
    turns: list[Turn] = []
    conversation = 0
    while True:
        opening += rng.expovariate(rate / mean_turns)
        if opening > seconds:
            break
        conversation += 1
        messages: list[dict[str, str]] = [{"role": "system", "content": rng.choice(systems)}]
        at = opening
        for index in range(rng.randint(*shape.turns)):
            messages.append(
                {
                    "role": "user",
                    "content": f"Question {index}: " + text_of(rng, rng.randint(50, 200)),
                }
            )
            max_tokens = rng.randint(16, 48)
            if at <= seconds:
                turns.append(Turn(at, conversation, index, tuple(messages), max_tokens))
            messages.append({"role": "assistant", "content": "".join(tokens(max_tokens))})
            at += max(0.5, rng.expovariate(1 / THINK_S))
    return sorted(turns, key=lambda t: t.at)


def gpu_settings(args: argparse.Namespace, seed: int = 0) -> GpuSettings:
    return GpuSettings(
        kv_tokens=args.kv_tokens or SHAPES[args.workload].kv_tokens,
        max_batch=args.max_batch,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        step_ms=args.step_ms,
        step_ms_per_seq=args.step_ms_per_seq,
        jitter=0.05,
        seed=seed,
    )


def fleet_capacity(args: argparse.Namespace, placement: str = "round_robin") -> float:
    """Requests a second the fleet completes in engine time, saturated: `SATURATION`
    conversations a server take their turns back to back (no think time), each turn sent to the
    next server in turn (`round_robin`) or to its conversation's server (`affinity`)."""
    shape = SHAPES[args.workload]
    servers = shape.servers
    engines = [GpuEngine(gpu_settings(args, seed=i + 1)) for i in range(servers)]
    conversations: dict[int, list[Turn]] = {}
    for turn in workload(12345, 10.0 * servers, 900.0, shape):
        conversations.setdefault(turn.conversation, []).append(turn)
    fresh = iter([turns for turns in conversations.values() if turns[0].index == 0])
    active: dict[tuple[int, int], tuple[list[Turn], int, int]] = {}
    busy = [False] * servers
    clock: list[tuple[float, int, int, Any]] = []  # (step end, order, server, step)
    order = itertools.count()
    turn_of = itertools.count()

    def submit(turns: list[Turn], position: int, home: int, now: float) -> None:
        server = next(turn_of) % servers if placement == "round_robin" else home
        turn = turns[position]
        answer = render_answer("".join(tokens(turn.max_tokens)))
        request = engines[server].submit(render_chat(turn.messages), turn.max_tokens, answer)
        active[(server, request.id)] = (turns, position, home)
        if not busy[server]:
            begin(server, now)

    def begin(server: int, now: float) -> None:
        step = engines[server].step()
        busy[server] = step is not None
        if step is not None:
            heapq.heappush(clock, (now + step.duration_s, next(order), server, step))

    for index in range(SATURATION * servers):
        submit(next(fresh), 0, index % servers, 0.0)
    done = 0
    now = 0.0
    while done < 3000 * servers:
        now, _, server, step = heapq.heappop(clock)
        for request in step.finished:
            done += 1
            turns, position, home = active.pop((server, request.id))
            if position + 1 < len(turns):
                submit(turns, position + 1, home, now)
            else:
                submit(next(fresh), 0, home, now)
        begin(server, now)
    return done / now


# -- the fleet and the systems -----------------------------------------------------------------


@dataclass
class Target:
    """Where a system listens, and how it is told its policy."""

    url: str
    token: str | None
    model: str
    admin_url: str | None = None


def gpu_providers(servers: list[UpstreamProcess], capacity: int) -> list[dict[str, Any]]:
    """An `openai` provider a server, `gpu-1` on: `capacity` requests at once, a long queue and
    a long wait before the Edge gives up on one, probed every second."""
    return [
        provider(
            f"gpu-{i}",
            {"type": "openai", "base_url": server.base_url},
            served=SERVED,
            capacity=capacity,
            max_queue=4096,
            queue_timeout_ms=600_000,
            health={"interval_ms": 1000},
        )
        for i, server in enumerate(servers, start=1)
    ]


def iop_config(servers: list[UpstreamProcess], capacity: int, **options: Any) -> dict[str, Any]:
    providers = gpu_providers(servers, capacity)
    document = edge_document(
        {"node-1": providers}, {MODEL: [p["id"] for p in providers]}, admin=True, **options
    )
    # A policy applied before a cell serves every request of it at once: with the default
    # rollout, a canary, the cell's first half minute would run partly on the policy before.
    document["rollout"] = {"mode": "off"}
    return document


@contextlib.asynccontextmanager
async def iop_stack(
    servers: list[UpstreamProcess],
    capacity: int,
    folder: Path,
    document: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Target, dict[str, Any]]]:
    """An Edge and one Node over `servers`, on `document` (default: `iop_config`'s)."""
    if document is None:
        document = iop_config(servers, capacity)
    benchkit.write_stack(folder, document)
    ids = json.dumps([f"gpu-{i}" for i in range(1, len(servers) + 1)]).replace(" ", "")
    wanted = f'"providers_available":{ids}'.encode()
    async with benchkit.start_stack(folder, wanted, timeout=120) as (started, _):
        target = Target(str(started["url"]), CLIENT_TOKEN, MODEL, str(started["admin_url"]))
        yield target, document


async def apply_config(
    target: Target, document: dict[str, Any], what: str, *, unchanged: bool = True
) -> None:
    """Apply `document` live through the Edge's admin API (`POST /refresh`); `what` names it in
    the error raised when the Edge did not apply it (nor, with `unchanged`, found it the same)."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{target.admin_url}/refresh", json={"mode": "apply", "config": document}
        ) as response,
    ):
        report = await response.json()
    if report.get("outcome") not in (("applied", "unchanged") if unchanged else ("applied",)):
        raise RuntimeError(f"{what} was not applied: {report}")


async def apply_policy(
    target: Target, document: dict[str, Any], policy: str, factor: float, capacity: int
) -> None:
    """Apply `policy` (and the providers' `capacity`) live through the admin API."""
    document["models"][0]["dispatch"] = {"policy": policy, "load_factor": factor}
    for entry in document["nodes"][0]["providers"]:
        entry["capacity"] = capacity
    await apply_config(target, document, f"the policy {policy}", unchanged=False)


@contextlib.asynccontextmanager
async def vllm_router(
    command: Path, servers: list[UpstreamProcess], policy: str, folder: Path
) -> AsyncIterator[Target]:
    """`bench.peers`'s router, in front of the servers, with `policy`."""
    workers = [f"http://{server.listen}" for server in servers]
    async with peers.vllm_router(
        command, servers[0].listen, folder, workers=workers, policy=policy
    ) as started:
        yield Target(started.url, None, SERVED)


# -- one cell -----------------------------------------------------------------------------------


@dataclass
class Sample:
    at: float
    ttft: float
    e2e: float
    ok: bool
    #: What went wrong, when it did.
    why: str = ""


@dataclass
class Cell:
    system: str
    load: float
    rate: float
    samples: list[Sample] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    served: list[int] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    span: float = 0.0

    def measured(self, warmup: float) -> list[Sample]:
        return [s for s in self.samples if s.at >= warmup]

    def errors(self, warmup: float) -> int:
        return sum(1 for s in self.measured(warmup) if not s.ok)


async def reset_servers(session: aiohttp.ClientSession, servers: list[UpstreamProcess]) -> None:
    for server in servers:
        for _ in range(600):
            async with session.post(f"http://{server.listen}/fake/reset") as response:
                if response.status == 200:
                    break
            await asyncio.sleep(0.1)  # requests of the previous cell still finishing
        else:
            raise RuntimeError(f"{server.listen} would not go idle")


async def server_metrics(
    session: aiohttp.ClientSession, server: UpstreamProcess
) -> dict[str, float]:
    """One server's `vllm:*` metrics by name (labels dropped, a name's series summed)."""
    async with session.get(f"http://{server.listen}/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


async def server_counts(
    session: aiohttp.ClientSession, server: UpstreamProcess
) -> tuple[float, float, int, int]:
    """(prefix hits, prefix queries, requests completed, peak at once) of one server."""
    values = await server_metrics(session, server)
    async with session.get(f"http://{server.listen}/fake/stats") as response:
        stats = await response.json()
    return (
        values.get("vllm:prefix_cache_hits_total", 0.0),
        values.get("vllm:prefix_cache_queries_total", 0.0),
        int(stats["completed"]),
        int(stats["peak_in_flight"]),
    )


@contextlib.asynccontextmanager
async def cell_session(
    target: Target, servers: list[UpstreamProcess], total: float = 600
) -> AsyncIterator[aiohttp.ClientSession]:
    """A cell's client session, sending JSON with the target's token, after a reset of the
    servers; `total` seconds at most a request."""
    headers = {"content-type": "application/json"}
    if target.token:
        headers["authorization"] = f"Bearer {target.token}"
    # Idle connections closed before the servers close them (uvicorn: 5 s): a POST on a
    # connection the server is closing fails, and nothing retries it.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(
        connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=total)
    ) as session:
        await reset_servers(session, servers)
        yield session


async def replay(
    session: aiohttp.ClientSession, url: str, arrivals: Sequence[tuple[float, bytes]]
) -> tuple[list[tuple[int, benchkit.Timed]], float]:
    """Send each (at, body) streaming request `at` seconds after the start (half a second from
    now), whether or not those before it have ended (open loop): each one's index and
    `benchkit.timed_stream` figures in the order they ended, and the seconds it all took."""
    loop = asyncio.get_running_loop()
    began = loop.time() + 0.5
    ended: list[tuple[int, benchkit.Timed]] = []

    async def send(index: int, at: float, body: bytes) -> None:
        await asyncio.sleep(max(0.0, began + at - loop.time()))
        ended.append((index, await benchkit.timed_stream(session, url, body)))

    started = time.perf_counter()
    await asyncio.gather(*(send(index, *arrival) for index, arrival in enumerate(arrivals)))
    return ended, time.perf_counter() - started


async def run_cell(
    target: Target,
    servers: list[UpstreamProcess],
    turns: list[Turn],
    cell: Cell,
) -> None:
    url = f"{target.url}/v1/chat/completions"
    async with cell_session(target, servers) as session:
        bodies = [
            (
                turn.at,
                orjson.dumps(
                    {
                        "model": target.model,
                        "messages": list(turn.messages),
                        "max_tokens": turn.max_tokens,
                        "stream": True,
                    }
                ),
            )
            for turn in turns
        ]
        ended, cell.span = await replay(session, url, bodies)
        cell.samples += [Sample(turns[index].at, *timed) for index, timed in ended]
        for server in servers:
            hits, queries, served, peak = await server_counts(session, server)
            cell.hits += hits
            cell.queries += queries
            cell.served.append(served)
            cell.peaks.append(peak)


# -- the run ---------------------------------------------------------------------------------------


async def spawn_gpu_servers(
    stack: contextlib.AsyncExitStack, args: argparse.Namespace, count: int, extra: Sequence[str]
) -> list[UpstreamProcess]:
    """`count` simulated GPU servers (`iop fake-upstream --gpu`, seeds 1 on) with the engine
    `args` sets (`--max-batch`, `--prefill-tokens-per-s`, `--step-ms`, `--step-ms-per-seq`) and
    the flags `extra`, stopped by `stack`."""
    servers = []
    for i in range(count):
        flags = [
            *("--gpu", "--gpu-max-batch", str(args.max_batch), "--gpu-step-ms", str(args.step_ms)),
            *("--gpu-step-ms-per-seq", str(args.step_ms_per_seq), "--gpu-jitter", "0.05"),
            *("--gpu-prefill-tokens-per-s", str(args.prefill_tokens_per_s), *extra),
            # Answers as long as max_tokens asks (at most 48): the next turn repeats them.
            *("--model", SERVED, "--completion-tokens", "64", "--seed", str(i + 1)),
        ]
        servers.append(
            await stack.enter_async_context(spawn_fake_upstream(flags, startup_timeout=120))
        )
    return servers


async def spawn_servers(
    stack: contextlib.AsyncExitStack, args: argparse.Namespace, *extra: str
) -> list[UpstreamProcess]:
    """The workload's simulated GPU servers with the flags `extra`, stopped by `stack`."""
    flags = ["--gpu-kv-tokens", str(gpu_settings(args).kv_tokens), *extra]
    return await spawn_gpu_servers(stack, args, SHAPES[args.workload].servers, flags)


async def run(args: argparse.Namespace) -> tuple[list[Cell], float]:
    benchkit.cancel_on_sigterm()
    capacity = fleet_capacity(args, "round_robin")
    best = fleet_capacity(args, "affinity")
    print(
        f"# fleet capacity (engine time, saturated): {capacity:.1f} requests/s with turns placed "
        f"round-robin (100% load); {best:.1f} with each conversation on one server",
        flush=True,
    )
    routers = [s for s in args.systems if s.startswith("vllm-router:")]
    router = peers.ensure_vllm_router(args.cache) if routers else None
    cells: list[Cell] = []
    async with contextlib.AsyncExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        servers = await spawn_servers(stack, args)
        shape = SHAPES[args.workload]
        workloads = {
            load: workload(1000 + round(load * 100), load * capacity, args.seconds, shape)
            for load in args.loads
        }
        iop: tuple[Target, dict[str, Any]] | None = None
        if any(s.startswith("iop:") for s in args.systems):
            iop = await stack.enter_async_context(iop_stack(servers, args.capacity, folder))
        # Load by load, every system in turn: the machine's other work drifts over a run, and
        # this spreads it over the systems alike.
        for load in args.loads:
            for system in args.systems:
                kind, _, setting = system.partition(":")
                if kind == "iop":
                    assert iop is not None
                    target, document = iop
                    policy, _, size = setting.partition("@")
                    capacity_now = int(size) if size else args.capacity
                    # Through round_robin first: a policy change forgets prefix homes.
                    await apply_policy(target, document, "round_robin", 1.0, capacity_now)
                    await apply_policy(target, document, policy, args.load_factor, capacity_now)
                    cells.append(await measure(target, servers, system, load, capacity, workloads))
                else:
                    assert router is not None
                    async with vllm_router(router, servers, setting, folder) as target:
                        cell = await measure(target, servers, system, load, capacity, workloads)
                    cells.append(cell)
    return cells, capacity


async def measure(
    target: Target,
    servers: list[UpstreamProcess],
    system: str,
    load: float,
    capacity: float,
    workloads: dict[float, list[Turn]],
) -> Cell:
    turns = workloads[load]
    cell = Cell(system, load, load * capacity)
    await run_cell(target, servers, turns, cell)
    measured = cell.measured(ARGS.warmup)
    print(
        f"  {system} at {load:.0%} ({cell.rate:.1f} req/s, {len(turns)} requests): "
        f"TTFT p50 {nearest_rank([s.ttft for s in measured], 50) * 1000:.0f} ms, "
        f"p99 {nearest_rank([s.ttft for s in measured], 99) * 1000:.0f} ms, "
        f"hit rate {cell.hits / max(cell.queries, 1):.0%}, {cell.errors(ARGS.warmup)} errors",
        file=sys.stderr,
        flush=True,
    )
    print_failures(cell.samples)
    return cell


def print_failures(samples: list[Sample]) -> None:
    """A cell's first three failed requests, on stderr: when each was sent and why it failed."""
    for sample in [s for s in samples if not s.ok][:3]:
        print(f"    failed at {sample.at:.1f} s: {sample.why}", file=sys.stderr, flush=True)


ARGS = argparse.Namespace()


def report(cells: list[Cell], capacity: float, args: argparse.Namespace) -> None:
    for load in args.loads:
        row = [c for c in cells if c.load == load]
        if not row:
            continue
        print(f"\n### {load:.0%} of capacity ({load * capacity:.1f} requests/s offered)\n")
        print(
            "| system | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | req/s served "
            "| prefix-cache hits | requests per server | peak at a server | errors |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
        for cell in row:
            measured = cell.measured(args.warmup)
            firsts = [s.ttft * 1000 for s in measured if s.ok]
            e2e = [s.e2e * 1000 for s in measured if s.ok]
            served = sum(1 for s in cell.samples if s.ok) / cell.span if cell.span else 0.0
            print(
                f"| {cell.system} | {nearest_rank(firsts, 50):,.0f} | "
                f"{nearest_rank(firsts, 99):,.0f} | "
                f"{nearest_rank(e2e, 50):,.0f} | {nearest_rank(e2e, 99):,.0f} | {served:.1f} | "
                f"{cell.hits / max(cell.queries, 1):.0%} | "
                f"{'/'.join(str(n) for n in cell.served)} | {max(cell.peaks)} | "
                f"{cell.errors(args.warmup)} |"
            )
    print("\nIOP's best policy against the router's best (lower is better; < 1.00: IOP ahead):\n")
    print(
        "| load | IOP best p50 / p99 ms | router best p50 / p99 ms | TTFT p50 ratio | p99 ratio |"
    )
    print("|---|---|---|---:|---:|")
    for load in args.loads:
        iop = [c for c in cells if c.load == load and c.system.startswith("iop:")]
        peer = [c for c in cells if c.load == load and c.system.startswith("vllm-router:")]
        if not iop or not peer:
            continue
        i50, i99 = best(iop, 50, args.warmup), best(iop, 99, args.warmup)
        r50, r99 = best(peer, 50, args.warmup), best(peer, 99, args.warmup)
        mine = f"{ttft(i50, 50, args.warmup):,.0f} ({i50.system}) / "
        mine += f"{ttft(i99, 99, args.warmup):,.0f} ({i99.system})"
        theirs = f"{ttft(r50, 50, args.warmup):,.0f} ({r50.system}) / "
        theirs += f"{ttft(r99, 99, args.warmup):,.0f} ({r99.system})"
        ratio50 = ttft(i50, 50, args.warmup) / ttft(r50, 50, args.warmup)
        ratio99 = ttft(i99, 99, args.warmup) / ttft(r99, 99, args.warmup)
        print(f"| {load:.0%} | {mine} | {theirs} | {ratio50:.2f} | {ratio99:.2f} |")


def ttft(cell: Cell, q: float, warmup: float) -> float:
    """The cell's TTFT percentile `q` over its measured, successful requests, in ms."""
    return nearest_rank([s.ttft for s in cell.measured(warmup) if s.ok], q) * 1000


def best(group: list[Cell], q: float, warmup: float) -> Cell:
    return min(group, key=lambda cell: ttft(cell, q, warmup))


COLOURS = {
    "iop:round_robin": "#9ecae1",
    "iop:least_load": "#4292c6",
    "iop:prefix_affinity": "#08306b",
    "iop:prefix_affinity@16": "#6a51a3",
    "vllm-router:round_robin": "#c7e9c0",
    "vllm-router:power_of_two": "#74c476",
    "vllm-router:cache_aware": "#00441b",
}


@contextlib.contextmanager
def load_chart(
    path: Path,
    titles: Sequence[str],
    xlabel: str,
    ylabel: str,
    suptitle: str,
    legend_columns: int,
) -> Iterator[Any]:
    """Three charts side by side over the offered load, for the block to draw (TTFT p50 and p99
    on log scales, then a third), titled, their legend below, saved to `path` as a PNG."""
    with benchkit.figure(path, 1, 3, (14, 4.2)) as (figure, axes):
        yield axes
        for ax, title in zip(axes, titles, strict=True):
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(ylabel)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        handles, labels = axes[0].get_legend_handles_labels()
        figure.legend(handles, labels, loc="lower center", ncol=legend_columns, fontsize=8)
        figure.suptitle(suptitle)
        figure.tight_layout(rect=(0, 0.08, 1, 1))


def chart(cells: list[Cell], args: argparse.Namespace, path: Path) -> None:
    systems = [s for s in SYSTEMS if any(c.system == s for c in cells)]
    titles = ("TTFT p50", "TTFT p99", "prefix-cache hit rate")
    suptitle = (
        f"{SHAPES[args.workload].servers} simulated GPU servers ({args.workload}), multi-turn "
        "conversations with shared system prompts (IOP solid, vLLM router dashed)"
    )
    xlabel = "offered load, % of the fleet's capacity"
    with load_chart(path, titles, xlabel, "ms (log scale)", suptitle, len(systems)) as axes:
        for system in systems:
            mine = sorted((c for c in cells if c.system == system), key=lambda c: c.load)
            loads = [c.load * 100 for c in mine]
            style = "-" if system.startswith("iop:") else "--"
            for ax, q in zip(axes[:2], (50, 99), strict=True):
                values = [
                    nearest_rank([s.ttft for s in c.measured(args.warmup) if s.ok], q) * 1000
                    for c in mine
                ]
                ax.plot(loads, values, style, marker="o", color=COLOURS[system], label=system)
            hit = [c.hits / max(c.queries, 1) * 100 for c in mine]
            axes[2].plot(loads, hit, style, marker="o", color=COLOURS[system], label=system)
        axes[2].set_ylabel("% of prompt tokens")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated servers' engine (`spawn_gpu_servers` reads them, with `--max-batch`) and
    where the vLLM router is installed."""
    parser.add_argument("--prefill-tokens-per-s", type=float, default=4000.0)
    parser.add_argument("--step-ms", type=float, default=40.0)
    parser.add_argument("--step-ms-per-seq", type=float, default=2.0)
    parser.add_argument(
        "--cache", type=Path, default=benchkit.default_cache("peers"), help="the router's venv"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.8, 0.95])
    parser.add_argument("--seconds", type=float, default=120.0, help="arrivals per cell")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds not measured")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--load-factor", type=float, default=1.25, help="prefix_affinity's bound")
    parser.add_argument(
        "--capacity", type=int, default=24, help="IOP providers' capacity (`iop:<policy>@N`: N)"
    )
    parser.add_argument(
        "--workload",
        choices=sorted(SHAPES),
        default="chat",
        help="chat: 4 servers, KV 96,000 tokens, 3-8 turns, 8 system prompts; long: 8 servers, "
        "KV 32,000 tokens, 6-16 turns, 16 system prompts",
    )
    parser.add_argument(
        "--kv-tokens", type=int, help="each server's KV cache (default: the workload's)"
    )
    parser.add_argument("--max-batch", type=int, default=16)
    add_engine_arguments(parser)
    parser.add_argument("--chart", type=Path, help="draw the TTFT and hit-rate chart (PNG) here")
    parser.add_argument("--json", type=Path, help="write every cell's figures here")
    args = parser.parse_args()
    ARGS.__dict__.update(vars(args))
    print(
        f"{benchkit.opening('bench/routing.py')}, vllm-router {peers.VLLM_ROUTER_VERSION}, "
        f"{args.seconds:g} s of arrivals a cell ({args.warmup:g} s warm-up)",
        flush=True,
    )
    print(
        f"# workload {args.workload}, servers: {SHAPES[args.workload].servers} x (KV "
        f"{gpu_settings(args).kv_tokens} tokens, batch {args.max_batch}, prefill "
        f"{args.prefill_tokens_per_s:g} tokens/s, step {args.step_ms:g} ms + "
        f"{args.step_ms_per_seq:g} ms a request); prefix_affinity load_factor {args.load_factor}",
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
                        "rate": c.rate,
                        "samples": [[s.at, s.ttft, s.e2e, s.ok, s.why] for s in c.samples],
                        "hits": c.hits,
                        "queries": c.queries,
                        "served": c.served,
                        "peaks": c.peaks,
                        "span": c.span,
                    }
                    for c in cells
                ]
            )
        )
    if args.chart is not None:
        chart(cells, args, args.chart)


if __name__ == "__main__":
    main()
