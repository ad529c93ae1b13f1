"""Benchmark: the reliability figures of docs/reliability.md, each fault injected into real
processes under load.

    uv run --frozen python -m bench.reliability [--rounds 5] [--only NAME ...]

Processes as deployed (`iop edge run`, `iop node run`, `iop fake-upstream`), plaintext links (the
figures are about timing and memory, not TLS). Each part prints its figures; every part that
runs a load also counts what it lost.

- frozen-node: two nodes (node-1 preferred), a load of plain requests and streams; node-1 is
  frozen (SIGSTOP) each round. Detection: until /readyz drops its provider. Moved: the longest
  a plain request took that was in flight or sent while node-1 was frozen (it waits for the
  detection, then runs on node-2). Streams that had sent bytes fail fast: time to their error.
  Then SIGCONT, and the time until node-1 serves again.
- keepalive: the same freeze with heartbeats all but off (a minute's deadline): how long the
  HTTP/2 keepalive ping (the transport's backstop) takes to close the frozen node's link.
- frozen-edge: an Edge process frozen under a Node (in this process) that also serves a second
  Edge: time until the Node leaves it, and whether the other Edge kept being served.
- slow-clients: streams whose clients stop reading (answers of about 35 MB from a model at
  20,000 tokens/s): how much the Edge and the Node grow, with the default bounded buffers and,
  as the peer, with buffers that never fill (the behaviour before the bound).
- rollout: a surge rollout of a node (new process, then SIGTERM to the old one) under load:
  requests lost, the old process's drain time, sessions the Edge opened.
- headers: a 64 MiB request header, sent as fast as possible: bytes the Edge took before its
  431, and /healthz latency meanwhile against before.
- yaml: time to refuse a "billion laughs" config text (dry run on the admin API).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvloop
import yaml

from bench import benchkit
from iop.node import NodeAgent
from iop.processes import spawn_edge, spawn_fake_upstream, spawn_node, terminate
from testkit import CLIENT_TOKEN, edge_document, node_token_of
from testkit import provider as provider_entry


def document(providers: dict[str, list[dict[str, Any]]], **openai: Any) -> dict[str, Any]:
    """node id -> its providers; model `m` maps every provider (serving `served`)."""
    return edge_document(providers, admin=True, openai=openai)


#: A provider entry (testkit's `provider`) of capacity 64.
provider = functools.partial(provider_entry, capacity=64)


@contextlib.asynccontextmanager
async def stack(
    folder: Path, config: dict[str, Any], nodes: list[str]
) -> AsyncIterator[tuple[dict[str, Any], dict[str, asyncio.subprocess.Process]]]:
    (folder / "edge.yaml").write_text(yaml.safe_dump(config))
    edge, started = await spawn_edge(folder / "edge.yaml")
    started["process"] = edge
    processes: dict[str, asyncio.subprocess.Process] = {}
    try:
        for node_id in nodes:
            token = folder / f"{node_id}.token"
            token.write_text(node_token_of(node_id))
            processes[node_id] = await spawn_node(started["hub_port"], node_id, token)
        yield started, processes
    finally:
        for process in processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            await terminate(process)
        await terminate(edge)


async def available(http: httpx.AsyncClient) -> list[str]:
    ready: list[str] = (await http.get("/readyz")).json()["providers_available"]
    return ready


def client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url,
        headers={"authorization": f"Bearer {CLIENT_TOKEN}"},
        timeout=120,
        limits=httpx.Limits(max_connections=200),
    )


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Load:
    """Plain-request workers and streaming workers, back to back, until stopped."""

    def __init__(self, http: httpx.AsyncClient, plain: int, streams: int) -> None:
        self.http = http
        #: (started, ended, ok, kind, detail)
        self.outcomes: list[tuple[float, float, bool, str, str]] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._plain()) for _ in range(plain)]
        self._tasks += [asyncio.create_task(self._stream()) for _ in range(streams)]

    async def _plain(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                response = await self.http.post("/v1/chat/completions", json=BODY)
                ok, detail = response.status_code == 200, response.text[-200:]
            except httpx.HTTPError as exc:
                ok, detail = False, repr(exc)
            self.outcomes.append((started, time.monotonic(), ok, "plain", detail))

    async def _stream(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            text = ""
            try:
                async with self.http.stream(
                    "POST", "/v1/chat/completions", json={**BODY, "stream": True}
                ) as response:
                    async for part in response.aiter_text():
                        text += part
                ok = response.status_code == 200 and text.rstrip().endswith("[DONE]")
                ok = ok and '"error"' not in text
            except httpx.HTTPError as exc:
                ok, text = False, repr(exc)
            self.outcomes.append((started, time.monotonic(), ok, "stream", text[-200:]))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def failed(self, kind: str | None = None) -> list[tuple[float, float, bool, str, str]]:
        return [o for o in self.outcomes if not o[2] and (kind is None or o[3] == kind)]


def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (
        f"median {statistics.median(values):.2f}s (min {min(values):.2f}, max {max(values):.2f}, "
        f"n={len(values)})"
    )


# -- parts -------------------------------------------------------------------------------------


async def frozen_node(folder: Path, rounds: int) -> None:
    paced = {"type": "fake", "latency_ms": 50, "tokens_per_second": 40, "completion_tokens": 20}
    config = document(
        {
            "node-1": [provider("p1", paced, priority=0)],
            "node-2": [provider("p2", paced, priority=10)],
        }
    )
    async with stack(folder, config, ["node-1", "node-2"]) as (started, nodes):
        async with client(started["url"]) as http:
            await benchkit.until(lambda: _both(http), 30)
            load = Load(http, plain=8, streams=4)
            detect, moved, cut, back = [], [], [], []
            try:
                for _ in range(rounds):
                    await asyncio.sleep(1.0)
                    os.kill(nodes["node-1"].pid, signal.SIGSTOP)
                    frozen = time.monotonic()

                    async def p1_gone() -> bool:
                        return "p1" not in await available(http)

                    detect.append(await benchkit.until(p1_gone, 30) - frozen)
                    await asyncio.sleep(1.0)
                    os.kill(nodes["node-1"].pid, signal.SIGCONT)
                    resumed = time.monotonic()
                    back.append(await benchkit.until(lambda: _both(http), 30) - resumed)
                    # Plain requests in flight at the freeze or sent while frozen: how long the
                    # worst one took (it waited for the detection, then ran on node-2).
                    during = [
                        end - start
                        for start, end, ok, kind, _ in load.outcomes
                        if kind == "plain" and start <= frozen + detect[-1] and end >= frozen
                    ]
                    moved.append(max(during))
                    cut += [
                        end - frozen
                        for start, end, ok, kind, _ in load.outcomes
                        if kind == "stream" and not ok and start < frozen <= end
                    ]
            finally:
                await load.stop()
    print("frozen node (SIGSTOP), heartbeat 0.5 s / deadline 2 s:")
    print(f"  detected (dropped from /readyz): {summary(detect)}")
    print(f"  worst plain request in flight or sent while frozen: {summary(moved)}")
    print(f"  streams that had sent bytes, failed fast after: {summary(cut)}")
    print(f"  back in dispatch after SIGCONT: {summary(back)}")
    lost = load.failed("plain")
    print(
        f"  requests: {len(load.outcomes)}; plain requests lost: {len(lost)}; streams cut: "
        f"{len(load.failed('stream'))} (each had sent bytes before its node froze)"
    )


async def keepalive(folder: Path, rounds: int) -> None:
    config = document(
        {
            "node-1": [provider("p1", {"type": "fake"}, priority=0)],
            "node-2": [provider("p2", {"type": "fake"}, priority=10)],
        }
    )
    config["edge"]["node_link"] = {"heartbeat_interval_ms": 20_000, "heartbeat_timeout_ms": 60_000}
    closed = []
    async with stack(folder, config, ["node-1", "node-2"]) as (started, nodes):
        async with client(started["url"]) as http:
            for _ in range(rounds):
                await benchkit.until(lambda: _both(http), 30)
                await asyncio.sleep(1.0)
                os.kill(nodes["node-1"].pid, signal.SIGSTOP)
                frozen = time.monotonic()

                async def p1_gone() -> bool:
                    return "p1" not in await available(http)

                closed.append(await benchkit.until(p1_gone, 60) - frozen)
                os.kill(nodes["node-1"].pid, signal.SIGCONT)
    print(f"frozen node, heartbeats off, HTTP/2 keepalive alone: link closed {summary(closed)}")


async def _both(http: httpx.AsyncClient) -> bool:
    return await available(http) == ["p1", "p2"]


async def frozen_edge(folder: Path, rounds: int) -> None:
    slow = {"type": "fake", "tokens_per_second": 20, "completion_tokens": 1000}
    config = document({"node-1": [provider("p1", slow)]})
    async with stack(folder, config, []) as (started, _):
        edge = started["process"]
        async with NodeAgent(
            node_id="node-1",
            token=node_token_of("node-1"),
            edges=[f"127.0.0.1:{started['hub_port']}"],
            backoff_initial=0.05,
            backoff_max=0.5,
        ) as agent:
            await agent.wait_connected()
            (link,) = agent.connections.values()
            detect, cancelled = [], []
            async with client(started["url"]) as http:
                for _ in range(rounds):
                    await benchkit.until(lambda: _ready(http), 30)
                    streaming = asyncio.create_task(_one_stream(http))
                    await benchkit.until(lambda: agent.runner.running == 1, 30)
                    target = link.silences + 1
                    os.kill(edge.pid, signal.SIGSTOP)
                    frozen = time.monotonic()
                    detect.append(
                        await benchkit.until(functools.partial(_left, link, target), 30) - frozen
                    )
                    cancelled.append(
                        await benchkit.until(lambda: agent.runner.running == 0, 30) - frozen
                    )
                    os.kill(edge.pid, signal.SIGCONT)
                    streaming.cancel()
                    await asyncio.gather(streaming, return_exceptions=True)
    print("frozen Edge (SIGSTOP), seen from its Node:")
    print(f"  the Node left it: {summary(detect)}")
    print(f"  its runs cancelled (capacity free for other Edges): {summary(cancelled)}")


def _left(link: Any, silences: int) -> bool:
    return bool(link.silences >= silences)


async def _ready(http: httpx.AsyncClient) -> bool:
    try:
        return await available(http) == ["p1"]
    except httpx.HTTPError:
        return False


async def _one_stream(http: httpx.AsyncClient) -> None:
    with contextlib.suppress(httpx.HTTPError):
        async with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                pass


async def slow_clients(folder: Path, rounds: int) -> None:
    del rounds
    async with spawn_fake_upstream(
        ["--tokens-per-second", "20000", "--completion-tokens", "200000"]
    ) as upstream:
        adapter = {"type": "openai", "base_url": upstream.base_url}
        for label, buffer in (("bounded (default)", None), ("unbounded (peer)", 1 << 30)):
            extra: dict[str, Any] = {"send_timeout_ms": 600_000}
            if buffer is not None:
                extra["stream_buffer_bytes"] = buffer
            config = document({"node-1": [provider("p1", adapter)]}, **extra)
            async with stack(folder, config, ["node-1"]) as (started, nodes):
                async with client(started["url"]) as http:
                    await benchkit.until(lambda: _ready(http), 30)
                    edge_pid, node_pid = started["process"].pid, nodes["node-1"].pid
                    before = (benchkit.rss_kib(edge_pid), benchkit.rss_kib(node_pid))
                    sockets = [await _stalled(started["url"]) for _ in range(4)]
                    peak = before
                    for _ in range(40):  # 10 s
                        await asyncio.sleep(0.25)
                        rss = (benchkit.rss_kib(edge_pid), benchkit.rss_kib(node_pid))
                        peak = (max(peak[0], rss[0]), max(peak[1], rss[1]))
                    for sock in sockets:
                        sock.close()
            grown = [(high - low) / 1024 for high, low in zip(peak, before, strict=True)]  # MB
            print(
                f"slow clients, 4 stopped readers of ~35 MB answers for 10 s, {label}: Edge "
                f"+{grown[0]:.0f} MB, Node +{grown[1]:.0f} MB"
            )


async def _stalled(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = orjson.dumps({**BODY, "stream": True, "max_tokens": 200_000})
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {CLIENT_TOKEN}\r\n".encode()
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )
    return sock


async def rollout(folder: Path, rounds: int) -> None:
    paced = {"type": "fake", "latency_ms": 20, "tokens_per_second": 100, "completion_tokens": 20}
    config = document({"node-1": [provider("p1", paced)]})
    async with stack(folder, config, ["node-1"]) as (started, nodes):
        async with client(started["url"]) as http:
            await benchkit.until(lambda: _ready(http), 30)
            load = Load(http, plain=8, streams=8)
            drains = []
            old = nodes["node-1"]
            token = folder / "node-1.token"
            try:
                for _ in range(rounds):
                    await asyncio.sleep(1.0)
                    new = await spawn_node(started["hub_port"], "node-1", token)
                    await asyncio.sleep(1.5)  # the new one connects and takes dispatch over
                    old.send_signal(signal.SIGTERM)
                    sent = time.monotonic()
                    await asyncio.wait_for(old.wait(), 60)
                    drains.append(time.monotonic() - sent)
                    old = new
                    nodes["node-1"] = new
            finally:
                await load.stop()
    print(f"surge rollout of a node under load, {rounds} rollouts:")
    print(f"  requests {len(load.outcomes)}, lost {len(load.failed())}")
    print(f"  old process drained and exited after SIGTERM: {summary(drains)}")


async def headers(folder: Path, rounds: int) -> None:
    del rounds
    config = document({"node-1": [provider("p1", {"type": "fake"})]})
    async with stack(folder, config, []) as (started, _):
        host, port = started["url"].removeprefix("http://").rsplit(":", 1)
        async with httpx.AsyncClient(base_url=started["url"]) as http:
            before = [await _latency(http) for _ in range(20)]
            sock = socket.create_connection((host, int(port)))
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_sendall(sock, b"GET /healthz HTTP/1.1\r\nhost: e\r\nx-big: ")
            sent, piece, during, answer = 0, b"a" * 65536, [], b""
            try:
                while sent < 64 * 1024 * 1024 and not answer:
                    await loop.sock_sendall(sock, piece)
                    sent += len(piece)
                    with contextlib.suppress(BlockingIOError):
                        answer = sock.recv(65536)
                    if sent % (1 << 20) == 0:
                        during.append(await _latency(http))
            except (BrokenPipeError, ConnectionResetError):
                pass
            sock.close()
    print(
        f"64 MiB header: {answer[:12].decode(errors='replace')!r} once the client had pushed "
        f"{sent / 1024:.0f} KiB (kernel buffers included); /healthz p50 "
        f"{statistics.median(before) * 1000:.1f} ms before, max "
        f"{max(during, default=0) * 1000:.1f} ms during"
    )


async def _latency(http: httpx.AsyncClient) -> float:
    started = time.perf_counter()
    await http.get("/healthz")
    return time.perf_counter() - started


async def yaml_bomb(folder: Path, rounds: int) -> None:
    bomb = "a: &a [x,x,x,x,x,x,x,x,x]\n"
    for parent, name in zip("abcdefgh", "bcdefghi", strict=True):
        bomb += f"{name}: &{name} [{','.join([f'*{parent}'] * 9)}]\n"
    config = document({"node-1": [provider("p1", {"type": "fake"})]})
    async with stack(folder, config, []) as (started, _):
        async with httpx.AsyncClient(base_url=started["admin_url"], timeout=60) as admin:
            times = []
            for _ in range(rounds):
                began = time.perf_counter()
                answer = await admin.post("/refresh", json={"mode": "dry_run", "config_yaml": bomb})
                times.append(time.perf_counter() - began)
                assert answer.status_code == 422
    print(f"billion laughs in config_yaml: refused (422) in {summary(times)}")


PARTS = {
    "frozen-node": frozen_node,
    "keepalive": keepalive,
    "frozen-edge": frozen_edge,
    "slow-clients": slow_clients,
    "rollout": rollout,
    "headers": headers,
    "yaml": yaml_bomb,
}


async def main(rounds: int, only: list[str]) -> None:
    for name, part in PARTS.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory(prefix=f"iop-bench-{name}-") as folder:
            await part(Path(folder), rounds)
        sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=[], choices=sorted(PARTS))
    args = parser.parse_args()
    uvloop.run(main(args.rounds, args.only))
