"""How every `iop` command shows a config that does not load: a line per problem, with its path."""

from __future__ import annotations

import sys

from iop.edgeconfig import ConfigError


def print_problems(label: str, error: ConfigError) -> None:
    """`LABEL: N problems` on stderr, then each problem (`path: message`) indented below it."""
    count = len(error.problems)
    print(f"{label}: {count} problem{'s' if count != 1 else ''}", file=sys.stderr)
    for problem in error.problems:
        print(f"  {problem}", file=sys.stderr)
