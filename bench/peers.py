"""Benchmark: IOP Edge side by side with peer gateways (LiteLLM, vLLM's router) and the direct path.

    uv run --frozen python -m bench.peers [--rounds 3] [--seconds 3]
        [--concurrency 1 32 128] [--paths direct iop litellm vllm-router] [--charts docs]
        [--modes whole stream stream-256] [--variant base=PYTHONPATH=../other/src]

Paths, all in front of the same `iop fake-upstream` process:

- `direct`: the fake upstream itself (the client's and the upstream's own ceiling);
- `iop`: `iop edge run` + one `iop node run` with two `openai` providers of one model (auth with
  a principal token, metrics on, full dispatch), as deployed;
- `litellm`: LiteLLM's proxy with the equivalent config (two deployments of one model, a master
  key, no database), one process, as `litellm --config` starts it;
- `iop-local`: `iop edge run` alone, the same config with the node placed on the Edge
  (`placement: edge`): the Edge runs the providers itself (adapters, capacity, probes), with no
  Node process and no gRPC hop;
- `vllm-router`: the vLLM project's router (Rust, on PyPI as `vllm-router`) in front of the same
  upstream as two workers, round-robin. It checks no client key and maps no model names (a
  request names the upstream's model), so it does less per request than the two gateways.

Each peer is installed, pinned, into a virtual environment of its own under a cache directory
(`--cache`, default `$XDG_CACHE_HOME/iop-bench/peers`), never into the project's: LiteLLM drags
in hundreds of packages the product must not depend on. Both run offline:
`LITELLM_LOCAL_MODEL_COST_MAP=True` keeps LiteLLM from fetching its model cost map at start, and
the router is told to check its workers' health on `/v1/models`, which the fake upstream serves.

One closed-loop client serves every path: N workers, each with its own aiohttp session over one
keep-alive connection. Paths take turns within each round (the order
rotates from round to round), so that the machine's load, which other work shares, falls on all
of them alike; the ratios are what to read. The direct path's figures show the client's ceiling.

Modes: `whole` (8 tokens, one JSON body), `stream` (8 content chunks), `stream-N` (N content
chunks, written by the upstream in one burst, as a fast model server's buffered output reads)
and `stream-N@TPS` (N chunks paced at TPS tokens/s per stream through the fake upstream's
per-request hook: one upstream write per token, as a GPU server generates them; the router and
IOP forward the hook untouched, and the direct path obeys it).

`--variant NAME=VAR=VALUE[,VAR=VALUE...]` adds another IOP stack, `iop:NAME` (and
`iop-local:NAME` with `iop-local`), whose Edge and Node start with those environment variables:
`PYTHONPATH=OTHER/src` runs another checkout's product (the figures before a change, in the
same run, as bench/hostile.py does), and gRPC's own variables (`GRPC_POLL_STRATEGY`,
`GRPC_EXPERIMENTS`) try its knobs. Every variant takes its turn
in each round like the other paths.

It prints, per mode and concurrency: requests/s (median of the rounds and their range), p50 and
p99 latency and their ratio (over all rounds' requests), time to the first SSE event for
streams, the latency each gateway adds to the direct path, CPU time per request by process (from
/proc), CPU per content chunk of a stream (the gateway's processes), and the ratios of IOP to
the direct path and to each peer, the router's CPU per request among them. With `--charts DIR`
it draws `peers-throughput.png` and `peers-latency-cdf.png` there. Figures go to docs/benchmarks.md
("## Side by side with a peer").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
import yaml

from bench import benchkit
from bench.benchkit import MAX_TOKENS, nearest_rank
from iop.processes import spawn_edge, spawn_fake_upstream, spawn_node, terminate
from testkit import CLIENT_TOKEN, Placement, edge_document, provider

#: The newest LiteLLM whose `proxy` extra resolves on PyPI as served here (later ones pin
#: `litellm-proxy-extras` releases that are not published); docs/benchmarks.md's figures used
#: it too.
LITELLM_VERSION = "1.108.7"
MASTER_KEY = "sk-bench-master"
MODEL = "bench"
#: The newest vllm-router on PyPI on the day of the figures.
VLLM_ROUTER_VERSION = "0.1.17"
PATHS = ("direct", "iop", "iop-local", "litellm", "vllm-router")
PEERS = ("litellm", "vllm-router")
#: The processes of each path that make up "the gateway" (CPU per request, per chunk).
GATEWAY = ("edge", "node", "edge-local", "litellm", "vllm-router")


@dataclass(frozen=True)
class Mode:
    """What a request asks for: a whole answer or a stream of `tokens` chunks (paced or not)."""

    name: str
    stream: bool
    tokens: int
    pace: float | None = None

    @classmethod
    def parse(cls, text: str) -> Mode:
        if text == "whole":
            return cls(text, False, MAX_TOKENS)
        if text == "stream":
            return cls(text, True, MAX_TOKENS)
        count, _, pace = text.removeprefix("stream-").partition("@")
        if not text.startswith("stream-") or not count.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: whole, stream, stream-N or stream-N@TPS")
        return cls(text, True, int(count), float(pace) if pace else None)


def variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME=VAR=VALUE[,VAR=VALUE...]` -> (NAME, {VAR: VALUE})."""
    name, _, assignments = text.partition("=")
    env = dict(pair.split("=", 1) for pair in assignments.split(",") if "=" in pair)
    if not name or not env:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=VAR=VALUE[,VAR=VALUE...]")
    return name, env


# -- the peer's installation -----------------------------------------------------------------------


def ensure_litellm(cache: Path) -> Path:
    requirement = f"litellm[proxy]=={LITELLM_VERSION}"
    venv = cache / f"litellm-{LITELLM_VERSION}"
    return benchkit.ensure_venv(venv, [requirement], command="litellm", announce=True)


def ensure_vllm_router(cache: Path) -> Path:
    requirement = f"vllm-router=={VLLM_ROUTER_VERSION}"
    venv = cache / f"vllm-router-{VLLM_ROUTER_VERSION}"
    return benchkit.ensure_venv(venv, [requirement], command="vllm-router", announce=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def wait_http(
    url: str, wanted: bytes, timeout: float, process: asyncio.subprocess.Process
) -> None:
    """Poll `url` until its body contains `wanted`; fail if `process` exits first."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    async with aiohttp.ClientSession() as session:
        while loop.time() < until:
            if process.returncode is not None:
                raise RuntimeError(f"{url}: the server exited with {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if wanted in await response.read():
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not answer {wanted!r} within {timeout:.0f}s")


@dataclass(frozen=True)
class Target:
    """Where a path listens and which processes serve it (for their CPU time)."""

    url: str
    token: str | None
    model: str
    pids: dict[str, int]


@contextlib.asynccontextmanager
async def litellm_proxy(command: Path, upstream_url: str, folder: Path) -> AsyncIterator[Target]:
    deployment = {"model": "openai/served", "api_base": upstream_url, "api_key": "unused"}
    config = {
        "model_list": [
            {"model_name": MODEL, "litellm_params": deployment},
            {"model_name": MODEL, "litellm_params": dict(deployment)},
        ],
        "general_settings": {"master_key": MASTER_KEY},
    }
    (folder / "litellm.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of the cost map at start: offline
    with (folder / "litellm.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            str(command),
            *("--config", str(folder / "litellm.yaml"), "--host", "127.0.0.1"),
            *("--port", str(port), "--num_workers", "1"),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_http(f"{url}/health/liveliness", b"alive", 180, process)
        yield Target(url, MASTER_KEY, MODEL, {"litellm": process.pid})
    finally:
        await terminate(process)


@contextlib.asynccontextmanager
async def vllm_router(
    command: Path,
    upstream_listen: str,
    folder: Path,
    *,
    workers: Sequence[str] = (),
    policy: str = "round_robin",
) -> AsyncIterator[Target]:
    """The router in front of `workers` (default: the upstream at `upstream_listen`, twice)."""
    port = free_port()
    upstream_port = upstream_listen.rpartition(":")[2]
    # Two workers on the same upstream (two spellings of its address: the router keys workers
    # by URL), as the two deployments of the other gateways.
    workers = workers or [f"http://127.0.0.1:{upstream_port}", f"http://localhost:{upstream_port}"]
    with (folder / f"vllm-router-{policy}.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            str(command),
            *("--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())),
            *("--worker-urls", *workers, "--policy", policy),
            *("--health-check-endpoint", "/v1/models", "--log-level", "warning"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        # It listens only once its workers answered their health check; then it forwards.
        await wait_http(f"{url}/v1/models", b'"object":"list"', 120, process)
        yield Target(url, None, "served", {"vllm-router": process.pid})
    finally:
        await terminate(process)


def iop_config(upstream_url: str, placement: Placement = "node") -> dict[str, Any]:
    adapter = {"type": "openai", "base_url": upstream_url}
    providers = [provider(pid, adapter, capacity=1024, max_queue=1024) for pid in ("p-a", "p-b")]
    return edge_document(
        {"node-1": providers}, {MODEL: ["p-a", "p-b"]}, placement=placement, admin=True
    )


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """The variables `env` set while processes start (they inherit this process's)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.asynccontextmanager
async def iop_stack(
    upstream_url: str,
    folder: Path,
    env: dict[str, str] | None = None,
    placement: Placement = "node",
) -> AsyncIterator[Target]:
    """An Edge and a Node, or (`placement="edge"`) an Edge alone running the providers."""
    folder.mkdir(parents=True, exist_ok=True)
    benchkit.write_stack(folder, iop_config(upstream_url, placement))
    with environment(env or {}):
        edge, started = await spawn_edge(folder / "edge.yaml", startup_timeout=120)
    node: asyncio.subprocess.Process | None = None
    try:
        if placement == "node":
            with environment(env or {}):
                node = await spawn_node(started["hub_port"], "node-1", folder / "token")
        url = str(started["url"])
        await wait_http(f"{url}/readyz", b'"providers_available":["p-a","p-b"]', 60, edge)
        pids = {"edge": edge.pid, "node": node.pid} if node else {"edge-local": edge.pid}
        yield Target(url, CLIENT_TOKEN, MODEL, pids)
    finally:
        if node is not None:
            await terminate(node)
        await terminate(edge)


# -- the closed-loop client ------------------------------------------------------------------------


@dataclass
class Cell:
    """One path's measurement of one (mode, concurrency) in one round."""

    rps: float
    latencies: list[float]
    firsts: list[float]
    errors: int
    cpu_us: dict[str, float]


async def measure(
    target: Target, mode: Mode, concurrency: int, seconds: float, pids: dict[str, int]
) -> Cell:
    """`concurrency` workers, each on its own keep-alive connection, for `seconds`."""
    headers = {"content-type": "application/json"}
    if target.token:
        headers["authorization"] = f"Bearer {target.token}"
    stream = mode.stream
    payload = benchkit.body(target.model, mode.stream, tokens=mode.tokens, pace=mode.pace)
    url = f"{target.url}/v1/chat/completions"
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    firsts: list[float] = []
    errors = 0
    sessions = [
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=60),
        )
        for _ in range(concurrency)
    ]

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while loop.time() < end:
            start = time.perf_counter()
            first = 0.0
            try:
                async with session.post(url, data=payload) as response:
                    if stream:
                        tail = b""
                        async for piece in response.content.iter_any():
                            if not first:
                                first = time.perf_counter()
                            tail = piece
                        ok = response.status == 200 and tail.endswith(b"data: [DONE]\n\n")
                    else:
                        ok = response.status == 200 and b'"choices"' in await response.read()
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            end_time = time.perf_counter()
            if not ok:
                errors += 1
                continue
            latencies.append((end_time - start) * 1000)
            if stream:
                firsts.append((first - start) * 1000)

    try:
        end = loop.time() + 0.3  # warm-up: open every connection, fill the pools
        await asyncio.gather(*(worker(s) for s in sessions))
        latencies.clear()
        firsts.clear()
        errors = 0
        before = {name: benchkit.cpu_seconds(pid) for name, pid in pids.items()}
        began = time.perf_counter()
        end = loop.time() + seconds
        await asyncio.gather(*(worker(s) for s in sessions))
        elapsed = time.perf_counter() - began
        served = max(len(latencies), 1)
        cpu = {
            name: (benchkit.cpu_seconds(pid) - before[name]) / served * 1e6
            for name, pid in pids.items()
        }
    finally:
        for session in sessions:
            await session.close()
    return Cell(len(latencies) / elapsed, latencies, firsts, errors, cpu)


# -- the run and its report ------------------------------------------------------------------------


@dataclass
class Series:
    """Every round of one (mode, concurrency, path)."""

    cells: list[Cell] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return statistics.median(c.rps for c in self.cells)

    @property
    def rps_range(self) -> tuple[float, float]:
        return min(c.rps for c in self.cells), max(c.rps for c in self.cells)

    @property
    def latencies(self) -> list[float]:
        return [x for c in self.cells for x in c.latencies]

    @property
    def firsts(self) -> list[float]:
        return [x for c in self.cells for x in c.firsts]

    @property
    def errors(self) -> int:
        return sum(c.errors for c in self.cells)

    def cpu(self, name: str) -> float:
        return statistics.median(c.cpu_us.get(name, 0.0) for c in self.cells)


Key = tuple[str, int, str]  # (mode, concurrency, path)


def path_order(args: argparse.Namespace) -> list[str]:
    """The paths of the run: the chosen ones, each IOP variant right after its IOP path."""
    order: list[str] = []
    for path in PATHS:
        if path in args.paths:
            order.append(path)
            if path in ("iop", "iop-local"):
                order += [f"{path}:{name}" for name, _ in args.variant]
    return order


async def run(args: argparse.Namespace) -> dict[Key, Series]:
    results: dict[Key, Series] = defaultdict(Series)
    benchkit.cancel_on_sigterm()
    litellm = ensure_litellm(args.cache) if "litellm" in args.paths else None
    router = ensure_vllm_router(args.cache) if "vllm-router" in args.paths else None
    async with contextlib.AsyncExitStack() as stack:
        # An answer as long as the longest mode asks for (the fake's own default is 16 tokens).
        longest = max(mode.tokens for mode in args.modes)
        upstream = await stack.enter_async_context(
            spawn_fake_upstream(["--completion-tokens", str(longest)], startup_timeout=120)
        )
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        targets: dict[str, Target] = {
            "direct": Target(f"http://{upstream.listen}", None, "served", {}),
        }
        if "iop" in args.paths:
            targets["iop"] = await stack.enter_async_context(
                iop_stack(upstream.base_url, folder / "iop")
            )
            for name, env in args.variant:
                targets[f"iop:{name}"] = await stack.enter_async_context(
                    iop_stack(upstream.base_url, folder / f"iop-{name}", env)
                )
        if "iop-local" in args.paths:
            targets["iop-local"] = await stack.enter_async_context(
                iop_stack(upstream.base_url, folder / "iop-local", placement="edge")
            )
            for name, env in args.variant:
                targets[f"iop-local:{name}"] = await stack.enter_async_context(
                    iop_stack(upstream.base_url, folder / f"iop-local-{name}", env, "edge")
                )
        if litellm is not None:
            targets["litellm"] = await stack.enter_async_context(
                litellm_proxy(litellm, upstream.base_url, folder)
            )
        if router is not None:
            targets["vllm-router"] = await stack.enter_async_context(
                vllm_router(router, upstream.listen, folder)
            )
        order = path_order(args)
        for round_ in range(args.rounds):
            turn = order[round_ % len(order) :] + order[: round_ % len(order)]
            for mode in args.modes:
                for concurrency in args.concurrency:
                    for path in turn:
                        target = targets[path]
                        pids = {**target.pids, "upstream": upstream.pid, "client": os.getpid()}
                        cell = await measure(target, mode, concurrency, args.seconds, pids)
                        results[(mode.name, concurrency, path)].cells.append(cell)
                        print(
                            f"  round {round_ + 1} {mode.name} c={concurrency} {path}: "
                            f"{cell.rps:,.0f} req/s, {cell.errors} errors",
                            file=sys.stderr,
                            flush=True,
                        )
    return results


def gateway_cpu(series: Series) -> float:
    """CPU per request of the path's own processes (Edge + Node, LiteLLM, the router)."""
    present = series.cells[0].cpu_us
    return sum(series.cpu(name) for name in GATEWAY if name in present)


def report(results: dict[Key, Series], args: argparse.Namespace) -> None:
    order = path_order(args)
    print(
        "| mode | conc | path | req/s (median) | range | p50 ms | p99 ms | p99/p50 "
        "| TTFT p50 ms | added p50 ms | added TTFT p50 ms | errors |"
    )
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes:
        for conc in args.concurrency:
            direct = results.get((mode.name, conc, "direct"))
            for path in order:
                series = results[(mode.name, conc, path)]
                lat = series.latencies
                p50, p99 = nearest_rank(lat, 50), nearest_rank(lat, 99)
                low, high = series.rps_range
                ttft = nearest_rank(series.firsts, 50) if mode.stream else float("nan")
                added = added_ttft = "-"
                if direct is not None and path != "direct":
                    added = f"{p50 - nearest_rank(direct.latencies, 50):+.2f}"
                    if mode.stream:
                        added_ttft = f"{ttft - nearest_rank(direct.firsts, 50):+.2f}"
                print(
                    f"| {mode.name} | {conc} | {path} | {series.rps:,.0f} | "
                    f"{low:,.0f}-{high:,.0f} | {p50:.2f} | {p99:.2f} | {p99 / p50:.1f} | "
                    f"{f'{ttft:.2f}' if mode.stream else '-'} | {added} | {added_ttft} | "
                    f"{series.errors} |"
                )
    print(
        "\nCPU time per request by process (us, median of the rounds); gateway: the path's own "
        "processes; per chunk: the gateway's CPU per content chunk of a stream:\n"
    )
    names = ["edge", "node", "litellm", "vllm-router", "upstream", "client"]
    print("| mode | conc | path | " + " | ".join(names) + " | gateway | per chunk |")
    print("|---|---:|---|" + "---:|" * (len(names) + 2))
    for mode in args.modes:
        for conc in args.concurrency:
            for path in order:
                series = results[(mode.name, conc, path)]
                present = series.cells[0].cpu_us
                cells = [f"{series.cpu(n):,.0f}" if n in present else "-" for n in names]
                gateway = gateway_cpu(series) if path != "direct" else None
                cells.append("-" if gateway is None else f"{gateway:,.0f}")
                per_chunk = "-"
                if gateway is not None and mode.stream:
                    per_chunk = f"{gateway / mode.tokens:,.1f}"
                cells.append(per_chunk)
                print(f"| {mode.name} | {conc} | {path} | " + " | ".join(cells) + " |")
    iops = [p for p in order if p.startswith("iop")]
    if not iops:
        return
    peers = [p for p in PEERS if p in order]
    if "direct" not in order and not peers:
        return  # nothing to compare the IOP paths with
    print("\nRatios (requests/s: median of the rounds; latency: p50 over all rounds):\n")
    headers = [
        "mode",
        "conc",
        "path",
        "/ direct req/s",
        *(f"/ {p} req/s" for p in peers),
        "added p50",
        *(f"{p} added p50" for p in peers),
        *(h for p in peers if p == "vllm-router" for h in (f"CPU / {p}'s", f"added p50 / {p}'s")),
    ]
    print("| " + " | ".join(headers) + " |")
    print("|---|---:|---|" + "---:|" * (len(headers) - 3))
    for mode in args.modes:
        for conc in args.concurrency:
            direct = results.get((mode.name, conc, "direct"))
            d50 = nearest_rank(direct.latencies, 50) if direct else float("nan")
            for path in iops:
                iop = results[(mode.name, conc, path)]
                gap = nearest_rank(iop.latencies, 50) - d50
                cols = [f"{iop.rps / direct.rps:.2f}" if direct else "-"]
                cols += [f"{iop.rps / results[(mode.name, conc, p)].rps:.2f}x" for p in peers]
                cols.append(f"{gap:+.2f} ms" if direct else "-")
                cols += [
                    f"{nearest_rank(results[(mode.name, conc, p)].latencies, 50) - d50:+.2f} ms"
                    if direct
                    else "-"
                    for p in peers
                ]
                if "vllm-router" in peers:
                    router = results[(mode.name, conc, "vllm-router")]
                    router_added = nearest_rank(router.latencies, 50) - d50
                    cols.append(f"{gateway_cpu(iop) / gateway_cpu(router):.1f}x")
                    cols.append(f"{gap / router_added:.1f}x" if router_added > 0 else "-")
                print(f"| {mode.name} | {conc} | {path} | " + " | ".join(cols) + " |")


COLOURS = {
    "direct": "#7f7f7f",
    "iop": "#1f77b4",
    "iop-local": "#9467bd",
    "litellm": "#d62728",
    "vllm-router": "#2ca02c",
}
LABELS = {
    "direct": "direct (fake upstream)",
    "iop": "IOP Edge + Node",
    "iop-local": "IOP Edge, node placed on the Edge",
    "litellm": "LiteLLM proxy",
    "vllm-router": "vLLM router (Rust)",
}


def charts(results: dict[Key, Series], args: argparse.Namespace, folder: Path) -> None:
    names = {mode.name for mode in args.modes}
    if not {"whole", "stream"} <= names:
        print("charts need the modes whole and stream; none drawn", file=sys.stderr)
        return
    throughput_chart(results, args, folder)
    latency_chart(results, args, folder)


def throughput_chart(results: dict[Key, Series], args: argparse.Namespace, folder: Path) -> None:
    order = [p for p in PATHS if p in args.paths]
    png = folder / "peers-throughput.png"
    with benchkit.figure(png, 1, 2, (11, 4.2), sharey=True) as (figure, axes):
        for ax, mode in zip(axes, ("whole", "stream"), strict=True):
            width = 0.8 / len(order)
            for i, path in enumerate(order):
                values = [results[(mode, c, path)].rps for c in args.concurrency]
                xs = [j + (i - (len(order) - 1) / 2) * width for j in range(len(args.concurrency))]
                bars = ax.bar(xs, values, width, label=LABELS[path], color=COLOURS[path])
                ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7, rotation=90)
            ax.set_xticks(range(len(args.concurrency)), [f"c={c}" for c in args.concurrency])
            ax.set_yscale("log")
            ax.set_title("non-streaming" if mode == "whole" else f"streaming ({MAX_TOKENS} chunks)")
            ax.grid(axis="y", which="both", alpha=0.3)
        every = [
            results[(m, c, p)].rps
            for m in ("whole", "stream")
            for c in args.concurrency
            for p in order
        ]
        axes[0].set_ylim(min(every) / 2, max(every) * 4)  # every bar shown, room for the labels
        axes[0].set_ylabel("requests/s (log scale, median of rounds)")
        handles, labels = axes[0].get_legend_handles_labels()
        figure.legend(handles, labels, loc="lower center", ncol=len(order), fontsize=9)
        figure.suptitle("Throughput by concurrency, one closed-loop client, same fake upstream")
        figure.tight_layout(rect=(0, 0.07, 1, 1))


def latency_chart(results: dict[Key, Series], args: argparse.Namespace, folder: Path) -> None:
    order = [p for p in PATHS if p in args.paths]
    concs = [c for c in args.concurrency if c in (1, 32)] or args.concurrency[:2]
    png = folder / "peers-latency-cdf.png"
    size = (11, 3.6 * len(concs))
    with benchkit.figure(png, len(concs), 2, size, squeeze=False) as (figure, axes):
        for row, conc in enumerate(concs):
            for col, mode in enumerate(("whole", "stream")):
                ax = axes[row][col]
                for path in order:
                    lat = sorted(results[(mode, conc, path)].latencies)
                    if not lat:
                        continue
                    ys = [(i + 1) / len(lat) for i in range(len(lat))]
                    ax.plot(lat, ys, label=LABELS[path], color=COLOURS[path])
                ax.set_xscale("log")
                ax.set_xlabel("latency, request to last byte (ms, log scale)")
                ax.set_ylabel("fraction of requests")
                ax.set_title(f"{'non-streaming' if mode == 'whole' else 'streaming'}, c={conc}")
                ax.axhline(0.99, color="black", linewidth=0.5, linestyle=":")
                ax.grid(which="both", alpha=0.3)
                ax.legend(fontsize=8, loc="lower right")
        figure.suptitle("Latency CDFs (dotted line: p99)")
        figure.tight_layout()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument(
        "--modes",
        nargs="+",
        type=Mode.parse,
        default=[Mode.parse(m) for m in ("whole", "stream", "stream-256")],
        help="whole, stream (8 chunks), stream-N, stream-N@TPS (paced)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        type=variant,
        default=[],
        metavar="NAME=VAR=VALUE[,VAR=VALUE]",
        help="another IOP stack, iop:NAME, started with these environment variables",
    )
    parser.add_argument(
        "--cache", type=Path, default=benchkit.default_cache("peers"), help="peer installs"
    )
    parser.add_argument("--charts", type=Path, metavar="DIR", help="draw PNG charts into DIR")
    args = parser.parse_args()
    print(
        f"{benchkit.opening('bench/peers.py')}, LiteLLM {LITELLM_VERSION}, vllm-router "
        f"{VLLM_ROUTER_VERSION}, {args.rounds} rounds of {args.seconds:g} s per cell",
        flush=True,
    )
    results = uvloop.run(run(args))
    print(benchkit.closing() + "\n")
    report(results, args)
    if args.charts is not None:
        charts(results, args, args.charts)


if __name__ == "__main__":
    main()
