"""Benchmark: the YAML parsers on PyPI against what the config needs from one, on a big config.

    uv run --frozen python -m bench.studies.yaml_parsers [--base-nodes 2000] [--repeat 3]

The candidates are installed, pinned, into a virtual environment of their own under a cache
directory (`--cache`, default `$XDG_CACHE_HOME/iop-bench/yaml-parsers`), never into the
project's. This script writes the config of `bench/config_scale.py` (2,000 nodes x 4 providers,
1,000 models, dumped by PyYAML) to a file and runs itself in that environment (`--inner`), where
each candidate:

- parses the file, best of `--repeat` (the time `iop config check` spends before validation);
- is compared with PyYAML's safe loader, the project's reference, on that document;
- gets the small documents the config's loader must refuse or read as YAML 1.1 does (the cases
  tests/edgeconfig pins, and the plain scalars whose YAML 1.1 and 1.2 readings differ).

It prints one table; figures go to docs/benchmarks.md ("## Config scale").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import benchkit

#: The candidates, pinned (the newest PyPI serves here on the day of the figures).
PACKAGES = [
    "pyyaml==6.0.3",
    "ruamel.yaml==0.19.1",
    "ruamel.yaml.clib==0.2.15",
    "rapidyaml==0.15.2",
    "yaml-rs==0.1.6",
    "ryaml==0.5.1",
    "pyyaml-rs==0.1.0",
]

#: Small documents and what the config's loader must do with each: "error", or the value.
CASES: dict[str, tuple[str, object]] = {
    "duplicate key": ("edge:\n  id: a\n  id: b\n", "error"),
    "unsafe tag": ("edge: !!python/object:os.system {}\n", "error"),
    "list as key": ("? [a, b]\n: 1\n", "error"),
    "tab indent": ("edge: {id: a}\n\tnodes: []\n", "error"),
    "yes (1.1 bool)": ("a: yes\n", {"a": True}),
    "010 (1.1 octal)": ("a: 010\n", {"a": 8}),
    "1e5 (1.1 string)": ("a: 1e5\n", {"a": "1e5"}),
    "0...08 (1.1 string)": ("a: 00000008\n", {"a": "00000008"}),
    "merge key <<": ("b: &B {x: 1}\nm: {<<: *B, y: 2}\n", {"b": {"x": 1}, "m": {"x": 1, "y": 2}}),
}


# -- inside the candidates' environment ------------------------------------------------------------


def loaders() -> dict[str, Callable[[str], Any]]:
    """name -> a function from YAML text to Python data, each the library's safe mode."""
    import yaml

    class Unique(yaml.CSafeLoader):  # the project's loader: libyaml, duplicate keys refused
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise ValueError(f"duplicate key {key!r}")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    Unique.add_constructor("tag:yaml.org,2002:map", Unique.construct_mapping)
    found: dict[str, Callable[[str], Any]] = {
        "PyYAML CSafeLoader, duplicates refused (today)": lambda t: yaml.load(t, Loader=Unique),
        "PyYAML CSafeLoader": lambda t: yaml.load(t, Loader=yaml.CSafeLoader),
    }
    from ruamel.yaml import YAML

    def ruamel_load(text: str) -> Any:
        parser = YAML(typ="safe", pure=False)
        parser.allow_duplicate_keys = False
        return parser.load(text)

    found["ruamel.yaml safe, C loader"] = ruamel_load
    import ryml

    def ryml_load(text: str) -> Any:
        # rapidyaml hands back a tree of untyped scalars: a walk in Python builds the data and
        # types each plain scalar with PyYAML's own YAML 1.1 resolver and constructors.
        resolver = yaml.resolver.Resolver()
        constructor = yaml.constructor.SafeConstructor()
        tree = ryml.parse_in_arena(text.encode())
        none, is_map, is_seq, quoted = ryml.NONE, ryml.MAP, ryml.SEQ, ryml.VALQUO

        def build(node: int) -> Any:
            kind = tree.type(node)
            if kind & is_map:
                mapping: dict[Any, Any] = {}
                child = tree.first_child(node)
                while child != none:
                    key = str(tree.key(child), "utf-8")
                    if key in mapping:
                        raise ValueError(f"duplicate key {key!r}")
                    mapping[key] = build(child)
                    child = tree.next_sibling(child)
                return mapping
            if kind & is_seq:
                items = []
                child = tree.first_child(node)
                while child != none:
                    items.append(build(child))
                    child = tree.next_sibling(child)
                return items
            value = str(tree.val(node), "utf-8")
            if kind & quoted:
                return value
            tag = resolver.resolve(yaml.ScalarNode, value, (True, False))
            return constructor.construct_object(yaml.ScalarNode(tag, value), deep=True)

        return build(tree.root_id())

    found["rapidyaml + walk with PyYAML's 1.1 resolver"] = ryml_load
    import yaml_rs

    found["yaml-rs"] = yaml_rs.loads
    import ryaml

    found["ryaml"] = ryaml.loads
    import pyyaml_rs

    found["pyyaml-rs"] = pyyaml_rs.safe_load
    return found


def inner(path: str, repeat: int) -> None:
    import yaml

    text = Path(path).read_text()
    reference = yaml.safe_load(text)
    results = []
    for name, load in loaders().items():
        times = []
        data: Any = None
        for _ in range(repeat):
            start = time.perf_counter()
            data = load(text)
            times.append(time.perf_counter() - start)
        behaviours = {}
        for case, (document, wanted) in CASES.items():
            try:
                got: object = load(document)
            except Exception as exc:
                got = f"error: {type(exc).__name__}"
            if wanted == "error":
                behaviours[case] = str(got).startswith("error")
            else:
                behaviours[case] = got == wanted and type(got) is type(wanted)
        results.append(
            {"name": name, "seconds": min(times), "same": data == reference, "cases": behaviours}
        )
    print(json.dumps(results))


# -- outside ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-nodes", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=benchkit.default_cache("yaml-parsers"))
    parser.add_argument("--inner", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args.inner, args.repeat)
        return
    import yaml

    from bench.config_scale import document

    python = benchkit.ensure_venv(args.cache / "venv", PACKAGES)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(document(args.base_nodes), sort_keys=False))
        size = path.stat().st_size // 1024
        answer = subprocess.run(
            benchkit.module_command(
                str(python),
                "studies.yaml_parsers",
                "--inner",
                str(path),
                "--repeat",
                str(args.repeat),
            ),
            check=True,
            cwd=benchkit.REPO,
            capture_output=True,
            text=True,
        )
    load = os.getloadavg()
    print(
        f"# bench/studies/yaml_parsers.py, {time.strftime('%Y-%m-%d %H:%M')}, load average "
        f"{load[0]:.1f}; {args.base_nodes} nodes, {size:,} KiB of YAML, best of {args.repeat}\n"
    )
    cases = list(CASES)
    print("| parser | parse s | same data as PyYAML | " + " | ".join(cases) + " |")
    print("|---|---:|---|" + "---|" * len(cases))
    for row in json.loads(answer.stdout):
        marks = ["ok" if row["cases"][c] else "**no**" for c in cases]
        print(
            f"| {row['name']} | {row['seconds']:.3f} | {'yes' if row['same'] else '**no**'} | "
            + " | ".join(marks)
            + " |"
        )


if __name__ == "__main__":
    main()
