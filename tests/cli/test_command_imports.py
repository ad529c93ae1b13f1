"""Each `iop` command loads what its job needs and nothing of the others' (src/iop/cli): a fresh
interpreter runs the command line and reports which heavy packages it imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from iop.cli import COMMANDS, build_parser

HEAVY = ("kopf", "kubernetes", "grpc", "pydantic", "uvicorn", "aiohttp", "httpx")


def imported_by(*argv: str) -> set[str]:
    """The packages of HEAVY that `iop ARGV` imported (it may exit, as --help does)."""
    script = (
        "import sys\n"
        "from iop.cli import main\n"
        "try:\n"
        f"    main({list(argv)!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('imported:', ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    finished = subprocess.run(
        [sys.executable, "-P", "-c", script], capture_output=True, text=True, check=True
    )
    report = finished.stdout.rpartition("imported:")[2].strip()
    return set(filter(None, report.split(",")))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--version"], set()),
        (["--help"], set()),
        (["fake-upstream", "--help"], set()),
        (["fake-collector", "--help"], set()),
        (["config", "--help"], {"pydantic"}),
        (["node", "run", "--help"], {"grpc", "pydantic", "aiohttp", "uvicorn"}),
        (["edge", "reload", "--help"], {"httpx"}),
    ],
    ids=["version", "help", "fake-upstream", "fake-collector", "config", "node", "edge-reload"],
)
def test_a_command_imports_only_what_its_job_needs(argv: list[str], expected: set[str]) -> None:
    assert imported_by(*argv) == expected


def test_the_full_parser_knows_every_command_and_its_arguments() -> None:
    # What tests of the chart's container args use: every command parses without naming it first.
    parser = build_parser()
    args = parser.parse_args(
        ["node", "run", "--edge", "e:50051", "--node-id", "n", "--token-file", "t"]
    )
    assert args.command == "node" and args.edge == ["e:50051"]
    assert set(COMMANDS) == {
        "config", "edge", "up", "node", "operator", "fake-upstream", "fake-collector"
    }  # fmt: skip
