"""Benchmark: the Node's cost per stream event, parsed one by one or passed through per read.

    uv run --frozen python -m bench.sse_passthrough [--tokens 256] [--repeat 5]

The Node's `openai` adapter turns an upstream's SSE body into run events
(`iop.providers.adapters.streamdecoding.StreamDecoder`): one parsed JSON object per event (for an
Edge that predates `RunChunk.sse`), or each read's whole events passed through as one chunk of
bytes with only the read's last events parsed (`sse`). This script feeds the decoder the fake
upstream's own events for a chat stream of `--tokens` tokens with the usage chunk (the bytes
`iop fake-upstream` writes), in two shapes: the whole stream in one read (a fast server's burst)
and one event per read (a GPU server's pace), and prints the decoder's CPU per event, each way,
the best of `--repeat` timings. It measures the adapter's parsing alone; `bench/peers.py` measures
the whole path.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import timeit

import orjson

from iop.fakes.answers import parse_request, tokens
from iop.providers.adapters.streamdecoding import StreamDecoder


def stream_events(count: int) -> list[bytes]:
    """The SSE events of the fake upstream's answer to a stream of `count` tokens."""
    body = orjson.dumps(
        {
            "model": "served",
            "messages": [{"role": "user", "content": "Say something about gateways."}],
            "max_tokens": count,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    completion = parse_request("chat", body, default_tokens=count, models=("served",), now=0)
    objects = [completion.first_chunk()]
    objects += [completion.token_chunk(word) for word in tokens(count)]
    objects += [completion.final_chunk(), completion.usage_chunk()]
    return [b"data: " + o + b"\n\n" for o in objects if o is not None] + [b"data: [DONE]\n\n"]


def decode(reads: list[bytes], sse: bool) -> int:
    """Feed `reads` to a decoder; how many chunk events it made."""
    decoder = StreamDecoder(False, 32 * 1024 * 1024, sse)
    made = 0
    for read in reads:
        made += sum(1 for _ in decoder.feed(read))
    return made + sum(1 for _ in decoder.end())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    events = stream_events(args.tokens)
    load = os.getloadavg()
    print(
        f"# bench/sse_passthrough.py, {time.strftime('%Y-%m-%d %H:%M')}, load average "
        f"{load[0]:.1f}, {args.tokens} tokens ({len(events)} events, "
        f"{sum(map(len, events)):,} bytes), best of {args.repeat}\n"
    )
    print("| reads | us per event: parsed | passed through | ratio | chunks out: parsed | passed |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, reads in (("one burst", [b"".join(events)]), ("one event per read", events)):
        costs = []
        for sse in (False, True):
            number = max(1, 2000 // len(events))
            timings = timeit.repeat(
                functools.partial(decode, reads, sse), number=number, repeat=args.repeat
            )
            costs.append(min(timings) / number / len(events) * 1e6)
        made = [decode(reads, False), decode(reads, True)]
        print(
            f"| {label} | {costs[0]:.2f} | {costs[1]:.2f} | {costs[1] / costs[0]:.2f} | "
            f"{made[0]} | {made[1]} |"
        )


if __name__ == "__main__":
    main()
