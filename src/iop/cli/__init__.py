"""The `iop` command line: one console script, a subcommand per job.

Entry points stay thin: they parse arguments, call the library and turn its results and errors
into output and exit codes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from iop import __version__

from . import (
    config_commands,
    edge_commands,
    fake_upstream_commands,
    node_commands,
    up_commands,
)

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iop", description="IOP Edge: an OpenAI-compatible LLM gateway for Kubernetes."
    )
    parser.add_argument("--version", action="version", version=f"iop {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    config_commands.register(commands)
    edge_commands.register(commands)
    up_commands.register(commands)
    node_commands.register(commands)
    fake_upstream_commands.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `iop` command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
