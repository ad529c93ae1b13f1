"""How config loading and change classification scale with the size of the config.

Generates configs of N nodes x 4 providers and N/2 models (base N = 2,000), and 2x and 4x that,
then times, best of a few runs each:
  - load (YAML): parse YAML text and validate (what `iop config check` does with a file);
  - load (JSON): parse JSON text (valid YAML too: what the operator renders) and validate;
  - load (data): validate an already-parsed document (what the operator does with a CRD spec);
  - classify:    compare two loaded configs that differ in one provider's capacity.
Prints the figures and how each grows from one size to the next (2.0 = linear).

    uv run python -m bench.config_scale [--base-nodes 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import yaml

from iop.edgeconfig import classify, load_data, load_text
from testkit import edge_document, provider


def document(nodes: int) -> dict[str, Any]:
    node_list = {
        f"node-{n}": [
            provider(
                f"p-{n}-{p}",
                {"type": "openai", "base_url": f"http://10.0.{n % 250}.{p}:8000/v1"},
                served=f"model-{(n * 4 + p) % (nodes // 2)}",
                long_context_slots=2,
                priority=p,
                max_queue=64,
                queue_timeout_ms=30000,
            )
            for p in range(4)
        ]
        for n in range(nodes)
    }
    served_by: dict[str, list[str]] = {}
    for providers in node_list.values():
        for entry in providers:
            served_by.setdefault(entry["served_models"][0], []).append(entry["id"])
    return edge_document(
        node_list,
        served_by,
        model_settings={name: {"generation": {"max_tokens": 4096}} for name in served_by},
        edge_id="edge-bench",
        listeners=False,
        clients=(),
    )


def best_of(repeat: int, action: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-nodes", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    rows = []
    for factor in (1, 2, 4):
        nodes = args.base_nodes * factor
        data = document(nodes)
        text = yaml.safe_dump(data, sort_keys=False)
        json_text = json.dumps(data)
        changed = copy.deepcopy(data)
        changed["nodes"][nodes // 2]["providers"][1]["capacity"] = 9
        old, new = load_data(data), load_data(changed)
        report = classify(old, new)
        assert report.live_paths == (
            f"nodes[node-{nodes // 2}].providers[p-{nodes // 2}-1].capacity",
        )
        rows.append(
            {
                "nodes": nodes,
                "providers": nodes * 4,
                "models": len(data["models"]),
                "yaml_kib": len(text) // 1024,
                "load_yaml": best_of(args.repeat, partial(load_text, text)),
                "load_json": best_of(args.repeat, partial(load_text, json_text)),
                "load_data": best_of(args.repeat, partial(load_data, data)),
                "classify": best_of(args.repeat, partial(classify, old, new)),
            }
        )

    keys = ("load_yaml", "load_json", "load_data", "classify")
    print(
        f"{'nodes':>6} {'providers':>9} {'models':>6} {'YAML KiB':>8} "
        f"{'load (YAML) s':>13} {'load (JSON) s':>13} {'load (data) s':>13} {'classify s':>10}"
    )
    for row in rows:
        print(
            f"{row['nodes']:>6} {row['providers']:>9} {row['models']:>6} {row['yaml_kib']:>8} "
            + " ".join(f"{row[key]:>13.3f}" for key in keys[:3])
            + f" {row['classify']:>10.3f}"
        )
    print("\ngrowth per doubling (2.0 = linear):")
    for before, after in itertools.pairwise(rows):
        print(
            f"  {before['nodes']} -> {after['nodes']} nodes: "
            + ", ".join(f"{key} x{after[key] / before[key]:.2f}" for key in keys)
        )


if __name__ == "__main__":
    main()
