"""Benchmark: what traces cost the request path. CPU per request of the Edge and the Node with
tracing off, with 1% and with every trace sampled, in the same run.

    uv run --frozen python -m bench.tracing [--rounds 3] [--seconds 3] [--concurrency 1 32]
        [--modes whole stream] [--paths iop iop-local]

Three IOP stacks of `bench.peers` (an Edge and a Node, two providers, in front of one fake
upstream; with `iop-local`, the same with the node placed on the Edge), taking turns in each round
as its paths do:
- `iop`: tracing off (no `OTEL_*` variable: nothing of the OpenTelemetry SDK is imported);
- `iop:sampled-1pct`: on, `OTEL_TRACES_SAMPLER=traceidratio` with argument 0.01;
- `iop:sampled-all`: on, every trace sampled and exported.

The sampled stacks export over OTLP/gRPC, with the SDK's batching, to a real receiver in this
process (`testkit.otlp`), which counts what arrived. The client sends no `traceparent`: every
request starts a trace at the Edge. It prints bench.peers' tables, then the CPU per request of
the gateway's processes of each stack and its ratio to tracing off. Figures go to
docs/benchmarks.md ("## Traces").
"""

from __future__ import annotations

import argparse
import sys

import uvloop

from bench import benchkit, peers
from testkit.otlp import OtlpReceiver

SAMPLERS = {
    "sampled-1pct": {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
    "sampled-all": {"OTEL_TRACES_SAMPLER": "always_on"},
}


async def run(args: argparse.Namespace) -> tuple[dict[peers.Key, peers.Series], int]:
    """bench.peers' run with the sampled stacks as its variants; the spans received."""
    async with OtlpReceiver() as receiver:
        # The SDK's own batching (a batch every 5 s or 512 spans), not the tests' 100 ms.
        batch = {"OTEL_BSP_SCHEDULE_DELAY": "5000"}
        args.variant = [
            (name, receiver.environment(**env, **batch)) for name, env in SAMPLERS.items()
        ]
        results = await peers.run(args)
        return results, len(receiver.spans)


def report(results: dict[peers.Key, peers.Series], args: argparse.Namespace) -> None:
    print("\nCPU per request of the Edge and the Node (us, median of the rounds), and / off:\n")
    print("| mode | conc | path | off | 1% sampled | / off | all sampled | / off |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for mode in args.modes:
        for conc in args.concurrency:
            for path in args.paths:
                off = peers.gateway_cpu(results[(mode.name, conc, path)])
                cells = [f"{off:,.0f}"]
                for name in SAMPLERS:
                    cpu = peers.gateway_cpu(results[(mode.name, conc, f"{path}:{name}")])
                    cells += [f"{cpu:,.0f}", f"{cpu / off:.2f}x"]
                print(f"| {mode.name} | {conc} | {path} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="measuring time per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--paths", nargs="+", choices=("iop", "iop-local"), default=["iop"])
    parser.add_argument(
        "--modes",
        nargs="+",
        type=peers.Mode.parse,
        default=[peers.Mode.parse(m) for m in ("whole", "stream")],
        help="whole, stream (8 chunks), stream-N, stream-N@TPS (paced)",
    )
    args = parser.parse_args()
    args.cache = None  # no peer gateway runs here
    print(
        f"{benchkit.opening('bench/tracing.py')}, {args.rounds} rounds of {args.seconds:g} s "
        "per cell",
        flush=True,
    )
    results, spans = uvloop.run(run(args))
    print(f"# spans received: {spans:,}", file=sys.stderr)
    args.paths = [*args.paths]
    peers.report(results, args)
    report(results, args)
    print(f"\nSpans received by the OTLP receiver: {spans:,}")


if __name__ == "__main__":
    main()
