"""`iop fake-upstream`: the fake OpenAI-compatible server, for tests, demos and benchmarks.

It imports neither the config model nor the wire: tests and benchmarks start many of these.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import typing
from typing import Any

import orjson
import uvloop

from iop.aiokits import split_listener
from iop.fakes import FAIL_MODES, FakeUpstream, FakeUpstreamSettings, GpuSettings


def register(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of `iop fake-upstream` to its parser."""
    parser.description = (
        "Serve /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings and "
        "/v1/responses with deterministic answers. Once listening it prints one JSON line on "
        'stdout: {"listen": "HOST:PORT", "base_url": "http://HOST:PORT/v1", "pid": N}.'
    )
    parser.add_argument("--listen", default="127.0.0.1:8000", help="host:port; port 0 picks one")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="time to the first token")
    parser.add_argument(
        "--tokens-per-second", type=float, default=None, help="generation speed (default: no wait)"
    )
    parser.add_argument(
        "--completion-tokens", type=int, default=16, help="length of an answer without max_tokens"
    )
    parser.add_argument(
        "--model", action="append", default=[], help="a model to serve (repeat); default: any"
    )
    parser.add_argument(
        "--fail-rate", type=float, default=0.0, help="fraction of completions that fail (0..1)"
    )
    parser.add_argument(
        "--fail-mode", choices=FAIL_MODES, default="status", help="how an injected failure looks"
    )
    parser.add_argument(
        "--error-status", type=int, default=500, help="HTTP status of an injected failure"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the failure draw and of --gpu-jitter"
    )
    gpu = parser.add_argument_group(
        "simulated GPU server",
        "--gpu times completions by a simulated model server instead of --latency-ms and "
        "--tokens-per-second: a KV/prefix cache with LRU eviction by blocks, prefill of the "
        "prompt tokens not in the cache, decoding that slows as the batch grows, a bounded "
        "batch and a waiting queue; GET /metrics serves vLLM's metric names. Tokens are "
        "estimated as 4 bytes of text each.",
    )
    gpu.add_argument("--gpu", action="store_true", help="simulate a GPU server (off by default)")
    kinds = typing.get_type_hints(GpuSettings)
    for setting in _gpu_flags():
        gpu.add_argument(
            f"--gpu-{setting.name.replace('_', '-')}",
            type=kinds[setting.name],
            default=setting.default,
            help=setting.metadata["flag_help"],
        )
    parser.set_defaults(run=_run)


def _gpu_flags() -> list[dataclasses.Field[Any]]:
    """The fields of `GpuSettings` that are `--gpu-*` flags: those with a `flag_help`."""
    return [f for f in dataclasses.fields(GpuSettings) if "flag_help" in f.metadata]


def _run(args: argparse.Namespace) -> int:
    try:
        host, port = split_listener(args.listen)
    except ValueError as exc:
        print(f"iop fake-upstream: --listen {args.listen}: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.fail_rate <= 1:
        print("iop fake-upstream: --fail-rate must be between 0 and 1", file=sys.stderr)
        return 2
    if not 400 <= args.error_status <= 599:
        print("iop fake-upstream: --error-status must be an HTTP error (400-599)", file=sys.stderr)
        return 2
    gpu: GpuSettings | None = None
    if args.gpu:
        try:
            flags = {s.name: getattr(args, f"gpu_{s.name}") for s in _gpu_flags()}
            gpu = GpuSettings(**flags, seed=args.seed or 0)
        except ValueError as exc:
            print(f"iop fake-upstream: --gpu-*: {exc}", file=sys.stderr)
            return 2
    settings = FakeUpstreamSettings(
        latency_ms=args.latency_ms,
        tokens_per_second=args.tokens_per_second,
        completion_tokens=args.completion_tokens,
        models=tuple(args.model),
        fail_rate=args.fail_rate,
        fail_mode=args.fail_mode,
        error_status=args.error_status,
        seed=args.seed,
        gpu=gpu,
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    uvloop.run(_serve(settings, host, port))
    return 0


async def _serve(settings: FakeUpstreamSettings, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with FakeUpstream(settings, host=host, port=port) as upstream:
        line = {"listen": upstream.address, "base_url": upstream.base_url, "pid": os.getpid()}
        sys.stdout.write(orjson.dumps(line).decode() + "\n")
        sys.stdout.flush()
        await stop.wait()
