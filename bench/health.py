"""Benchmark: how long traffic keeps going to a dead model server, and how soon it comes back.

    uv run --frozen python -m bench.health [--rounds 5] [--interval-ms 5000 1000]
        [--cost-seconds 20]

Processes as deployed: two `iop fake-upstream`s, `iop edge run` and `iop node run` (plaintext
link), model `m` on providers pa and pb (equal priority: they take turns), each an `openai`
adapter on its own upstream. Each round kills pa's upstream (SIGKILL), polls the Edge's /readyz
every 5 ms until pa is out of dispatch, then starts the upstream again on the same port and polls
until pa is back. Both, for each probe interval given (applied live through the admin API), with
the provider's other health settings at their defaults (failure_threshold 3, success_threshold
1, request_failure_threshold 5):

- under load: 4 clients send plain chat requests back to back, so the Node's outlier detection
  (consecutive failed requests) usually takes pa out before its probes do; the clients'
  failures are counted (a request in flight on pa when it dies may fail; the rest are retried
  on pb);
- idle: no traffic, so only the probes can tell (failure_threshold probes in a row).

Printed per case: the time from the kill to pa leaving dispatch ("out") and from the restart to
pa being back ("back"), as median (min-max) over the rounds, the reason the Edge gave, and the
requests the clients saw fail.

First, the cost of probing itself, which a throughput benchmark cannot resolve (a probe a second
against thousands of requests a second is lost in the noise; `bench/edge.py
--probe-interval-ms` shows that side): the idle Node's CPU time over `--cost-seconds` with
probing off, every 1 s and every 100 ms (applied live, two providers probed), the probes the
upstreams answered meanwhile, and the CPU per probe from the difference.

Figures go to docs/benchmarks.md ("## Provider health").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvloop
import yaml

from bench import benchkit
from iop.processes import spawn_edge, spawn_iop, spawn_node, terminate
from testkit import CLIENT_TOKEN, edge_document, node_token_of, provider

POLL_S = 0.005
CLIENTS = 4


def document(ports: dict[str, int], interval_ms: int) -> dict[str, Any]:
    providers = [
        provider(
            pid,
            {"type": "openai", "base_url": f"http://127.0.0.1:{port}/v1"},
            capacity=64,
            health={"interval_ms": interval_ms},
        )
        for pid, port in ports.items()
    ]
    return edge_document({"node-1": providers}, admin=True)


@contextlib.asynccontextmanager
async def upstream(port: int = 0) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    process = await spawn_iop("fake-upstream", "--listen", f"127.0.0.1:{port}", stdout=True)
    try:
        started = await benchkit.started_line(process, "iop fake-upstream")
        yield process, int(started["listen"].rsplit(":", 1)[1])
    finally:
        await terminate(process)


class Load:
    """Clients sending plain chat requests back to back; what each answer was."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.statuses: list[int] = []
        #: The error code of each failed request (`node_disconnected`, `upstream_error`...).
        self.errors: list[str] = []
        self.tasks = [asyncio.create_task(self._client()) for _ in range(CLIENTS)]

    async def _client(self) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        while True:
            response = await self.http.post("/v1/chat/completions", json=body)
            self.statuses.append(response.status_code)
            if response.status_code != 200:
                self.errors.append(str(response.json()["error"]["code"]))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


async def main(rounds: int, intervals: list[int], cost_seconds: float) -> None:
    print(f"# bench/health.py on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}", flush=True)
    rows: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        pa_process, pa_port = await stack.enter_async_context(upstream())
        _, pb_port = await stack.enter_async_context(upstream())
        ports = {"pa": pa_port, "pb": pb_port}
        (folder / "edge.yaml").write_text(yaml.safe_dump(document(ports, intervals[0])))
        (folder / "node.token").write_text(node_token_of("node-1"))
        edge, started = await spawn_edge(folder / "edge.yaml")
        stack.push_async_callback(terminate, edge)
        node = await spawn_node(started["hub_port"], "node-1", folder / "node.token")
        stack.push_async_callback(terminate, node)
        headers = {"authorization": f"Bearer {CLIENT_TOKEN}"}
        limits = httpx.Limits(max_connections=64)
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=started["url"], headers=headers, timeout=60, limits=limits)
        )
        admin = await stack.enter_async_context(
            httpx.AsyncClient(base_url=started["admin_url"], timeout=60)
        )

        async def health(pid: str) -> dict[str, Any]:
            found: dict[str, Any] = (await http.get("/readyz")).json()["providers"][pid]
            return found

        async def pa_out() -> bool:
            return not (await health("pa"))["healthy"]

        async def pa_back() -> bool:
            return bool((await health("pa"))["healthy"])

        await benchkit.until(lambda: _both(http), timeout=60, interval=POLL_S)
        if cost_seconds:
            print("\n| probe interval | node CPU ms/s, idle | probes/s | CPU per probe |")
            print("|---|---:|---:|---:|")
            baseline = 0.0
            for interval in (0, 1000, 100):
                report = await admin.post(
                    "/refresh", json={"mode": "apply", "config": document(ports, interval)}
                )
                assert report.status_code == 200, report.text
                await asyncio.sleep(2)  # the new policy is in force on the Node
                lookups = await _lookups(ports)
                cpu = benchkit.cpu_seconds(node.pid)
                await asyncio.sleep(cost_seconds)
                cpu_rate = (benchkit.cpu_seconds(node.pid) - cpu) / cost_seconds
                probes = (await _lookups(ports) - lookups - 2) / cost_seconds  # 2: our own GETs
                if not interval:
                    baseline = cpu_rate
                per_probe = f"{(cpu_rate - baseline) / probes * 1e6:,.0f} us" if probes > 0 else "-"
                label = f"{interval / 1000:g} s" if interval else "off"
                print(f"| {label} | {cpu_rate * 1000:.2f} | {probes:.1f} | {per_probe} |")
        for interval in intervals:
            report = await admin.post(
                "/refresh", json={"mode": "apply", "config": document(ports, interval)}
            )
            assert report.status_code == 200, report.text
            for loaded in (True, False):
                outs: list[float] = []
                backs: list[float] = []
                reasons: set[str] = set()
                load = Load(http) if loaded else None
                try:
                    for _ in range(rounds):
                        await asyncio.sleep(max(0.5, 2 * interval / 1000))  # settle
                        pa_process.kill()
                        killed = time.monotonic()
                        await pa_process.wait()
                        outs.append(
                            await benchkit.until(pa_out, timeout=120, interval=POLL_S) - killed
                        )
                        reasons.add((await health("pa"))["reason"])
                        pa_process, _ = await stack.enter_async_context(upstream(pa_port))
                        restarted = time.monotonic()
                        backs.append(
                            await benchkit.until(pa_back, timeout=120, interval=POLL_S) - restarted
                        )
                finally:
                    if load is not None:
                        await load.stop()
                failed = len([s for s in load.statuses if s != 200]) if load else 0
                total = len(load.statuses) if load else 0
                if load is not None and load.errors:
                    codes = {code: load.errors.count(code) for code in sorted(set(load.errors))}
                    print(f"  {interval / 1000:g} s, under load: failed {codes}", file=sys.stderr)
                case = f"{interval / 1000:g} s, {'under load' if loaded else 'idle'}"
                print(f"  measured {case}", file=sys.stderr, flush=True)
                rows.append(
                    f"| {case} | {summary(outs)} | {', '.join(sorted(reasons))} "
                    f"| {summary(backs)} | {f'{failed} of {total:,}' if loaded else '-'} |"
                )
    print(f"\n{rounds} rounds per case; median (min-max).\n")
    print(
        "| probe interval, traffic | out after the kill | reason | back after the restart "
        "| client requests failed |"
    )
    print("|---|---:|---|---:|---:|")
    print("\n".join(rows))


async def _lookups(ports: dict[str, int]) -> int:
    """GETs the upstreams answered so far (the Node's probes, and these stats requests)."""
    total = 0
    async with httpx.AsyncClient(timeout=30) as http:
        for port in ports.values():
            total += int((await http.get(f"http://127.0.0.1:{port}/fake/stats")).json()["lookups"])
    return total


async def _both(http: httpx.AsyncClient) -> bool:
    ready = (await http.get("/readyz")).json()
    return bool(ready["providers_available"] == ["pa", "pb"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="kills per case")
    parser.add_argument(
        "--interval-ms",
        type=int,
        nargs="+",
        default=[5000, 1000],
        help="probe intervals to measure (each applied live)",
    )
    parser.add_argument(
        "--cost-seconds",
        type=float,
        default=20.0,
        help="seconds the idle Node's CPU is measured per probe interval (0: skip)",
    )
    args = parser.parse_args()
    uvloop.run(main(args.rounds, args.interval_ms, args.cost_seconds))
