"""Benchmark: hostile clients of the node hub and the OpenAI API, each replayed as described,
against real processes: the figures of docs/reliability.md ("Hostile peers").

    uv run --frozen python -m bench.hostile [--only NAME ...]
    PYTHONPATH=OTHER/src uv run --frozen python -m bench.hostile   # another checkout's product

Every process (Edge, Nodes, the hostile clients and upstream) is a child started with this
environment, so with `PYTHONPATH` pointing at another checkout's `src` the same attacks run
against that release (the "before" figures): the configs use no setting that release lacks
(defaults everywhere), and the hostile clients are `tests/chaos/hubclients.py` and
`tests/chaos/hostileupstream.py`, which need only the wire's protobuf.

- hub-oversized: four 250 MiB first messages at once on the node hub (plaintext, two Nodes
  connected): the Edge's RSS idle, at its peak and after; the worst /healthz and /readyz; Node
  links lost; how the calls ended and when.
- hub-silent: the Edge under `ulimit -n 300`: 10 calls that send no hello (how long they stay
  open), then 320: descriptors at their peak, /healthz failures and worst latency, RSS, links.
- hostage: 8 clients that read nothing stream `mistral` (capacity 8, fallback `llama`) from a
  model at 5,000 tokens a second; then a normal request for `mistral`: its latency, its status,
  the model that answered; then the same model without a fallback.
- big-answer: a 108 MB non-streamed answer from the model server, with its length and chunked
  without one: the Node's and the Edge's RSS growth, the status and when, the worst /healthz.
- log-flood: a Node with a valid token sends 5 config refusals of 20 MiB, then 5 of a message's
  size and the health of 100,000 providers nobody configured: log bytes and lines, RSS growth.
- wrong-tokens: 4 connections send wrong keys for 10 s: answers a second by status, log lines
  about it, whether a key appears in the log.
- transfer-encoding: a POST with `Transfer-Encoding: gzip`: its status, or no answer in 10 s.
- upstream-heads: a placed provider's upstream answers with a 64 MiB header, 100 MB of small
  headers, 2 million `100 Continue`: the status and when, the worst /healthz, the Edge's RSS.
- upstream-framing: bytes on an idle pooled connection (the next request's status), a lone CR
  in a stream (what reached the client), a 301 with a body, statuses 000 and 099, a stream of
  SSE comments alone (when it ends).
- big-bodies: chat bodies of 600k tiny messages and embeddings of 2M one-element lists (each
  within the 8 MiB limit), one then four at once, with an ordinary chat meanwhile: statuses,
  the worst /healthz, the Edge's RSS.
- cut-streams: 10 streams of 420 tokens cut by their client 10 events before the end: how far
  the principal's budget and `iop_edge_completion_tokens_total` moved.
- tools-burst: 20 concurrent chats with 20 KB, then 2 KB, of `tools` against 4,000 tokens a
  minute: how many were admitted, and the bucket after.
- limit-store: the shared limit store stopped, slowed and cut off (`bench/limitstore.py`): the
  `max_concurrent` places left taken, the most each replica runs during a stall.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvloop
import yaml

from bench import benchkit, limitstore
from testkit import CLIENT_TOKEN, edge_document, node_token_of, provider

CHAOS = Path(__file__).resolve().parents[1] / "tests" / "chaos"
BODY = {"messages": [{"role": "user", "content": "hi"}]}


def iop() -> list[str]:
    script = Path(sys.executable).with_name("iop")
    return [str(script)] if script.exists() else [sys.executable, "-m", "iop.cli"]


def rss_mb(pid: int) -> float:
    return benchkit.rss_kib(pid) / 1024


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def document(
    nodes: dict[str, list[dict[str, Any]]],
    models: dict[str, list[str]] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """A config of defaults but listeners (admin and metrics too) and the given nodes and models
    (default: `m` on every provider); `options` go to testkit's builder."""
    return edge_document(nodes, models, admin=True, metrics=True, **options)


@dataclass
class Stack:
    edge: asyncio.subprocess.Process
    started: dict[str, Any]
    log: Path
    nodes: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.started["url"])

    @property
    def hub_port(self) -> int:
        return int(self.started["hub_port"])

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def links_lost(self) -> int:
        return sum(
            "disconnected" in line and ("node-1 " in line or "node-2 " in line)
            for line in self.log_lines()
        )


@contextlib.asynccontextmanager
async def stack(
    folder: Path,
    config: dict[str, Any],
    nodes: list[str],
    *,
    ulimit: int | None = None,
) -> AsyncIterator[Stack]:
    (folder / "edge.yaml").write_text(yaml.safe_dump(config))
    log = folder / "edge.log"
    command = [*iop(), "edge", "run", "--config", str(folder / "edge.yaml"), "--log-level", "INFO"]
    if ulimit is not None:
        command = ["/bin/sh", "-c", f'ulimit -n {ulimit} && exec "$@"', "sh", *command]
    with log.open("wb") as errors:
        edge = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=errors
        )
    result = Stack(edge, await benchkit.started_line(edge), log)
    try:
        for node_id in nodes:
            token = folder / f"{node_id}.token"
            token.write_text(node_token_of(node_id))
            result.nodes[node_id] = await asyncio.create_subprocess_exec(
                *iop(),
                *("node", "run", "--edge", f"127.0.0.1:{result.hub_port}", "--node-id", node_id),
                *("--token-file", str(token), "--log-level", "WARNING"),
            )
        wanted = sorted(
            p["id"] for n in config["nodes"] if n["id"] in nodes for p in n["providers"]
        )
        async with httpx.AsyncClient(base_url=result.url) as http:

            async def ready() -> bool:
                return bool((await http.get("/readyz")).json()["providers_available"] == wanted)

            await benchkit.until(ready, 120, 0.1)
        yield result
    finally:
        for process in [*result.nodes.values(), edge]:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 30)
                except TimeoutError:
                    process.kill()
                    await process.wait()


@dataclass
class Watch:
    """The Edge (and other processes) sampled while something runs: RSS, open files, /healthz."""

    pids: dict[str, int]
    rss: dict[str, list[float]] = field(default_factory=dict)
    files: list[int] = field(default_factory=list)
    healthz: list[float] = field(default_factory=list)
    healthz_failed: int = 0

    async def run(self, url: str, until: asyncio.Future[Any]) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            while not until.done():
                for name, pid in self.pids.items():
                    self.rss.setdefault(name, []).append(rss_mb(pid))
                self.files.append(open_files(self.pids["edge"]))
                began = time.perf_counter()
                try:
                    ok = (await http.get("/healthz")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.healthz.append(time.perf_counter() - began)
                self.healthz_failed += not ok
                await asyncio.wait([until], timeout=0.05)

    def peak(self, name: str) -> float:
        return max(self.rss.get(name, [0.0]))


async def watched(url: str, pids: dict[str, int], work: Any) -> tuple[Any, Watch]:
    """Run the awaitable `work` while watching; its result and what was seen."""
    task = asyncio.ensure_future(work)
    watch = Watch(pids)
    await watch.run(url, task)
    return await task, watch


async def hub_client(stack: Stack, *args: str, give_up: float = 60.0) -> list[dict[str, Any]]:
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        str(CHAOS / "hubclients.py"),
        args[0],
        str(stack.hub_port),
        *args[1:],
        "--give-up",
        str(give_up),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await client.communicate()
    results: list[dict[str, Any]] = orjson.loads(out) if out.strip() else []
    return results


def ended(results: list[dict[str, Any]]) -> str:
    codes: dict[str, int] = {}
    for result in results:
        codes[result["code"]] = codes.get(result["code"], 0) + 1
    worst = max((r["s"] for r in results), default=0.0)
    return f"{dict(sorted(codes.items()))}, the last after {worst:.1f}s"


FAKE = {"type": "fake", "completion_tokens": 4}
TWO_NODES = {
    "node-1": [provider("p1", FAKE)],
    "node-2": [provider("p2", FAKE)],
    "node-3": [provider("p3", FAKE)],
}


# -- parts -------------------------------------------------------------------------------------


async def hub_oversized(folder: Path) -> None:
    async with stack(folder, document(TWO_NODES), ["node-1", "node-2"]) as s:
        await asyncio.sleep(1.0)
        idle = rss_mb(s.edge.pid)
        attack = hub_client(s, "oversized", "--calls", "4", "--size", str(250 * 1024**2))
        results, watch = await watched(s.url, {"edge": s.edge.pid}, attack)
        await asyncio.sleep(2.0)
        print(
            f"hub-oversized: Edge RSS idle {idle:.0f} MB, peak {watch.peak('edge'):.0f} MB "
            f"(+{watch.peak('edge') - idle:.0f}), 2 s after {rss_mb(s.edge.pid):.0f} MB; "
            f"/healthz worst {max(watch.healthz) * 1000:.0f} ms ({watch.healthz_failed} failed); "
            f"node links lost {s.links_lost()}; calls ended: {ended(results)}"
        )


async def hub_silent(folder: Path) -> None:
    async with stack(folder, document(TWO_NODES), ["node-1", "node-2"], ulimit=300) as s:
        few = await hub_client(s, "silent", "--calls", "10", give_up=60)
        print(f"hub-silent: 10 calls without a hello ended: {ended(few)}")
        idle = rss_mb(s.edge.pid)
        results, watch = await watched(
            s.url, {"edge": s.edge.pid}, hub_client(s, "silent", "--calls", "320", give_up=60)
        )
        print(
            f"hub-silent: 320 such calls under ulimit -n 300: Edge open files peak "
            f"{max(watch.files)}; /healthz failed {watch.healthz_failed} of {len(watch.healthz)}, "
            f"worst {max(watch.healthz) * 1000:.0f} ms; Edge RSS +{watch.peak('edge') - idle:.0f} "
            f"MB; node links lost {s.links_lost()}; calls ended: {ended(results)}"
        )


async def hostage(folder: Path) -> None:
    model = {"type": "fake", "completion_tokens": 200_000, "tokens_per_second": 5000}
    nodes = {
        "node-1": [
            provider("p1", model, served="mistral-7b"),
            provider("p2", model, served="llama-8b"),
        ]
    }
    for fallback in (True, False):
        config = document(
            nodes,
            {"mistral": ["p1"], "llama": ["p2"]},
            model_settings={"mistral": {"fallbacks": ["llama"]}} if fallback else None,
        )
        async with stack(folder, config, ["node-1"]) as s:
            holders = [await _non_reading(s.url) for _ in range(8)]
            try:
                async with httpx.AsyncClient(base_url=s.started["metrics_url"]) as metrics:

                    async def held() -> bool:
                        text = (await metrics.get("/metrics")).text
                        return 'iop_edge_in_flight{provider="p1"} 8.0' in text

                    await benchkit.until(held, 60, 0.1)
                async with httpx.AsyncClient(
                    base_url=s.url, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, timeout=60
                ) as http:
                    began = time.perf_counter()
                    answer = await http.post(
                        "/v1/chat/completions", json={**BODY, "model": "mistral", "max_tokens": 5}
                    )
                    took = time.perf_counter() - began
                body = answer.json()
                who = body.get("model") or body.get("error", {}).get("code")
                print(
                    f"hostage ({'with' if fallback else 'no'} fallback): 8 non-reading clients "
                    f"hold mistral; a normal request: {answer.status_code} in {took:.2f}s "
                    f"({who})"
                )
            finally:
                for writer in holders:
                    writer.close()


async def _non_reading(url: str) -> asyncio.StreamWriter:
    """A client (from 127.0.0.2) that asks `mistral` for a long stream and reads nothing."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind(("127.0.0.2", 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    _, writer = await asyncio.open_connection(sock=sock, limit=8 * 1024)
    body = orjson.dumps({**BODY, "model": "mistral", "stream": True, "max_tokens": 200_000})
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer " + CLIENT_TOKEN.encode() + b"\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    await writer.drain()
    return writer


async def big_answer(folder: Path) -> None:
    upstream = await asyncio.create_subprocess_exec(
        sys.executable, str(CHAOS / "hostileupstream.py"), stdout=asyncio.subprocess.PIPE
    )
    try:
        port = (await benchkit.started_line(upstream, "the upstream"))["port"]
        adapter = {"type": "openai", "base_url": f"http://127.0.0.1:{port}/v1"}
        modes = ("length", "chunked")
        nodes = {
            "node-1": [
                provider(f"p-{mode}", adapter, served=mode, health={"interval_ms": 0})
                for mode in modes
            ]
        }
        models = {mode: [f"p-{mode}"] for mode in modes}
        async with stack(folder, document(nodes, models), ["node-1"]) as s:
            node = s.nodes["node-1"].pid
            for mode in modes:
                await asyncio.sleep(2.0)  # what the previous one freed, given back
                idle = {"edge": rss_mb(s.edge.pid), "node": rss_mb(node)}
                async with httpx.AsyncClient(
                    base_url=s.url, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, timeout=300
                ) as http:
                    began = time.perf_counter()
                    answer, watch = await watched(
                        s.url,
                        {"edge": s.edge.pid, "node": node},
                        http.post("/v1/chat/completions", json={**BODY, "model": mode}),
                    )
                    took = time.perf_counter() - began
                error = answer.json().get("error", {}) if answer.status_code != 200 else {}
                print(
                    f"big-answer ({mode}): 108 MB non-streamed: {answer.status_code} "
                    f"{error.get('code', '')} in {took:.2f}s; Node RSS "
                    f"+{watch.peak('node') - idle['node']:.0f} MB, Edge RSS "
                    f"+{watch.peak('edge') - idle['edge']:.0f} MB; /healthz worst "
                    f"{max(watch.healthz) * 1000:.0f} ms"
                )
    finally:
        upstream.terminate()
        await upstream.wait()


async def log_flood(folder: Path) -> None:
    async with stack(folder, document(TWO_NODES), ["node-1", "node-2"]) as s:
        for label, refusal in (("5 refusals of 20 MiB", 20 * 1024**2), ("message-sized", 0)):
            before = s.log.stat().st_size
            lines = len(s.log_lines())
            idle = rss_mb(s.edge.pid)
            results, watch = await watched(
                s.url,
                {"edge": s.edge.pid},
                hub_client(
                    s,
                    "flood",
                    "--node-id",
                    "node-3",
                    "--token",
                    node_token_of("node-3"),
                    "--refusal-bytes",
                    str(refusal),
                ),
            )
            await asyncio.sleep(1.0)
            print(
                f"log-flood ({label}, then 100,000 unknown providers' health): log "
                f"+{(s.log.stat().st_size - before) / 1024:.0f} KiB in "
                f"{len(s.log_lines()) - lines} lines; Edge RSS +{watch.peak('edge') - idle:.0f} "
                f"MB; the attacker: {ended(results)}"
            )


async def wrong_tokens(folder: Path) -> None:
    async with stack(folder, document(TWO_NODES), ["node-1"]) as s:
        lines = len(s.log_lines())
        counts: dict[int, int] = {}
        stop = time.monotonic() + 10

        async def guesser(worker: int) -> None:
            transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
            async with httpx.AsyncClient(base_url=s.url, transport=transport) as http:
                attempt = 0
                while time.monotonic() < stop:
                    attempt += 1
                    answer = await http.get(
                        "/v1/models",
                        headers={"authorization": f"Bearer sk-guess-{worker}-{attempt}"},
                    )
                    counts[answer.status_code] = counts.get(answer.status_code, 0) + 1

        await asyncio.gather(*(guesser(worker) for worker in range(4)))
        new = s.log_lines()[lines:]
        about = [line for line in new if "authentication" in line]
        leaked = any("sk-guess-" in line for line in new)
        rates = {status: f"{count / 10:.0f}/s" for status, count in sorted(counts.items())}
        print(
            f"wrong-tokens: 4 connections for 10 s: {rates}; {len(about)} log lines about it; "
            f"a key in the log: {leaked}"
        )


async def transfer_encoding(folder: Path) -> None:
    async with stack(folder, document(TWO_NODES), ["node-1"]) as s:
        host, port = s.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json"
            b"\r\nauthorization: Bearer " + CLIENT_TOKEN.encode() + b"\r\n"
            b"transfer-encoding: gzip\r\n\r\n\x1f\x8b\x08\x00not-really"
        )
        began = time.perf_counter()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
            what = head.decode().strip()
        except (TimeoutError, asyncio.IncompleteReadError):
            what = "no answer"
        writer.close()
        print(
            f"transfer-encoding: gzip without chunked: {what} in {time.perf_counter() - began:.3f}s"
        )


async def _hostile_upstream() -> tuple[asyncio.subprocess.Process, int]:
    upstream = await asyncio.create_subprocess_exec(
        sys.executable, str(CHAOS / "hostileupstream.py"), stdout=asyncio.subprocess.PIPE
    )
    return upstream, (await benchkit.started_line(upstream, "the upstream"))["port"]


@contextlib.asynccontextmanager
async def placed(
    folder: Path, port: int, modes: tuple[str, ...], read_timeout_s: float
) -> AsyncIterator[Stack]:
    """An Edge running a provider per mode itself (`placement: edge`: a stall is its own loop)
    over the hostile upstream, no retries; ready once every provider is."""
    adapter = {
        "type": "openai",
        "base_url": f"http://127.0.0.1:{port}/v1",
        "request_timeout_s": read_timeout_s,
    }
    nodes = {
        "local": [
            provider(f"p-{mode}", adapter, served=mode, health={"interval_ms": 0}) for mode in modes
        ]
    }
    config = document(
        nodes,
        {mode: [f"p-{mode}"] for mode in modes},
        placement="edge",
        openai={"retries": {"max_per_request": 0}},
    )
    (folder / "edge.yaml").write_text(yaml.safe_dump(config))
    log = folder / "edge.log"
    with log.open("wb") as errors:
        command = [*iop(), "edge", "run", "--config", str(folder / "edge.yaml")]
        edge = await asyncio.create_subprocess_exec(
            *command, "--log-level", "INFO", stdout=asyncio.subprocess.PIPE, stderr=errors
        )
    try:
        result = Stack(edge, await benchkit.started_line(edge), log)
        async with httpx.AsyncClient(base_url=result.url) as http:

            async def ready() -> bool:
                available = (await http.get("/readyz")).json()["providers_available"]
                return len(available) == len(modes)

            await benchkit.until(ready, 120, 0.1)
        yield result
    finally:
        edge.terminate()
        try:
            await asyncio.wait_for(edge.wait(), 30)
        except TimeoutError:
            edge.kill()
            await edge.wait()


def _outcome(answer: httpx.Response | None, took: float) -> str:
    if answer is None:
        return f"no answer in {took:.0f}s"
    if answer.status_code == 200:
        return f"200 in {took:.2f}s"
    message = str(answer.json().get("error", {}).get("message", ""))
    return f"{answer.status_code} in {took:.2f}s ({message[:130]})"


async def _chat(http: httpx.AsyncClient, model: str, give_up: float) -> tuple[str, float]:
    began = time.perf_counter()
    try:
        answer: httpx.Response | None = await asyncio.wait_for(
            http.post("/v1/chat/completions", json={**BODY, "model": model}), give_up
        )
    except TimeoutError:
        answer = None
    took = time.perf_counter() - began
    return _outcome(answer, took), took


async def upstream_heads(folder: Path) -> None:
    modes = ("long-header", "many-headers", "continues")
    what = {
        "long-header": "one 64 MiB header",
        "many-headers": "100 MB of small headers",
        "continues": "2 million 100 Continue",
    }
    upstream, port = await _hostile_upstream()
    try:
        async with placed(folder, port, modes, 600.0) as s:
            for mode in modes:
                await asyncio.sleep(2.0)  # what the previous one freed, given back
                idle = rss_mb(s.edge.pid)
                async with httpx.AsyncClient(
                    base_url=s.url,
                    headers={"authorization": f"Bearer {CLIENT_TOKEN}"},
                    timeout=None,
                ) as http:
                    (outcome, _), watch = await watched(
                        s.url, {"edge": s.edge.pid}, _chat(http, mode, 180)
                    )
                await asyncio.sleep(2.0)
                print(
                    f"upstream-heads ({what[mode]}): {outcome}; /healthz worst "
                    f"{max(watch.healthz) * 1000:.0f} ms; Edge RSS +{watch.peak('edge') - idle:.0f}"
                    f" MB at the peak, +{rss_mb(s.edge.pid) - idle:.0f} MB 2 s after"
                )
    finally:
        upstream.terminate()
        await upstream.wait()


async def upstream_framing(folder: Path) -> None:
    modes = ("idle-bytes", "cr", "redirect", "status-000", "status-099", "comments")
    read_timeout = 10.0
    upstream, port = await _hostile_upstream()
    try:
        async with (
            placed(folder, port, modes, read_timeout) as s,
            httpx.AsyncClient(
                base_url=s.url, headers={"authorization": f"Bearer {CLIENT_TOKEN}"}, timeout=None
            ) as http,
        ):
            first, _ = await _chat(http, "idle-bytes", 60)
            await asyncio.sleep(1.0)  # the stray head reaches the idle connection
            second, _ = await _chat(http, "idle-bytes", 60)
            print(f"upstream-framing (bytes on an idle connection): {first}, the next: {second}")
            async with http.stream(
                "POST", "/v1/chat/completions", json={**BODY, "model": "cr", "stream": True}
            ) as response:
                received = b"".join([piece async for piece in response.aiter_raw()])
            lines = [line for line in received.replace(b"\r", b"\n").split(b"\n") if line]
            slipped = [line[:20] for line in lines if not line.startswith(b"data: ")]
            crs = received.count(b"\r")
            print(
                f"upstream-framing (a lone CR in a data line): {response.status_code}; lone CRs "
                f"at the client {crs}, fields slipped in {slipped}"
            )
            for mode in ("redirect", "status-000", "status-099"):
                outcome, _ = await _chat(http, mode, 60)
                print(f"upstream-framing ({mode}): {outcome}")
            began = time.perf_counter()
            try:
                async with asyncio.timeout(60):
                    async with http.stream(
                        "POST",
                        "/v1/chat/completions",
                        json={**BODY, "model": "comments", "stream": True},
                    ) as response:
                        received = b"".join([piece async for piece in response.aiter_raw()])
                ended = f"{response.status_code}, {len(received)} bytes to the client"
            except TimeoutError:
                ended = "still open, nothing for the client"
            print(
                f"upstream-framing (only SSE comments, request_timeout_s {read_timeout:g}): "
                f"{ended} after {time.perf_counter() - began:.1f}s"
            )
    finally:
        upstream.terminate()
        await upstream.wait()


# -- bodies and budgets that could be gamed (docs/reliability.md) -----------------------------


def tiny_messages(count: int) -> bytes:
    """A chat body of `count` tiny messages (600k: 7.8 MB, within the 8 MiB limit)."""
    return (
        b'{"model":"m","messages":['
        + b'{"role":"u"},' * count
        + (b'{"role":"user","content":"hi"}]}')
    )


AUTH = {"authorization": f"Bearer {CLIENT_TOKEN}", "content-type": "application/json"}


async def attack(
    http: httpx.AsyncClient, path: str, raw: bytes, at_once: int
) -> tuple[list[int], int, float]:
    """`at_once` posts of `raw` and an ordinary chat together: their statuses, how long."""
    posts = [http.post(path, content=raw) for _ in range(at_once)]
    began = time.perf_counter()
    ordinary = http.post("/v1/chat/completions", json={"model": "m", **BODY})
    *answers, normal = await asyncio.gather(*posts, ordinary)
    return [a.status_code for a in answers], normal.status_code, time.perf_counter() - began


async def big_bodies(folder: Path) -> None:
    """One, then four at once, of each body: and one ordinary chat during the four."""
    bodies = {
        "600k messages": ("/v1/chat/completions", tiny_messages(600_000)),
        "2M one-element lists": (
            "/v1/embeddings",
            b'{"model":"m","input":[' + b"[1]," * 2_000_000 + b"[1]]}",
        ),
    }
    async with stack(folder, document(TWO_NODES), ["node-1"]) as s:
        pids = {"edge": s.edge.pid}
        async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=120) as http:
            for label, (path, raw) in bodies.items():
                for at_once in (1, 4):
                    idle = rss_mb(s.edge.pid)

                    (codes, normal, took), watch = await watched(
                        s.url, pids, attack(http, path, raw, at_once)
                    )
                    print(
                        f"big-bodies: {label} x{at_once}: {codes} in {took:.2f}s; an ordinary "
                        f"chat meanwhile {normal}; /healthz worst {max(watch.healthz) * 1000:.0f} "
                        f"ms; Edge RSS +{watch.peak('edge') - idle:.0f} MB at its peak"
                    )


async def cut_streams(folder: Path) -> None:
    """10 streams of 420 tokens, each cut by its client 10 events before its end."""
    model = {"type": "fake", "completion_tokens": 420, "tokens_per_second": 2000}
    config = document(
        {"node-1": [provider("p1", model)]},
        limits=[
            {"principal_ref": "team-search", "budget": {"tokens": 10_000_000, "period": "day"}}
        ],
    )
    async with stack(folder, config, ["node-1"]) as s:
        admin = httpx.AsyncClient(base_url=s.started["admin_url"], timeout=30)
        metrics = httpx.AsyncClient(base_url=s.started["metrics_url"], timeout=30)

        async def used() -> int:
            entries = (await admin.get("/status")).json()["limits"]["entries"]
            return int(entries[0]["use"]["budget_used"])

        async def completion_tokens() -> float:
            text = (await metrics.get("/metrics")).text
            return sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("iop_edge_completion_tokens_total{")
            )

        before, tokens_before = await used(), await completion_tokens()
        events = 0
        async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=30) as http:
            for _ in range(10):
                body = {"model": "m", **BODY, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                    read = 0
                    async for line in answer.aiter_lines():
                        if line.startswith("data: {"):
                            read += 1
                            if read == 410:
                                break
                    events += read
        await asyncio.sleep(1.0)
        print(
            f"cut-streams: 10 streams cut after {events} events in all: the budget moved by "
            f"{await used() - before}, iop_edge_completion_tokens_total by "
            f"{await completion_tokens() - tokens_before:.0f}"
        )
        await admin.aclose()
        await metrics.aclose()


async def tools_burst(folder: Path) -> None:
    """20 concurrent chats with 20 KB (then 2 KB) in `tools` against 4,000 tokens a minute."""
    model = {"type": "fake", "completion_tokens": 4, "latency_ms": 1000}
    for size in (20_000, 2_000):
        config = document(
            {"node-1": [provider("p1", model, capacity=32)]},
            limits=[{"principal_ref": "team-search", "tokens_per_minute": 4_000}],
        )
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "search",
                    "description": "lorem ipsum " * (size // 12),
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ]
        async with stack(folder, config, ["node-1"]) as s:
            body = {"model": "m", **BODY, "tools": tools, "max_tokens": 4}
            async with httpx.AsyncClient(base_url=s.url, headers=AUTH, timeout=60) as http:
                answers = await asyncio.gather(
                    *(http.post("/v1/chat/completions", json=body) for _ in range(20))
                )
            admitted = [a for a in answers if a.status_code == 200]
            read = sum(len(orjson.dumps(tools)) // 4 for _ in admitted)
            async with httpx.AsyncClient(base_url=s.started["admin_url"], timeout=30) as admin:
                entries = (await admin.get("/status")).json()["limits"]["entries"]
            print(
                f"tools-burst: 20 at once with {size // 1000} KB of tools: {len(admitted)} "
                f"admitted (about {read:,} tokens of tools the model reads), "
                f"{sum(a.status_code == 429 for a in answers)} refused 429; the bucket after: "
                f"{entries[0]['use']['tokens_available']}"
            )


async def limit_store(folder: Path) -> None:
    """The shared limit store's stalls: `bench/limitstore.py`, every case."""
    await limitstore.main(limitstore.parse([]))


PARTS = {
    "hub-oversized": hub_oversized,
    "hub-silent": hub_silent,
    "hostage": hostage,
    "big-answer": big_answer,
    "log-flood": log_flood,
    "wrong-tokens": wrong_tokens,
    "transfer-encoding": transfer_encoding,
    "upstream-heads": upstream_heads,
    "upstream-framing": upstream_framing,
    "big-bodies": big_bodies,
    "cut-streams": cut_streams,
    "tools-burst": tools_burst,
    "limit-store": limit_store,
}


async def main(only: list[str]) -> None:
    for name, part in PARTS.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory(prefix=f"iop-bench-{name}-") as folder:
            await part(Path(folder))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], choices=list(PARTS))
    uvloop.run(main(parser.parse_args().only))
