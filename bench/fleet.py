"""Benchmark: what a fleet of Nodes costs one Edge, at N nodes of two providers each.

    uv run --frozen python -m bench.fleet [--nodes 10,100,500,1000] [--idle-seconds 10]
        [--seconds 5] [--concurrency 32] [--per-client-hellos 64] [--max-connections N]
        [--heartbeat-ms MS] [--idle-heartbeat-ms MS] [--connect-timeout 120] [--load-here]
        [--profile DIR] [--ramp PER_SECOND] [--load-models K] [--chart docs/fleet.png]

One `iop edge run` child per N (its CPU and RSS read from /proc, alone), and N Nodes in this
process: each what `NodeAgent` (`iop node run`) builds for one Edge, its `Runner` with two
providers of the built-in `fake` adapter, its `PayloadArbiter` and its `EdgeConnection`, with its
own token, dialing the Edge's node hub over loopback in plaintext on a TCP connection of its own
(`FleetConnection` says why). So every node speaks the wire as deployed: hello with its token,
welcome, heartbeats at the config's intervals (on a quiet link from the node alone, when both
sides keep its beats one way), health reports, a config ack for every push, and runs
answered. Each node serves a model of its own (`m-0007` on `n0007-a` and `n0007-b`), so the
requests below touch the whole fleet while a model's width stays the same at every N.

Per N, on a fresh Edge whose config lists the N nodes:

1. connect all: from starting the fleet until the Edge's `GET /status` (admin API) says every
   node is connected and ready (its payload acknowledged);
2. RSS per node: (the Edge's RSS with every node connected - its RSS before any dialed) / N;
3. idle: the Edge's CPU (cores) over `--idle-seconds` of heartbeats alone, and this process's
   (the fleet's) beside it;
4. apply: `POST /refresh` of the config with every provider's capacity raised, which changes
   every node's payload: the round trip until the report, which the Edge sends once every push
   is acknowledged (or timed out), the CPU the Edge and the fleet spent until it arrived (the
   fleet's nodes take their payloads on the Edge's cores here; until 2026-12-03 12:00 the
   fleet's figure also held this process's parse of the report, a document of every push),
   and the pushes acked and failed; and
   the nodes that lost their session meanwhile (each node's own count of sessions it left
   because the Edge fell silent past its deadline, or that failed): an Edge whose loop an
   apply holds past a link's deadline loses its fleet; then a change to one node's provider
   (one push), until its ack;
5. load: `--concurrency` keep-alive clients (bench/benchkit.py's `Connection`) sending
   non-streaming chat completions of 8 tokens, each request for the next model round the fleet
   (`--load-models K`: round the first K), for `--seconds`: requests/s and the Edge's CPU time
   per request, as measured and less what it spends idle (the heartbeats go on meanwhile).
   The load generator is a process of its own (`--load-here`: this one, beside the fleet, as
   the runs before 2026-12-03 10:00 were), its clients connected before the Edge's CPU is read.
   A warm-up first asks every model twice: a model's first requests cost the Edge once what
   later ones do not (its Prometheus label children are made), which at 1,000 models in a
   5-second run was most of the difference from 10.

`--profile DIR` records the Edge with py-spy (`uvx py-spy`, 200 samples a second, raw stacks)
over each measured phase: `DIR/N-idle.raw`, `N-apply.raw` (the apply to every node; and this
process, the fleet, meanwhile: `N-apply-fleet.raw`) and `N-load.raw`.

Every node dials from 127.0.0.1, where a deployed fleet dials from as many addresses: the
config raises `edge.node_link.max_unauthenticated_per_client` (default 8) to
`--per-client-hellos` so that the per-address bound does not stand for the fleet-wide one
(`max_unauthenticated_connections`, 64, kept). `edge.node_link.max_connections` (1,024) is left
as shipped unless `--max-connections` sets it: a row whose N exceeds it shows how many nodes
got in by the connect timeout. Prints a table and ratios against the first N (`--chart`: each
cost against N, with the goals). Figures go to docs/benchmarks.md ("## A fleet of Nodes").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import json
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
import uvloop
import yaml

from bench import benchkit
from iop.aiokits import guarded_task, stop_tasks
from iop.node import EdgeConnection, NodeIdentity, PayloadArbiter
from iop.processes import spawn_edge, terminate
from iop.providers import Runner
from testkit import edge_document, node_token_of, provider

logger = logging.getLogger(__name__)

#: The fake adapter's answer: 8 tokens at once (no pacing: the Edge's cost, not a model's).
FAKE = {"type": "fake", "completion_tokens": benchkit.MAX_TOKENS}
CAPACITY = 64
#: Seconds the fleet has to close its links before the run goes on without waiting.
STOP_TIMEOUT_S = 30.0


def node_id(index: int) -> str:
    return f"node-{index:04d}"


def document(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """N nodes of two fake providers each; model `m-NNNN` over node NNNN's two providers."""
    providers = {
        node_id(i): [
            provider(f"n{i:04d}-{side}", FAKE, capacity=CAPACITY, max_queue=CAPACITY)
            for side in ("a", "b")
        ]
        for i in range(nodes)
    }
    models = {f"m-{i:04d}": [f"n{i:04d}-a", f"n{i:04d}-b"] for i in range(nodes)}
    link: dict[str, Any] = {"max_unauthenticated_per_client": args.per_client_hellos}
    if args.max_connections is not None:
        link["max_connections"] = args.max_connections
    if args.heartbeat_ms is not None:  # the deadline keeps the shipped ratio (2,000 / 500)
        link["heartbeat_interval_ms"] = args.heartbeat_ms
        link["heartbeat_timeout_ms"] = 4 * args.heartbeat_ms
    if args.idle_heartbeat_ms is not None:
        link["idle_heartbeat_interval_ms"] = args.idle_heartbeat_ms
    return edge_document(
        providers,
        models,
        admin=True,
        edge={"node_link": link},
        # Every client connection comes from this one address too.
        openai={"max_connections_per_client": 1024},
    )


def _quiet(args: argparse.Namespace) -> str:
    idle = 10_000 if args.idle_heartbeat_ms is None else args.idle_heartbeat_ms
    return f"{idle} ms" if idle > (args.heartbeat_ms or 500) else "interval (quiet links off)"


@dataclass
class Row:
    nodes: int
    connected: int = 0
    connect_s: float = float("nan")
    rss_none_kib: int = 0
    rss_all_kib: int = 0
    idle_edge_cores: float = float("nan")
    idle_fleet_cores: float = float("nan")
    apply_s: float = float("nan")
    #: CPU seconds the Edge and the fleet (this process) spent during that apply: the fleet's
    #: is what a thousand machines would spend, here on the Edge's two cores.
    apply_edge_cpu_s: float = float("nan")
    apply_fleet_cpu_s: float = float("nan")
    acked: int = 0
    failed: int = 0
    #: Sessions the nodes left or lost while the apply ran (they redial).
    lost: int = 0
    #: A change to one node's provider afterwards: until its one ack.
    apply_one_s: float = float("nan")
    rps: float = float("nan")
    edge_us_per_request: float = float("nan")
    #: The same less what the Edge spends idle (heartbeats) over as long.
    edge_us_above_idle: float = float("nan")
    errors: int = 0

    @property
    def kib_per_node(self) -> float:
        return (self.rss_all_kib - self.rss_none_kib) / max(self.connected, 1)


# -- the fleet ------------------------------------------------------------------------------------


class FleetConnection(EdgeConnection):
    """`EdgeConnection` on a channel of its own: grpc shares one TCP connection between channels
    of one process to one address (its global subchannel pool), where the hub allows two
    streams per connection, so the third node of this process would wait for a stream forever.
    A real Node is a process of its own and never shares; a local subchannel pool makes each
    simulated one dial its own connection too."""

    def _channel(self) -> grpc.aio.Channel:
        options = [*self.channel_options(), ("grpc.use_local_subchannel_pool", 1)]
        return grpc.aio.insecure_channel(self.target, options=options)


@dataclass
class FleetNode:
    """One Node as `NodeAgent` builds it for one Edge: its runner (the fake adapters), its
    payload arbiter and its connection, kept up by a task."""

    runner: Runner
    connection: EdgeConnection
    task: asyncio.Task[None]

    @classmethod
    def start(cls, hub: str, index: int) -> FleetNode:
        identity = NodeIdentity(
            node_id(index),
            node_token_of(node_id(index)),
            instance_id=uuid.uuid4().hex[:12],
            started_at=time.time(),
        )
        runner = Runner()
        connection = FleetConnection(hub, identity, runner, arbiter=PayloadArbiter(runner))
        task = guarded_task(connection.run(), name=f"fleet-{identity.node_id}", logger=logger)
        return cls(runner, connection, task)

    async def stop(self) -> None:
        await stop_tasks([self.task])
        await self.runner.aclose()


@contextlib.asynccontextmanager
async def fleet(hub: str, nodes: int, ramp: int = 0) -> AsyncIterator[list[FleetNode]]:
    """N nodes dialing `hub`, started at once, or `ramp` a second (the last batch started
    before this yields); all stopped on the way out."""
    started: list[FleetNode] = []
    try:
        batch = max(1, ramp // 10) if ramp else nodes
        for index in range(nodes):
            if index and index % batch == 0:
                await asyncio.sleep(0.1)
            started.append(FleetNode.start(hub, index))
        yield started
    finally:
        stopping = asyncio.gather(*(node.stop() for node in started), return_exceptions=True)
        # Bounded: a fleet whose links collapsed on a saturated machine can take long to close.
        done, _ = await asyncio.wait([stopping], timeout=STOP_TIMEOUT_S)
        if not done:
            logger.error("the fleet did not stop within %g s; leaving it", STOP_TIMEOUT_S)


async def ready_nodes(admin: httpx.AsyncClient) -> tuple[int, int]:
    """(connected, ready) nodes, as the Edge's `GET /status` says."""
    nodes = (await admin.get("/status")).json()["nodes"]
    return sum(n["connected"] for n in nodes), sum(n["ready"] for n in nodes)


async def connect_all(
    admin: httpx.AsyncClient, members: list[FleetNode], began: float, edge: int, timeout: float
) -> int:
    """Until the Edge says every node is connected and ready (or `timeout`): the ready count.

    The fleet's own view (every connection welcomed) is read first, which costs the Edge
    nothing; `GET /status`, which costs it a document of every node, is polled only then."""
    deadline = began + timeout
    said = began
    connected = ready = 0
    while time.monotonic() < deadline:
        now = time.monotonic()
        welcomed = sum(m.connection.connected.is_set() for m in members)
        if welcomed == len(members):
            connected, ready = await ready_nodes(admin)
            if ready == len(members):
                return ready
        if now - said >= 5:
            said = now
            edge_cpu, fleet_cpu = benchkit.cpu_seconds(edge), benchkit.cpu_seconds(os.getpid())
            print(
                f"  {now - began:.0f} s: {welcomed} of {len(members)} welcomed, Edge CPU "
                f"{edge_cpu:.1f} s, fleet {fleet_cpu:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.sleep(0.05 if welcomed < len(members) else 0.1)
    connected, ready = await ready_nodes(admin)
    print(
        f"  {len(members)} nodes: {connected} connected, {ready} ready after {timeout:g} s",
        file=sys.stderr,
        flush=True,
    )
    return ready


# -- the measures ---------------------------------------------------------------------------------


class Profile:
    """py-spy recording the Edge over one phase (`--profile`), or nothing without a folder."""

    def __init__(self, child: asyncio.subprocess.Process | None) -> None:
        self._child = child

    @classmethod
    async def start(cls, folder: Path | None, name: str, pid: int) -> Profile:
        if folder is None:
            return cls(None)
        folder.mkdir(parents=True, exist_ok=True)
        child = await asyncio.create_subprocess_exec(
            "uvx",
            "py-spy",
            "record",
            "-r",
            "200",
            "-f",
            "raw",
            "--nonblocking",
            "-o",
            str(folder / f"{name}.raw"),
            "-p",
            str(pid),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await asyncio.sleep(1.0)  # py-spy attached before the phase begins
        return cls(child)

    async def stop(self) -> None:
        """End the recording (py-spy writes its file on SIGINT)."""
        child = self._child
        if child is None or child.returncode is not None:
            return
        child.send_signal(signal.SIGINT)
        await child.wait()


@dataclass
class Applied:
    """What `apply` saw: its round trip, the sessions lost meanwhile, each push's status, and
    the CPU seconds the Edge and the fleet spent until the report arrived (the fleet's reading
    of the report, a document of every push, not among them)."""

    seconds: float
    lost: int
    statuses: list[str]
    edge_cpu_s: float
    fleet_cpu_s: float


async def apply(
    admin: httpx.AsyncClient, candidate: dict[str, Any], members: list[FleetNode], edge: int
) -> Applied:
    """`POST /refresh` of `candidate`: its round trip (the report comes once every push is
    acknowledged), the sessions the nodes left or lost meanwhile (what an apply that holds the
    Edge's loop past their deadline shows as), and each push's status."""

    def ended() -> int:
        return sum(m.connection.silences + m.connection.failures for m in members)

    before = ended()
    edge_before, fleet_before = benchkit.cpu_seconds(edge), benchkit.cpu_seconds(os.getpid())
    began = time.perf_counter()
    response = await admin.post("/refresh", json={"mode": "apply", "config": candidate})
    took = time.perf_counter() - began
    edge_cpu = benchkit.cpu_seconds(edge) - edge_before
    fleet_cpu = benchkit.cpu_seconds(os.getpid()) - fleet_before
    report = response.json()
    if response.status_code != 200 or report["outcome"] != "applied":
        raise RuntimeError(f"apply failed: {response.status_code} {response.text[:500]}")
    statuses = [push["status"] for push in report["pushes"]]
    return Applied(took, ended() - before, statuses, edge_cpu, fleet_cpu)


async def apply_capacity(
    admin: httpx.AsyncClient,
    base: dict[str, Any],
    members: list[FleetNode],
    row: Row,
    edge: int,
    profiles: Path | None = None,
) -> None:
    """Every provider's capacity + 1: every node's payload changes, so every node is pushed;
    then one node's provider's capacity + 1 more (one push)."""
    candidate = copy.deepcopy(base)
    for node in candidate["nodes"]:
        for entry in node["providers"]:
            entry["capacity"] += 1
    profile = await Profile.start(profiles, f"{len(members)}-apply", edge)
    fleet_profile = await Profile.start(profiles, f"{len(members)}-apply-fleet", os.getpid())
    applied = await apply(admin, candidate, members, edge)
    await profile.stop()
    await fleet_profile.stop()
    row.apply_s, row.lost = applied.seconds, applied.lost
    row.apply_edge_cpu_s, row.apply_fleet_cpu_s = applied.edge_cpu_s, applied.fleet_cpu_s
    row.acked = applied.statuses.count("acked")
    row.failed = len(applied.statuses) - row.acked
    candidate["nodes"][-1]["providers"][0]["capacity"] += 1
    one = await apply(admin, candidate, members, edge)
    row.apply_one_s = one.seconds
    if one.statuses != ["acked"]:
        raise RuntimeError(f"the apply to one node pushed {one.statuses}")


async def load(
    host: str,
    port: int,
    nodes: int,
    concurrency: int,
    seconds: float,
    at_least: int = 0,
    started: Callable[[], Awaitable[None]] | None = None,
) -> tuple[int, int, float]:
    """`concurrency` keep-alive clients, each request for the next model round the fleet, for
    `seconds` and at least `at_least` requests: (answered, not 200, elapsed seconds). With
    `started`, it is awaited once every client is connected, before the first request."""
    target = f"{host}:{port}"
    payloads = [benchkit.chat_request(target, f"m-{i:04d}", False) for i in range(nodes)]
    turn = itertools.cycle(range(nodes))
    loop = asyncio.get_running_loop()
    connections: list[benchkit.Connection] = []
    answered = failed = 0
    try:
        for _ in range(concurrency):
            _, connection = await loop.create_connection(benchkit.Connection, host, port)
            connections.append(connection)
        end = loop.time() + seconds

        async def worker(connection: benchkit.Connection) -> None:
            nonlocal answered, failed
            while loop.time() < end or answered < at_least:
                status = await connection.exchange(payloads[next(turn)])
                answered += 1
                failed += status != 200

        if started is not None:
            await started()
            end = loop.time() + seconds
        began = time.perf_counter()
        await asyncio.gather(*map(worker, connections))
        return answered, failed, time.perf_counter() - began
    finally:
        for connection in connections:
            if connection.transport is not None:
                connection.transport.close()


class LoadGenerator:
    """`load` in a process of its own, so that the fleet's heartbeats in this one do not slow
    its clients down. One process for the whole run, started before any fleet: a process that
    grpc's threads run in may crash between fork and exec (grpc's fork handlers: SIGSEGV)."""

    def __init__(self, child: asyncio.subprocess.Process) -> None:
        self._child = child

    @classmethod
    async def start(cls) -> LoadGenerator:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.fleet",
            "--load-generator",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(child)

    async def measured(
        self, edge: int, host: str, port: int, nodes: int, args: argparse.Namespace
    ) -> tuple[int, int, float, float]:
        """(answered, not 200, elapsed seconds, the Edge's CPU seconds from the clients' first
        request to their last), the clients connected before the clock starts."""
        child = self._child
        assert child.stdin is not None and child.stdout is not None
        job = {"host": host, "port": port, "nodes": nodes}
        job |= {"concurrency": args.concurrency, "seconds": args.seconds}
        child.stdin.write(json.dumps(job).encode() + b"\n")
        await child.stdin.drain()
        said = (await child.stdout.readline()).strip()
        if said != b"connected":
            raise RuntimeError(f"the load generator did not connect: {said!r}")
        edge_before = benchkit.cpu_seconds(edge)
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        line = await child.stdout.readline()
        spent = benchkit.cpu_seconds(edge) - edge_before
        result = json.loads(line)
        return result["answered"], result["failed"], result["elapsed"], spent

    async def aclose(self) -> None:
        child = self._child
        if child.returncode is None:
            assert child.stdin is not None
            child.stdin.close()
            await child.wait()


async def generate_load() -> None:
    """The process of `LoadGenerator`: for each job read, connect, say so, wait for "go", load,
    print the result; until its input ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def started() -> None:
        print("connected", flush=True)
        await reader.readline()

    while line := await reader.readline():
        job = json.loads(line)
        answered, failed, elapsed = await load(
            job["host"],
            job["port"],
            job["nodes"],
            job["concurrency"],
            job["seconds"],
            started=started,
        )
        result = {"answered": answered, "failed": failed, "elapsed": elapsed}
        print(json.dumps(result), flush=True)


async def measure(
    folder: Path, nodes: int, args: argparse.Namespace, generator: LoadGenerator
) -> Row:
    row = Row(nodes)
    base = document(nodes, args)
    config = folder / f"edge-{nodes}.yaml"
    config.write_text(yaml.safe_dump(base))
    edge, started = await spawn_edge(config, startup_timeout=120)
    try:
        host, port = benchkit.split_url(started["url"])
        hub = f"127.0.0.1:{started['hub_port']}"
        async with httpx.AsyncClient(base_url=started["admin_url"], timeout=120) as admin:
            await ready_nodes(admin)  # the admin path warmed up before the baseline
            await asyncio.sleep(1.0)
            row.rss_none_kib = benchkit.rss_kib(edge.pid)
            began = time.monotonic()
            async with fleet(hub, nodes, args.ramp) as members:
                ready = await connect_all(admin, members, began, edge.pid, args.connect_timeout)
                row.connected = ready
                if ready < nodes:
                    row.rss_all_kib = benchkit.rss_kib(edge.pid)
                    return row
                row.connect_s = time.monotonic() - began
                await asyncio.sleep(2.0)  # every node's first heartbeats and health reports in
                row.rss_all_kib = benchkit.rss_kib(edge.pid)
                me = os.getpid()
                profile = await Profile.start(args.profile, f"{nodes}-idle", edge.pid)
                idle_began = time.monotonic()
                edge_before = benchkit.cpu_seconds(edge.pid)
                fleet_before = benchkit.cpu_seconds(me)
                await asyncio.sleep(args.idle_seconds)
                idle = time.monotonic() - idle_began
                row.idle_edge_cores = (benchkit.cpu_seconds(edge.pid) - edge_before) / idle
                row.idle_fleet_cores = (benchkit.cpu_seconds(me) - fleet_before) / idle
                await profile.stop()
                await apply_capacity(admin, base, members, row, edge.pid, args.profile)
                # Warm-up: every model twice, so that what a model's first request costs once
                # (its metrics' label children) is not counted as the fleet's cost per request.
                await load(host, port, nodes, args.concurrency, 0.5, at_least=2 * nodes)
                profile = await Profile.start(args.profile, f"{nodes}-load", edge.pid)
                models = min(nodes, args.load_models or nodes)
                if args.load_here:
                    edge_before = benchkit.cpu_seconds(edge.pid)
                    answered, row.errors, elapsed = await load(
                        host, port, models, args.concurrency, args.seconds
                    )
                    spent = benchkit.cpu_seconds(edge.pid) - edge_before
                else:
                    answered, row.errors, elapsed, spent = await generator.measured(
                        edge.pid, host, port, models, args
                    )
                await profile.stop()
                row.rps = answered / elapsed
                row.edge_us_per_request = spent / max(answered, 1) * 1e6
                above = spent - row.idle_edge_cores * elapsed
                row.edge_us_above_idle = above / max(answered, 1) * 1e6
    finally:
        await terminate(edge)
    return row


# -- the report -----------------------------------------------------------------------------------


def ratio(value: float, base: float) -> float:
    """`value / base`, or nan when the base is 0 (a window too short for one clock tick)."""
    return value / base if base else float("nan")


def print_table(rows: list[Row]) -> None:
    print(
        "| nodes | connected | connect all s | Edge RSS none KiB | Edge RSS all KiB | KiB/node "
        "| idle Edge cores | idle fleet cores | apply -> acks s | apply Edge CPU s "
        "| apply fleet CPU s | acked | failed | nodes lost | apply one s | req/s "
        "| Edge CPU us/req | above idle |"
    )
    print("|---:" * 18 + "|")
    for r in rows:
        print(
            f"| {r.nodes:,} | {r.connected:,} | {r.connect_s:.2f} | {r.rss_none_kib:,} | "
            f"{r.rss_all_kib:,} | {r.kib_per_node:.1f} | {r.idle_edge_cores:.3f} | "
            f"{r.idle_fleet_cores:.3f} | {r.apply_s:.3f} | {r.apply_edge_cpu_s:.2f} | "
            f"{r.apply_fleet_cpu_s:.2f} | {r.acked:,} | {r.failed:,} | "
            f"{r.lost:,} | {r.apply_one_s:.3f} | {r.rps:,.0f} | "
            f"{r.edge_us_per_request:,.0f} | {r.edge_us_above_idle:,.0f} |"
        )
    first = rows[0]
    print(f"\nRatios against {first.nodes:,} nodes:\n")
    print(
        "| nodes | x nodes | connect all | KiB/node | idle Edge cores | apply -> acks | us/req "
        "| above idle |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratios = [
            ratio(r.connect_s, first.connect_s),
            ratio(r.kib_per_node, first.kib_per_node),
            ratio(r.idle_edge_cores, first.idle_edge_cores),
            ratio(r.apply_s, first.apply_s),
            ratio(r.edge_us_per_request, first.edge_us_per_request),
            ratio(r.edge_us_above_idle, first.edge_us_above_idle),
        ]
        cells = " | ".join(f"{value:.2f}" for value in ratios)
        print(f"| {r.nodes:,} | {r.nodes / first.nodes:.0f} | {cells} |")
    errors = sum(r.errors for r in rows)
    if errors:
        print(f"\n{errors:,} requests were answered with a status other than 200")


#: Issue 35's goals, drawn on the chart: (panel, nodes, value); a None nodes is every N.
GOALS: dict[str, list[tuple[int | None, float]]] = {
    "connect_s": [(1000, 3.0)],
    "kib_per_node": [(None, 64.0)],
    "idle_edge_cores": [(1000, 0.05)],
    "apply_s": [(1000, 0.3), (5000, 1.5)],
}


def chart(rows: list[Row], path: Path) -> None:
    """Each cost against N (log scales but for the two that should stay flat), the goals as red
    marks: a cross where a goal is set at one N, a dotted line where it holds at every N (CPU
    per request: 1.1x the first N's)."""
    panels = (
        ("connect_s", "connect all (s)"),
        ("kib_per_node", "Edge RSS per node (KiB)"),
        ("idle_edge_cores", "idle Edge CPU (cores)"),
        ("apply_s", "live apply until every ack (s)"),
        ("apply_one_s", "apply to one node (s)"),
        ("edge_us_per_request", "Edge CPU per request (us)"),
    )
    done = [r for r in rows if r.connected == r.nodes]
    with benchkit.figure(path, 2, 3, (13, 7.5)) as (figure, axes):
        for ax, (name, title) in zip(axes.flat, panels, strict=True):
            nodes = [r.nodes for r in done]
            ax.plot(nodes, [getattr(r, name) for r in done], "-o", color="#08306b", label="IOP")
            if name == "edge_us_per_request":
                ax.plot(
                    nodes,
                    [r.edge_us_above_idle for r in done],
                    "--o",
                    color="#4292c6",
                    label="above idle",
                )
                if done:
                    ax.axhline(1.1 * done[0].edge_us_per_request, color="red", linestyle=":")
                ax.legend(fontsize=8)
            for at, value in GOALS.get(name, []):
                if at is None:
                    ax.axhline(value, color="red", linestyle=":")
                else:
                    ax.plot([at], [value], "x", color="red", markersize=9, mew=2)
            ax.set_title(title)
            ax.set_xscale("log")
            if name in ("kib_per_node", "edge_us_per_request"):  # flat where it should be
                ax.set_ylim(bottom=0)
            else:
                ax.set_yscale("log")
            ax.set_xlabel("nodes")
            ax.grid(alpha=0.3, which="both")
        figure.suptitle(
            "What a fleet of Nodes costs one Edge (2 cores shared with the fleet's process); "
            "red: issue 35's goals"
        )
        figure.tight_layout()


async def main(args: argparse.Namespace) -> None:
    # Ctrl-C or SIGTERM cancels the run, so that every `finally` stops the fleet and the Edge.
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, task.cancel)
    rows = []
    generator = await LoadGenerator.start()  # before any fleet: see `LoadGenerator`
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for nodes in args.nodes:
                rows.append(await measure(Path(tmp), nodes, args, generator))
                print(f"  measured {nodes} nodes", file=sys.stderr, flush=True)
    finally:
        await generator.aclose()
    print_table(rows)
    if args.chart is not None:
        chart(rows, args.chart)


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=sizes, default=[10, 100, 500, 1000], help="e.g. 10,100")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=5.0, help="the load's measuring time")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--connect-timeout", type=float, default=120.0)
    parser.add_argument(
        "--load-models",
        type=int,
        default=None,
        metavar="K",
        help="the measured load asks the first K models only (default: every node's): at K=10 "
        "a large fleet's cost per request is its connected sessions', not its models'",
    )
    parser.add_argument(
        "--per-client-hellos",
        type=int,
        default=64,
        help="edge.node_link.max_unauthenticated_per_client (every node dials from 127.0.0.1)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="edge.node_link.max_connections (default: the product's, 1,024)",
    )
    parser.add_argument(
        "--heartbeat-ms",
        type=int,
        default=None,
        help="edge.node_link.heartbeat_interval_ms, the timeout 4 times it (default: the "
        "product's, 500 and 2,000)",
    )
    parser.add_argument(
        "--idle-heartbeat-ms",
        type=int,
        default=None,
        help="edge.node_link.idle_heartbeat_interval_ms, a quiet link's (default: the "
        "product's, 10,000; 0: quiet links off, every link beats every heartbeat interval)",
    )
    parser.add_argument(
        "--load-here",
        action="store_true",
        help="the load generator in this process, beside the fleet (as before 2026-12-03 "
        "10:00); by default it runs in a process of its own",
    )
    parser.add_argument(
        "--ramp",
        type=int,
        default=0,
        metavar="PER_SECOND",
        help="start the fleet's nodes this many a second (connect all counts from the first); "
        "0: all at once, as after an Edge restart",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="record the Edge with py-spy over each phase into DIR (N-idle.raw, N-apply.raw, "
        "N-load.raw)",
    )
    parser.add_argument(
        "--chart", type=Path, default=None, help="draw each cost against N into this PNG"
    )
    parser.add_argument("--load-generator", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log-level", default="ERROR", help="this process's (the fleet's) log")
    arguments = parser.parse_args()
    logging.basicConfig(level=arguments.log_level, format="%(levelname)s %(name)s: %(message)s")
    if arguments.load_generator:  # (the process of `LoadGenerator`)
        uvloop.run(generate_load())
        sys.exit(0)
    print(
        f"{benchkit.opening('bench/fleet.py', 1)}; heartbeats every "
        f"{arguments.heartbeat_ms or 500} ms, "
        f"on a quiet link every {_quiet(arguments)}; "
        f"idle {arguments.idle_seconds:g} s, load "
        f"{arguments.seconds:g} s at {arguments.concurrency} clients\n",
        flush=True,
    )
    try:
        uvloop.run(main(arguments))
    except asyncio.CancelledError:
        print("interrupted: the fleet and the Edge are stopped", file=sys.stderr)
        sys.exit(130)
