"""Benchmark: HTTP clients for the Node's `openai` adapter, side by side against the fake upstream.

    uv run --frozen python -m bench.studies.http_clients [--rounds 3] [--seconds 3]
        [--concurrency 1 32]

The Node's adapter spends most of its CPU in its HTTP client (docs/benchmarks.md), so this
measures the client alone, the way the adapter uses it: one client with a keep-alive pool per
upstream, a JSON POST per run, the body read whole or, for streams, chunk by chunk as it
arrives. Candidates: aiohttp (today), aiosonic and pyreqwest (Rust's reqwest and hyper behind a
Python API). They are installed, pinned, into a virtual environment of their own under a cache
directory (`--cache`, default `$XDG_CACHE_HOME/iop-bench/http-clients`), never into the
project's; this script starts `iop fake-upstream` and runs itself in that environment
(`--inner`), where the clients take turns within each round.

It prints, per mode and concurrency: requests/s (median of the rounds), p50, p99 and the CPU
time the client's process spent per request (every thread, from the process's CPU clock), and
each candidate's ratio to aiohttp. Figures go to docs/benchmarks.md ("## Where the tail comes
from").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import benchkit

PACKAGES = ["aiohttp==3.14.5", "aiosonic==1.3.3", "pyreqwest==0.15.1", "uvloop==0.23.0"]
CLIENTS = ("aiohttp", "aiosonic", "pyreqwest")
BODY = {
    "model": "served",
    "messages": [{"role": "user", "content": "Say something about gateways."}],
    "max_tokens": 8,
}


# -- inside the candidates' environment ------------------------------------------------------------

One = Callable[[bool], Awaitable[bool]]


async def make_client(name: str, url: str, pool: int) -> tuple[One, Callable[[], Awaitable[None]]]:
    """(one request, close) for client `name`: POST the body, read the answer as the adapter."""
    headers = {"content-type": "application/json", "accept": "application/json"}
    bodies = {s: json.dumps({**BODY, "stream": s}).encode() for s in (False, True)}
    if name == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=pool, keepalive_timeout=4.0),
            headers=headers,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

        async def one_aiohttp(stream: bool) -> bool:
            response = await session.post(url, data=bodies[stream], allow_redirects=False)
            try:
                if stream:
                    last = b""
                    while piece := await response.content.readany():
                        last = piece
                    return last.endswith(b"[DONE]\n\n")
                return b"choices" in await response.read()
            finally:
                response.close()

        return one_aiohttp, session.close
    if name == "aiosonic":
        import aiosonic
        from aiosonic.pools import PoolConfig

        pools = {":default": PoolConfig(size=pool, max_conn_requests=None)}
        client = aiosonic.HTTPClient(connector=aiosonic.TCPConnector(pool_configs=pools))

        async def one_aiosonic(stream: bool) -> bool:
            response = await client.post(url, data=bodies[stream], headers=headers)
            if stream:
                last = b""
                async for piece in response.read_chunks():
                    last = piece
                return last.endswith(b"[DONE]\n\n")
            return b"choices" in await response.content()

        async def close_aiosonic() -> None:
            await client.connector.cleanup()

        return one_aiosonic, close_aiosonic
    from pyreqwest.client import ClientBuilder

    reqwest = ClientBuilder().max_connections(pool).default_headers(headers).build()

    async def one_pyreqwest(stream: bool) -> bool:
        request = reqwest.post(url).body_bytes(bodies[stream])
        if stream:
            async with request.build_streamed() as response:
                reader = response.body_reader
                last = b""
                while (piece := await reader.read_chunk()) is not None:
                    last = bytes(piece)
                return last.endswith(b"[DONE]\n\n")
        answer = await request.build().send()
        return b"choices" in bytes(await answer.bytes())

    return one_pyreqwest, reqwest.close


async def inner(url: str, rounds: int, seconds: float, concurrencies: list[int]) -> None:
    results: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    loop = asyncio.get_running_loop()
    for round_ in range(rounds):
        for stream in (False, True):
            for conc in concurrencies:
                turn = CLIENTS[round_ % 3 :] + CLIENTS[: round_ % 3]
                for name in turn:
                    one, close = await make_client(name, url, max(conc, 1))
                    latencies: list[float] = []
                    errors: list[int] = []

                    async def worker(
                        until: float,
                        one: One = one,
                        stream: bool = stream,
                        lat: list[float] = latencies,
                        errors: list[int] = errors,
                    ) -> None:
                        while loop.time() < until:
                            start = time.perf_counter()
                            if await one(stream):
                                lat.append((time.perf_counter() - start) * 1000)
                            else:
                                errors.append(1)

                    until = loop.time() + 0.3
                    await asyncio.gather(*(worker(until) for _ in range(conc)))  # warm-up
                    latencies.clear()
                    errors.clear()
                    cpu, began = time.process_time(), time.perf_counter()
                    until = loop.time() + seconds
                    await asyncio.gather(*(worker(until) for _ in range(conc)))
                    elapsed = time.perf_counter() - began
                    cpu = time.process_time() - cpu
                    await close()
                    key = f"{'stream' if stream else 'whole'}|{conc}|{name}"
                    results[key]["rps"].append(len(latencies) / elapsed)
                    results[key]["cpu_us"].append(cpu / max(len(latencies), 1) * 1e6)
                    results[key]["latencies"].extend(latencies)
                    results[key]["errors"].append(len(errors))
    summary = {}
    for key, values in results.items():
        lat = sorted(values["latencies"])
        summary[key] = {
            "rps": statistics.median(values["rps"]),
            "cpu_us": statistics.median(values["cpu_us"]),
            "p50": lat[len(lat) // 2] if lat else float("nan"),
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
            "errors": sum(values["errors"]),
        }
    print(json.dumps(summary))


# -- outside ---------------------------------------------------------------------------------------


async def outer(args: argparse.Namespace, python: Path) -> dict[str, dict[str, float]]:
    from iop.processes import spawn_fake_upstream

    async with spawn_fake_upstream() as upstream:
        process = await asyncio.create_subprocess_exec(
            *benchkit.module_command(str(python), "studies.http_clients"),
            *("--inner", f"{upstream.base_url}/chat/completions"),
            *("--rounds", str(args.rounds), "--seconds", str(args.seconds)),
            "--concurrency",
            *map(str, args.concurrency),
            stdout=asyncio.subprocess.PIPE,
            cwd=benchkit.REPO,
        )
        out, _ = await process.communicate()
        if process.returncode:
            raise SystemExit(f"the inner run failed with {process.returncode}")
        found: dict[str, dict[str, float]] = json.loads(out)
        return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--cache", type=Path, default=benchkit.default_cache("http-clients"))
    parser.add_argument("--inner", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        import uvloop

        uvloop.run(inner(args.inner, args.rounds, args.seconds, args.concurrency))
        return
    import uvloop

    python = benchkit.ensure_venv(args.cache / "venv", PACKAGES)
    print(
        f"{benchkit.opening('bench.studies.http_clients', 1)}; {args.rounds} rounds of "
        f"{args.seconds:g} s per cell\n"
    )
    summary = uvloop.run(outer(args, python))
    print("| mode | conc | client | req/s | x aiohttp | p50 ms | p99 ms | CPU us/req | errors |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for mode in ("whole", "stream"):
        for conc in args.concurrency:
            base = summary[f"{mode}|{conc}|aiohttp"]
            for name in CLIENTS:
                row = summary[f"{mode}|{conc}|{name}"]
                print(
                    f"| {mode} | {conc} | {name} | {row['rps']:,.0f} | "
                    f"{row['rps'] / base['rps']:.2f} | {row['p50']:.2f} | {row['p99']:.2f} | "
                    f"{row['cpu_us']:,.0f} | {row['errors']:.0f} |"
                )
    print("\n" + benchkit.closing(1))


if __name__ == "__main__":
    main()
