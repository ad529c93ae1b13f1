"""Benchmark: the request path's cost while a change is on trial (a canary) against none, in
one run.

    uv run --frozen python -m bench.canary [--rounds 6] [--window 3] [--concurrency 32]

Real processes, as deployed: `iop edge run` and one `iop node run` with one provider (the
built-in `fake` adapter: no upstream HTTP, so the figures are the Edge's own). One continuous
load of `--concurrency` keep-alive connections (half of them streaming), each connection its own
conversation (the `user` field), cut into windows that alternate:

- **canary**: model `m` moved to another served name, held on trial at 50% (`rollout.steps:
  [50]`, a step and a wait of an hour, a sample no load reaches): the Edge holds both snapshots,
  picks each request's side by its conversation's bucket, dispatches it on that side's view and
  counts its outcome for that side;
- **none**: the candidate promoted by hand, then the first config applied again with
  `rollout.mode: off`: one snapshot, every request on it.

Each window's Edge CPU (Linux /proc) per completed request; the windows of a round go in ABBA
order, so the machine's drift cancels out. Every request must succeed, and during each canary
window both revisions must serve some of them. Figures go to docs/benchmarks.md ("## Canary").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import statistics
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvloop
import yaml

from bench import benchkit
from iop.processes import spawn_edge, spawn_node, terminate
from testkit import CLIENT_TOKEN, edge_document, node_token_of, provider

#: Held at one step for longer than any run, never judged (no load reaches the sample).
HELD = {"steps": [50], "step_ms": 3_600_000, "max_wait_ms": 3_600_000, "min_requests": 1_000_000}


def document() -> dict[str, Any]:
    fake = {"type": "fake", "latency_ms": 2, "completion_tokens": 8}
    return edge_document(
        {"node-1": [provider("pa", fake, served_models=["served", "served-2"], max_queue=256)]},
        {"m": ["pa"]},
        model_settings={"m": {"generation": {"max_tokens": 8}}},
        admin=True,
        metrics=True,
    )


def on_trial(base: dict[str, Any]) -> dict[str, Any]:
    candidate = copy.deepcopy(base)
    candidate["models"][0]["providers"] = {"pa": "served-2"}
    candidate["rollout"] = dict(HELD)
    return candidate


def kept(base: dict[str, Any]) -> dict[str, Any]:
    plain = copy.deepcopy(base)
    plain["rollout"] = {"mode": "off"}
    return plain


def request(host: str, stream: bool, user: str) -> bytes:
    body = json.loads(benchkit.body("m", stream))
    body["user"] = user
    encoded = json.dumps(body, separators=(",", ":")).encode()
    return benchkit.http_request(host, "/v1/chat/completions", encoded, CLIENT_TOKEN)


@contextlib.asynccontextmanager
async def stack(folder: Path) -> AsyncIterator[tuple[dict[str, Any], dict[str, Any]]]:
    base = document()
    (folder / "edge.yaml").write_text(yaml.safe_dump(base))
    async with contextlib.AsyncExitStack() as exits:
        edge, started = await spawn_edge(folder / "edge.yaml")
        exits.push_async_callback(terminate, edge)
        started["edge_pid"] = edge.pid
        token = folder / "node-1.token"
        token.write_text(node_token_of("node-1"))
        node = await spawn_node(started["hub_port"], "node-1", token)
        exits.push_async_callback(terminate, node)
        async with httpx.AsyncClient(base_url=started["url"]) as http:

            async def ready() -> bool:
                return bool((await http.get("/readyz")).json()["providers_available"] == ["pa"])

            await benchkit.until(ready, 60)
        yield started, base


async def apply(admin: httpx.AsyncClient, config: dict[str, Any]) -> dict[str, Any]:
    response = await admin.post("/refresh", json={"mode": "apply", "config": config})
    report: dict[str, Any] = response.json()
    if response.status_code != 200 or not report.get("applied"):
        raise RuntimeError(f"apply failed: {response.status_code} {response.text[:500]}")
    return report


async def revision_counts(metrics_url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(metrics_url)).text
    counts: dict[str, float] = {}
    for side in ("stable", "candidate"):
        label = f'iop_edge_revision_requests_total{{model="m",revision="{side}"}} '
        counts[side] = float(text.split(label)[1].split()[0]) if label in text else 0.0
    return counts


async def main(rounds: int, window: float, concurrency: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-canary-") as folder:
        async with stack(Path(folder)) as (started, base):
            url = httpx.URL(started["url"])
            host, port = url.host, url.port
            assert port is not None
            edge_pid = started["edge_pid"]
            metrics_url = f"{started['metrics_url']}/metrics"
            async with httpx.AsyncClient(base_url=started["admin_url"], timeout=60) as admin:
                trial, plain = on_trial(base), kept(base)
                load, stop = benchkit.Load(), asyncio.Event()
                payloads = [request(host, i % 2 == 0, f"user-{i}") for i in range(concurrency)]
                loader = asyncio.create_task(
                    benchkit.keep_loading(host, port, payloads, stop, load)
                )
                per_request: dict[str, list[float]] = {"canary": [], "none": []}
                shares: list[float] = []
                state = "none"

                async def switch(to: str) -> None:
                    nonlocal state
                    if to == state:
                        return
                    if to == "canary":
                        report = await apply(admin, trial)
                        assert "canary 50% for m" in report["message"], report["message"]
                    else:
                        promoted = await admin.post("/rollout", json={"action": "promote"})
                        assert promoted.status_code == 200, promoted.text
                        await apply(admin, plain)
                    state = to

                async def measure(kind: str) -> None:
                    await switch(kind)
                    await asyncio.sleep(0.3)  # the switch's own work out of the window
                    sides = await revision_counts(metrics_url)
                    cpu, done = benchkit.cpu_seconds(edge_pid), load.requests
                    await asyncio.sleep(window)
                    used, count = benchkit.cpu_seconds(edge_pid) - cpu, load.requests - done
                    per_request[kind].append(used / count * 1e6)
                    if kind == "canary":
                        after = await revision_counts(metrics_url)
                        on = after["candidate"] - sides["candidate"]
                        off = after["stable"] - sides["stable"]
                        if not on or not off:
                            raise RuntimeError(f"one revision served nothing: {after}")
                        shares.append(on / (on + off))

                await asyncio.sleep(2)  # warm up
                for index in range(rounds):
                    order = ("canary", "none") if index % 2 == 0 else ("none", "canary")
                    for kind in (*order, *reversed(order)):
                        await measure(kind)
                stop.set()
                await loader
    if load.failed:
        raise RuntimeError(f"{load.failed} of {load.requests} requests failed")
    canary = statistics.median(per_request["canary"])
    none = statistics.median(per_request["none"])
    print(f"## Canary ({rounds} rounds, {window:g}s windows, {concurrency} connections)\n")
    print("| windows | Edge CPU per request (median) | all windows |")
    print("|---|---:|---|")
    for kind, median in (("none", none), ("canary at 50%", canary)):
        values = per_request["none" if kind == "none" else "canary"]
        listed = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {kind} | {median:.0f} us | {listed} |")
    print(
        f"\ncanary / none: {canary / none:.3f}; the candidate served "
        f"{statistics.median(shares):.0%} of m's requests (median); "
        f"{load.requests} requests, none failed"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=3.0, help="seconds per window")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    uvloop.run(main(args.rounds, args.window, args.concurrency))


if __name__ == "__main__":
    cli()
