"""Benchmark: LoRA adapters routed to where they are loaded, against round-robin and the vLLM
router, on a simulated GPU fleet.

    uv run --frozen python -m bench.lora [--rates 8 16] [--seconds 30] [--warmup 5]
        [--systems iop:adapters iop:base iop:round_robin vllm-router:round_robin ...]

The fleet: four `iop fake-upstream --gpu` servers (`iop.fakes.simulating`), each serving one base
model and `--adapters` LoRA adapters (8) with `--max-loras` adapter slots (2): a request whose
adapter is in a slot runs at once; one whose adapter is not takes a free slot or evicts an idle
adapter (a load of `--load-ms`, which stalls the whole step); one whose adapter finds every slot
held by other adapters' running requests waits at the server for a swap. Eight adapters fit the
fleet's sixteen slots exactly, so the best placement swaps none after the first loads.

The workload (one seed per rate, the same for every system): requests arrive as a Poisson
process at `--rates` requests a second, each for an adapter drawn uniformly from the eight, a
prompt of 100 to 300 tokens of its own (no prefix is shared: the prefix cache plays no part) and
an answer of 16 to 48 tokens, streamed.

Systems, in front of the same servers, each cell after a reset of the servers:
- `iop:adapters`: `iop edge run` and one `iop node run`, the model's `adapters` naming the eight
  (docs/edge.md, "LoRA adapters"): loaded, then room, then swap, round-robin among equals; the
  Nodes read `vllm:lora_requests_info` after each probe (every second);
- `iop:round_robin`: the same Edge with each adapter a model of its own on the four servers, the
  specification's round-robin: what the Edge did before it knew adapters;
- `iop:base`: the same requests for the base model, round-robin: what the fleet gives the load
  with no adapter to hold (the floor for the others, not a way to serve adapters);
- `vllm-router:<policy>`: the vLLM project's router (`bench.peers` installs it, pinned), which
  knows no adapters: `round_robin`, and `cache_aware` (its prompt-prefix tree; the prompts share
  nothing, so it balances by load).

Per cell: TTFT p50/p99 and end-to-end p50 of the requests that arrived after `--warmup`, the
adapters loaded and swapped in (an eviction of another adapter) over the whole cell, summed over
the servers, requests served per server, errors. The machine's other work shares the cores, so
compare cells of one run with each other.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop

from bench import benchkit, peers, routing
from bench.benchkit import nearest_rank
from bench.routing import Sample, Target
from iop.processes import UpstreamProcess
from testkit import edge_document

SYSTEMS = (
    "iop:adapters",
    "iop:base",
    "iop:round_robin",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
)
MODEL = "base"
SERVED = "served"
SERVERS = 4
WORDS = (
    "ledger invoice audit clause tenant lease statute appeal dosage symptom referral triage "
    "query index schema join cursor commit kernel driver mutex socket"
).split()


@dataclass(frozen=True)
class Request:
    at: float
    adapter: str
    prompt: str
    max_tokens: int


def workload(seed: int, rate: float, seconds: float, adapters: list[str]) -> list[Request]:
    rng = random.Random(seed)
    requests: list[Request] = []
    at = rng.expovariate(rate)
    while at < seconds:
        words = rng.randint(100, 300) * 4 // 6  # ~6 bytes a word, 4 bytes a token
        prompt = f"[{len(requests)}] " + " ".join(rng.choice(WORDS) for _ in range(words))
        requests.append(Request(at, rng.choice(adapters), prompt, rng.randint(16, 48)))
        at += rng.expovariate(rate)
    return requests


@dataclass
class Cell:
    system: str
    rate: float
    samples: list[Sample] = field(default_factory=list)
    loads: int = 0
    swaps: int = 0
    #: IOP's choices for the adapters' requests in the cell, by reason (`adapter_loaded`, ...).
    choices: dict[str, int] = field(default_factory=dict)
    served: list[int] = field(default_factory=list)
    span: float = 0.0

    def measured(self, warmup: float) -> list[Sample]:
        return [s for s in self.samples if s.at >= warmup and s.ok]

    def errors(self) -> int:
        return sum(1 for s in self.samples if not s.ok)


# -- the fleet and the systems -----------------------------------------------------------------


def iop_document(
    servers: list[UpstreamProcess], adapters: list[str], capacity: int, aware: bool
) -> dict[str, Any]:
    """The Edge's config: the adapters named by the base model (`aware`), or each a model of
    its own on every server (round-robin, as before adapters were known)."""
    providers = routing.gpu_providers(servers, capacity)
    for entry in providers:
        entry["served_models"] = [SERVED, *adapters]
    ids = [p["id"] for p in providers]
    if aware:
        models = {MODEL: ids}
        settings: dict[str, dict[str, Any]] = {MODEL: {"adapters": adapters}}
    else:
        models = {MODEL: ids, **{adapter: ids for adapter in adapters}}
        settings = {}
    document = edge_document({"node-1": providers}, models, model_settings=settings, admin=True)
    if not aware:
        for entry in document["models"]:
            if entry["id"] != MODEL:
                entry["providers"] = {pid: entry["id"] for pid in ids}
    document["rollout"] = {"mode": "off"}
    return document


async def choices(target: Target) -> dict[str, int]:
    """The Edge's dispatch choices so far for every model, by reason (from `GET /status`)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{target.admin_url}/status") as response:
            status = await response.json()
    counts: dict[str, int] = {}
    for model in status["dispatch"].values():
        for key, count in model["choices"].items():
            reason = key.partition("/")[2]
            counts[reason] = counts.get(reason, 0) + count
    return counts


# -- one cell -----------------------------------------------------------------------------------


async def server_counts(
    session: aiohttp.ClientSession, server: UpstreamProcess
) -> tuple[int, int, int]:
    """(adapters loaded, of them swapped in, requests completed) of one server."""
    async with session.get(f"http://{server.listen}/fake/stats") as response:
        stats = await response.json()
    loads, swaps = stats.get("adapter_loads", 0), stats.get("adapter_swaps", 0)
    return int(loads), int(swaps), int(stats["completed"])


async def run_cell(
    target: Target,
    servers: list[UpstreamProcess],
    requests: list[Request],
    cell: Cell,
    model: str | None = None,
) -> None:
    url = f"{target.url}/v1/completions"
    async with routing.cell_session(target, servers) as session:
        bodies = [
            (
                request.at,
                orjson.dumps(
                    {
                        "model": model or request.adapter,
                        "prompt": request.prompt,
                        "max_tokens": request.max_tokens,
                        "stream": True,
                    }
                ),
            )
            for request in requests
        ]
        ended, cell.span = await routing.replay(session, url, bodies)
        cell.samples += [Sample(requests[index].at, *timed) for index, timed in ended]
        for server in servers:
            loads, swaps, served = await server_counts(session, server)
            cell.loads += loads
            cell.swaps += swaps
            cell.served.append(served)


# -- the run ---------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[Cell]:
    benchkit.cancel_on_sigterm()
    adapters = [f"lora-{i}" for i in range(1, args.adapters + 1)]
    routers = [s for s in args.systems if s.startswith("vllm-router:")]
    router = peers.ensure_vllm_router(args.cache) if routers else None
    cells: list[Cell] = []
    async with contextlib.AsyncExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        lora_flags = [
            *("--gpu-lora-adapters", ",".join(adapters), "--gpu-max-loras", str(args.max_loras)),
            *("--gpu-lora-load-ms", str(args.load_ms)),
        ]
        servers = await routing.spawn_gpu_servers(stack, args, SERVERS, lora_flags)
        documents = {
            aware: iop_document(servers, adapters, args.capacity, aware) for aware in (True, False)
        }
        iop: Target | None = None
        if any(s.startswith("iop:") for s in args.systems):
            iop, _ = await stack.enter_async_context(
                routing.iop_stack(servers, args.capacity, folder, documents[True])
            )
        for rate in args.rates:
            requests = workload(1000 + round(rate * 10), rate, args.seconds, adapters)
            for system in args.systems:
                kind, _, setting = system.partition(":")
                cell = Cell(system, rate)
                if kind == "iop":
                    assert iop is not None
                    await routing.apply_config(
                        iop, documents[setting != "round_robin"], "the config"
                    )
                    before = await choices(iop)
                    await run_cell(
                        iop, servers, requests, cell, MODEL if setting == "base" else None
                    )
                    after = await choices(iop)
                    cell.choices = {
                        reason: after[reason] - before.get(reason, 0)
                        for reason in after
                        if after[reason] > before.get(reason, 0)
                    }
                else:
                    assert router is not None
                    async with routing.vllm_router(router, servers, setting, folder) as target:
                        await run_cell(target, servers, requests, cell)
                cells.append(cell)
                measured = cell.measured(args.warmup)
                print(
                    f"  {system} at {rate:g} req/s ({len(requests)} requests): TTFT p50 "
                    f"{nearest_rank([s.ttft for s in measured], 50) * 1000:.0f} ms, p99 "
                    f"{nearest_rank([s.ttft for s in measured], 99) * 1000:.0f} ms, "
                    f"{cell.swaps} swaps, "
                    f"{cell.errors()} errors; {cell.choices or ''}",
                    file=sys.stderr,
                    flush=True,
                )
                routing.print_failures(cell.samples)
    return cells


def report(cells: list[Cell], args: argparse.Namespace) -> None:
    for rate in args.rates:
        row = [c for c in cells if c.rate == rate]
        if not row:
            continue
        print(f"\n### {rate:g} requests/s offered\n")
        print(
            "| system | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | adapter loads | swaps "
            "| requests per server | errors | IOP's choices |"
        )
        print("|---|---:|---:|---:|---:|---:|---|---:|---|")
        for cell in row:
            measured = cell.measured(args.warmup)
            firsts = [s.ttft * 1000 for s in measured]
            e2e = [s.e2e * 1000 for s in measured]
            print(
                f"| {cell.system} | {nearest_rank(firsts, 50):,.0f} | "
                f"{nearest_rank(firsts, 99):,.0f} | "
                f"{nearest_rank(e2e, 50):,.0f} | {cell.loads} | {cell.swaps} | "
                f"{'/'.join(str(n) for n in cell.served)} | {cell.errors()} | "
                f"{', '.join(f'{k} {v}' for k, v in sorted(cell.choices.items()))} |"
            )
        mine = next((c for c in row if c.system == "iop:adapters"), None)
        if mine is None:
            continue
        print("\niop:adapters against each (TTFT ratio; < 1.00: iop:adapters ahead):\n")
        print("| against | p50 ratio | p99 ratio |")
        print("|---|---:|---:|")
        ours = [s.ttft for s in mine.measured(args.warmup)]
        for other in row:
            if other is mine:
                continue
            theirs = [s.ttft for s in other.measured(args.warmup)]
            print(
                f"| {other.system} | {nearest_rank(ours, 50) / nearest_rank(theirs, 50):.2f} | "
                f"{nearest_rank(ours, 99) / nearest_rank(theirs, 99):.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[8.0, 16.0])
    parser.add_argument("--seconds", type=float, default=30.0, help="arrivals per cell")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds not measured")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--adapters", type=int, default=8, help="LoRA adapters served")
    parser.add_argument("--max-loras", type=int, default=2, help="adapter slots a server")
    parser.add_argument("--load-ms", type=float, default=100.0, help="an adapter's load")
    parser.add_argument("--capacity", type=int, default=16, help="IOP providers' capacity")
    parser.add_argument("--max-batch", type=int, default=16)
    routing.add_engine_arguments(parser)
    args = parser.parse_args()
    print(
        f"{benchkit.opening('bench/lora.py')}, vllm-router {peers.VLLM_ROUTER_VERSION}, "
        f"{args.seconds:g} s of arrivals a cell ({args.warmup:g} s warm-up)",
        flush=True,
    )
    print(
        f"# {SERVERS} servers x (batch {args.max_batch}, {args.max_loras} adapter slots, a load "
        f"{args.load_ms:g} ms, step {args.step_ms:g} ms + {args.step_ms_per_seq:g} ms a request, "
        f"prefill {args.prefill_tokens_per_s:g} tokens/s), {args.adapters} adapters drawn "
        f"uniformly; IOP capacity {args.capacity} a server",
        flush=True,
    )
    cells = uvloop.run(run(args))
    print(benchkit.closing())
    report(cells, args)


if __name__ == "__main__":
    main()
