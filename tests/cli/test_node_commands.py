"""`iop node run`'s options reach the Node agent it builds."""

from __future__ import annotations

import pytest

from iop.cli import build_parser
from iop.cli.node_commands import _agent

BASE = ["node", "run", "--edge-service", "hub.test:7443", "--node-id", "n1", "--token-file", "t"]


@pytest.mark.parametrize(
    ("extra", "interval"),
    [
        pytest.param([], 30.0, id="default"),
        pytest.param(["--resolve-interval", "5"], 5.0, id="five-seconds"),
        pytest.param(["--resolve-interval=0.5"], 0.5, id="half-a-second"),
    ],
)
def test_resolve_interval_reaches_the_agent(extra: list[str], interval: float) -> None:
    words = [*BASE, *extra]
    args = build_parser(words).parse_args(words)
    assert _agent(args, "a-token", None).resolve_interval == interval


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_resolve_interval_must_be_positive_seconds(value: str, capsys) -> None:
    words = [*BASE, "--resolve-interval", value]
    with pytest.raises(SystemExit) as exited:
        build_parser(words).parse_args(words)
    assert exited.value.code == 2
    assert "--resolve-interval" in capsys.readouterr().err
