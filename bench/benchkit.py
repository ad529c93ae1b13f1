"""What the benchmarks share: the load generator, the config they serve, pinned tools' environments.

- the load generator: `measure` keeps one HTTP/1.1 keep-alive `Connection` per worker, parsed by
  httptools so that the client costs as little CPU as possible, and returns a `Cell` (requests/s,
  latencies, times to the first body byte), `measure_cpu` with the CPU the processes spent per
  request; `http_request`, `chat_request`, `body` and `pct` go with it;
- percentiles: `pct` interpolates between ranks (statistics' inclusive method), `nearest_rank`
  picks a value that was measured (nan for none);
- the config: `edge_config` (the Edge, node-1 with p-http and p-fake, built with testkit's
  builder: a client sends testkit's CLIENT_TOKEN), `write_stack` (it and node-1's token in a
  folder) and `start_stack` (an Edge and a Node on it), `split_url`, `wait_available` (until
  /readyz lists the providers);
- the pinned tools: `ensure_venv` builds a virtual environment of pinned packages (and a checkout)
  under `default_cache`, never touching the project's;
- open-loop streams: `timed_stream` sends one streaming request on an aiohttp session and times
  its first byte and its end (`bench.routing`, `bench.lora`);
- processes: `cpu_seconds` and `rss_kib` (from /proc), `started_line` (the JSON line an `iop`
  process prints once it listens), `until`, `cancel_on_sigterm`; `module_command` runs a
  benchmark module as a child process, `child_rounds` a round of children, each printing its
  figures, `stub_edge` `bench.edge`'s Edge whose hub answers at once;
- the machine: `opening` and `closing`, a run's first and last lines (cores, time, load average);
- charts: `figure`, a matplotlib figure saved as a PNG;
- on import, PYTHONDONTWRITEBYTECODE is dropped from the environment (below).

Importing it needs the standard library only, since it also runs inside the pinned tools' own
environments (the studies' `--inner` and `--serve` runs): httptools, `iop` and `testkit` are
imported by the functions that use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The checkout's root: benchmarks run as modules of the `bench` package from here.
REPO = Path(__file__).resolve().parents[1]

# The processes a benchmark starts keep the modules they compile, as the product's image ships
# them compiled: with PYTHONDONTWRITEBYTECODE (this machine's shells set it) each would compile
# every module it imports, at its start and at the first use of a module imported late (a live
# apply's first run at 1,000 nodes: 1.16 s against 0.78-0.83 after).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def module_command(python: str, name: str, *args: str) -> list[str]:
    """The command that runs `bench.<name>` with `python` (another checkout's interpreter for a
    baseline: its own `iop`, this checkout's benchmark), to be started with `cwd=REPO`."""
    return [python, "-m", f"bench.{name}", *args]


async def child_rounds(
    part: str, rounds: int, commands: dict[str, list[str]]
) -> dict[str, list[Any]]:
    """Each of `commands` (by variant) once a round, `rounds` times, from REPO: each prints a JSON
    list, and a variant's lists are joined in the order of the rounds."""
    joined: dict[str, list[Any]] = defaultdict(list)
    for round_ in range(rounds):
        for name, command in commands.items():
            child = await asyncio.create_subprocess_exec(
                *command, stdout=asyncio.subprocess.PIPE, cwd=REPO
            )
            out, _ = await child.communicate()
            joined[name] += json.loads(out)
        print(f"  {part}: round {round_ + 1} done", file=sys.stderr, flush=True)
    return joined


@contextlib.asynccontextmanager
async def stub_edge(python: str, config: Path) -> AsyncIterator[tuple[str, int, int]]:
    """`bench.edge --stub-edge` run by `python` on `config` (an `edge_config`): an Edge whose hub
    answers every run at once. Its host, port and pid once /readyz lists both providers."""
    from iop.processes import terminate  # here: see Connection

    process = await asyncio.create_subprocess_exec(
        *module_command(python, "edge", "--stub-edge", str(config)),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=REPO,
    )
    try:
        host, port = split_url((await started_line(process))["url"])
        await wait_available(host, port, b'"providers_available":["p-fake","p-http"]')
        yield host, port, process.pid
    finally:
        await terminate(process)


def default_cache(name: str) -> Path:
    """`$XDG_CACHE_HOME/iop-bench/<name>`, where a script keeps its pinned tools."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "iop-bench" / name


def ensure_venv(
    venv: Path,
    packages: Sequence[str],
    *,
    project: Path | None = None,
    command: str = "python",
    announce: bool = False,
) -> Path:
    """`venv`'s bin/`command`, the environment built with uv first unless it holds `packages`."""
    found = venv / "bin" / command
    marker = venv / ".installed"  # what the environment was built with, written last
    wanted = list(packages)
    if project is not None:
        # A checkout whose locked dependencies (`uv export`) and itself (editable) go in too:
        # its lock's hash in the marker rebuilds the environment when the lock changes.
        wanted += [str(project), hashlib.sha256((project / "uv.lock").read_bytes()).hexdigest()]
    if marker.exists() and marker.read_text() == "\n".join(wanted) and found.exists():
        return found
    uv = shutil.which("uv")
    if uv is None:
        script = Path(sys.argv[0]).name
        raise SystemExit(f"bench/{script} needs uv on PATH (scripts/bootstrap installs it)")
    if announce:  # for an install that takes minutes (LiteLLM's)
        print(f"installing {' '.join(packages)} into {venv}", file=sys.stderr)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    requirements: list[str] = []
    if project is not None:
        exported = subprocess.run(
            [uv, "export", "--frozen", "--no-dev", "--no-hashes", "--no-emit-project", "--quiet"],
            check=True,
            capture_output=True,
            text=True,
            cwd=project,
        )
        (venv.parent / "requirements.txt").write_text(exported.stdout)
        requirements = ["-r", str(venv.parent / "requirements.txt")]
    python = f"{sys.version_info.major}.{sys.version_info.minor}"  # this interpreter's version
    env = {**os.environ, "VIRTUAL_ENV": str(venv)}
    subprocess.run([uv, "venv", "--quiet", "--python", python, str(venv)], check=True)
    subprocess.run([uv, "pip", "install", "--quiet", *requirements, *packages], check=True, env=env)
    if project is not None:
        subprocess.run(
            [uv, "pip", "install", "--quiet", "--no-deps", "-e", str(project)], check=True, env=env
        )
    marker.write_text("\n".join(wanted))
    return found


def cpu_seconds(*pids: int) -> float:
    """User + system CPU time the processes `pids` have used so far (Linux)."""
    ticks = 0
    for pid in pids:
        # After the command's closing parenthesis (a command may hold spaces and parentheses).
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    """The resident memory of the process `pid` in KiB (Linux); 0 once it has exited."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0  # a process that has exited and not yet been reaped has no VmRSS


def cancel_on_sigterm() -> None:
    """SIGTERM cancels the running task, so that every process it started is stopped on the way
    out (by its `async with` and `finally`)."""
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


def load_average(figures: int = 3) -> str:
    """The machine's 1-, 5- and 15-minute load averages (the first `figures` of them)."""
    return " ".join(f"{value:.1f}" for value in os.getloadavg()[:figures])


def opening(script: str, figures: int = 3) -> str:
    """A run's first line up to its own details: `# <script> on <cores> cores, <date and time>,
    load average <figures>`."""
    return (
        f"# {script} on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"load average {load_average(figures)}"
    )


def closing(figures: int = 3) -> str:
    """A run's last line before its tables: the load average it ended with."""
    return f"# load average at the end: {load_average(figures)}"


async def started_line(
    process: asyncio.subprocess.Process, who: str = "the Edge"
) -> dict[str, Any]:
    """The JSON line `process` prints on stdout once it listens (`who` names it in the error)."""
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    if not line:
        raise RuntimeError(f"{who} exited with {await process.wait()}")
    started: dict[str, Any] = json.loads(line)
    return started


async def until(condition: Callable[[], Any], timeout: float, interval: float = 0.02) -> float:
    """Poll `condition` (sync or async) until true; returns when it became true (monotonic)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic()
        if time.monotonic() > end:
            raise TimeoutError("condition not met")
        await asyncio.sleep(interval)


MAX_TOKENS = 8  # 8 content chunks per stream


class Connection(asyncio.Protocol):
    """One keep-alive connection; `request()` (or `exchange()`, which takes any status) sends one
    request and waits for its response."""

    def __init__(self) -> None:
        import httptools  # here: the pinned tools' environments import this module without it

        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.sent = self.first_body = self.received = 0.0
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio subclass

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self.first_body:
            self.first_body = time.perf_counter()
        self.tail = body

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the server closed the connection"))

    async def exchange(self, payload: bytes) -> int:
        """Send one request and wait for its whole response; its HTTP status (`sent`, `first_body`
        and `received` tell when)."""
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.first_body = 0.0
        self.sent = time.perf_counter()
        self.transport.write(payload)
        await self.done
        self.received = time.perf_counter()
        status: int = self.parser.get_status_code()
        return status

    async def request(self, payload: bytes) -> tuple[float, float]:
        """(latency, time to the first body byte), in milliseconds, of a response that must be a
        200."""
        status = await self.exchange(payload)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {self.tail[:300]!r}")
        return (self.received - self.sent) * 1000, (self.first_body - self.sent) * 1000


def http_request(host: str, path: str, body: bytes, token: str | None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def chat_request(host: str, model: str, stream: bool) -> bytes:
    """A chat completion of `model` (`body`) to `host` ("host:port") with testkit's client
    token."""
    from testkit import CLIENT_TOKEN  # here: see Connection

    return http_request(host, "/v1/chat/completions", body(model, stream), CLIENT_TOKEN)


def body(model: str, stream: bool, *, tokens: int = MAX_TOKENS, pace: float | None = None) -> bytes:
    """A chat completion request for `model` of `tokens` tokens; with `pace`, the fake upstream
    writes them at that many tokens/s (its per-request hook, which gateways forward untouched)."""
    document: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something about gateways."}],
        "max_tokens": tokens,
        "stream": stream,
    }
    if pace is not None:
        document["fake_upstream"] = {"tokens_per_second": pace}
    return json.dumps(document, separators=(",", ":")).encode()


@dataclass
class Cell:
    rps: float
    latencies: list[float]
    firsts: list[float]


async def measure(host: str, port: int, payload: bytes, concurrency: int, seconds: float) -> Cell:
    loop = asyncio.get_running_loop()
    connections = []
    for _ in range(concurrency):
        _, protocol = await loop.create_connection(Connection, host, port)
        connections.append(protocol)
    latencies: list[float] = []
    firsts: list[float] = []
    end = loop.time() + seconds

    async def worker(connection: Connection) -> None:
        while loop.time() < end:
            latency, first = await connection.request(payload)
            latencies.append(latency)
            firsts.append(first)

    began = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in connections))
    elapsed = time.perf_counter() - began
    for connection in connections:
        assert connection.transport is not None
        connection.transport.close()
    return Cell(len(latencies) / elapsed, latencies, firsts)


#: `timed_stream`'s figures of one request: seconds to its first byte and to its end, whether it
#: ended well, and why not.
Timed = tuple[float, float, bool, str]


async def measure_cpu(
    host: str, port: int, payload: bytes, concurrency: int, seconds: float, pids: dict[str, int]
) -> tuple[Cell, dict[str, float]]:
    """`measure`, and the CPU each of the processes `pids` (by name) spent meanwhile, in
    microseconds per request."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    cell = await measure(host, port, payload, concurrency, seconds)
    served = len(cell.latencies)
    return cell, {
        name: (cpu_seconds(pid) - before[name]) / served * 1e6 for name, pid in pids.items()
    }


async def timed_stream(session: Any, url: str, body: bytes) -> Timed:
    """POST the streaming request `body` to `url` on the aiohttp `session`, reading it to its
    end: seconds to its first byte and to its end, whether it ended `data: [DONE]` with a 200,
    and why not."""
    import aiohttp

    start = time.perf_counter()
    first = 0.0
    ok = False
    why = ""
    try:
        async with session.post(url, data=body) as response:
            tail = b""
            async for piece in response.content.iter_any():
                if not first:
                    first = time.perf_counter()
                tail = (tail + piece)[-200:]
            ok = response.status == 200 and tail.endswith(b"data: [DONE]\n\n")
            if not ok:
                why = f"HTTP {response.status}: {tail[-160:].decode(errors='replace')}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        why = repr(exc)
    end = time.perf_counter()
    return (first or end) - start, end - start, ok, why


def pct(values: list[float], q: int) -> float:
    """The `q`th percentile, interpolated between ranks; 0 for fewer than two values."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else 0


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The `q`th percentile by nearest rank: always a value that was measured; nan for none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def edge_config(upstream_url: str, probe_interval_ms: int | None = None) -> dict[str, Any]:
    """The benchmarks' Edge config (testkit's builder): model `openai` on p-http (the `openai`
    adapter against `upstream_url`) and `node-fake` on p-fake (the built-in generator), both on
    node-1, and the admin listener on loopback (never the default 9090 another Edge may hold);
    `probe_interval_ms` sets how often the Node probes p-http's upstream (None: the default)."""
    from testkit import edge_document, provider  # here: see Connection

    health: dict[str, Any] = {}
    if probe_interval_ms is not None:
        health["health"] = {"interval_ms": probe_interval_ms}
    http = {"type": "openai", "base_url": upstream_url}
    fake = {"type": "fake", "completion_tokens": MAX_TOKENS}
    providers = [
        provider("p-http", http, capacity=1024, max_queue=1024, **health),
        provider("p-fake", fake, capacity=1024, max_queue=1024),
    ]
    models = {"openai": ["p-http"], "node-fake": ["p-fake"]}
    return edge_document({"node-1": providers}, models, admin=True)


def write_stack(folder: Path, document: dict[str, Any]) -> Path:
    """`document` as `folder`/edge.yaml and node-1's token as `folder`/token, what `iop edge run`
    and `iop node run` read; the config's path."""
    import yaml  # here: see Connection

    from testkit import node_token_of

    (folder / "edge.yaml").write_text(yaml.safe_dump(document))
    (folder / "token").write_text(node_token_of("node-1"))
    return folder / "edge.yaml"


def split_url(url: object) -> tuple[str, int]:
    host, _, port = str(url).removeprefix("http://").rpartition(":")
    return host, int(port)


async def wait_available(host: str, port: int, wanted: bytes, timeout: float = 30.0) -> None:
    """Poll the Edge's /readyz until its answer holds `wanted` (`"providers_available":[...]`)."""
    request = f"GET /readyz HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        answer = await reader.read()
        writer.close()
        if wanted in answer:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the node never connected")


@contextlib.asynccontextmanager
async def start_stack(
    folder: Path, wanted: bytes, *, node: bool = True, timeout: float = 60.0
) -> AsyncIterator[tuple[dict[str, Any], dict[str, int]]]:
    """`iop edge run` and (with `node`) `iop node run` as node-1 on the folder `write_stack`
    wrote, each given `timeout` seconds to start and the providers to be available (`wanted`, as
    `wait_available` takes it): the Edge's started line and the processes' ids by name."""
    from iop.processes import spawn_edge, spawn_node, terminate  # here: see Connection

    edge, started = await spawn_edge(folder / "edge.yaml", startup_timeout=timeout)
    process: asyncio.subprocess.Process | None = None
    try:
        pids = {"edge": edge.pid}
        if node:
            process = await spawn_node(started["hub_port"], "node-1", folder / "token")
            pids["node"] = process.pid
        host, port = split_url(started["url"])
        await wait_available(host, port, wanted, timeout)
        yield started, pids
    finally:
        if process is not None:
            await terminate(process)
        await terminate(edge)


@dataclass
class Load:
    """Requests completed so far by `keep_loading` (a window reads the count as it grows)."""

    requests: int = 0
    failed: int = 0


async def keep_loading(
    host: str, port: int, payloads: list[bytes], stop: asyncio.Event, load: Load
) -> None:
    """One keep-alive connection per payload, each sending its payload back to back until
    `stop`; every answer counted in `load` (a status other than 200 as failed)."""
    loop = asyncio.get_running_loop()
    connections = []
    for _ in payloads:
        _, protocol = await loop.create_connection(Connection, host, port)
        connections.append(protocol)

    async def worker(connection: Connection, payload: bytes) -> None:
        while not stop.is_set():
            status = await connection.exchange(payload)
            load.requests += 1
            load.failed += status != 200

    await asyncio.gather(*map(worker, connections, payloads))
    for connection in connections:
        assert connection.transport is not None
        connection.transport.close()


@contextlib.contextmanager
def figure(
    path: Path, rows: int, columns: int, size: tuple[float, float], **options: Any
) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure of `rows` x `columns` axes (`options` go to `subplots`) for the block
    to draw: saved to `path` as a PNG when it ends, and closed."""
    import matplotlib  # here: only a run that draws needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn, axes = plt.subplots(rows, columns, figsize=size, **options)
    try:
        yield drawn, axes
        path.parent.mkdir(parents=True, exist_ok=True)
        drawn.savefig(path, dpi=110)
    finally:
        plt.close(drawn)
