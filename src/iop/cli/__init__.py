"""The `iop` command line: one console script, a subcommand per job, each thin (arguments in,
the library called, its results and errors turned into output and exit codes).

- a module per command: `config_commands` (`history_commands`: `iop config history`),
  `edge_commands` (`edge_running`: `iop edge run`;
  `reload_commands`: `iop edge reload`; `revision_commands`: `iop edge history` and `iop edge
  rollout`), `node_commands`, `operator_commands`,
  `fake_upstream_commands`, `fake_collector_commands`, `up_commands`;
- `problems`: a config that does not load, shown alike by every command; `policies`: the
  `--upstream-policy` of the commands that run or check providers; `settling`: what a
  long-running process does once it has started; `__main__`: `python -m iop.cli`.

A command's module is imported only when that command runs (or shows its `--help`), so what one
job pulls in (uvicorn and grpc, kopf and the Kubernetes client) costs no other, such as `iop
fake-upstream` or `iop --version`. `iop --help` lists every command from `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from iop import __version__

__all__ = ["COMMANDS", "build_parser", "main"]


#: command -> (its module in this package, its line in `iop --help`).
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("config_commands", "check, compare and describe EdgeConfig files"),
    "edge": ("edge_commands", "run the Edge; reload it, list and end its revisions' rollouts"),
    "up": ("up_commands", "run an Edge, its Nodes and a fake upstream locally from a config"),
    "node": ("node_commands", "run a Node agent"),
    "operator": ("operator_commands", "the EdgeConfig operator"),
    "fake-upstream": (
        "fake_upstream_commands",
        "serve a fake OpenAI-compatible API (prints its address as one JSON line)",
    ),
    "fake-collector": (
        "fake_collector_commands",
        "receive OpenTelemetry spans over OTLP and show them as JSON (for tests and demos)",
    ),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `iop` parser for `argv`: the arguments of the command it names (of every command when
    `argv` is None); the others are listed by name and help line only."""
    chosen = _command_of(argv)
    parser = argparse.ArgumentParser(
        prog="iop", description="IOP Edge: an OpenAI-compatible LLM gateway for Kubernetes."
    )
    parser.add_argument("--version", action="version", version=f"iop {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, line) in COMMANDS.items():
        command = commands.add_parser(name, help=line)
        if argv is None or name == chosen:
            importlib.import_module(f"{__name__}.{module}").register(command)
    return parser


def _command_of(argv: Sequence[str] | None) -> str | None:
    """The command `argv` names: its first word that is not an option (`iop` takes no option
    with a value before the command)."""
    return next((arg for arg in argv or () if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `iop` command; returns the process exit code."""
    words = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(words).parse_args(words)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
