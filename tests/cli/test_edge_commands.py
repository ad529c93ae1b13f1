"""`iop edge run`'s own options, as parsed (the Edge they start: tests/edge/)."""

from __future__ import annotations

import pytest

from iop.cli import build_parser

BASE = ["edge", "run", "--config", "edge.yaml"]


@pytest.mark.parametrize(
    ("extra", "seconds"),
    [
        pytest.param([], 0.0, id="default-no-wait"),
        pytest.param(["--wait-for-nodes", "20"], 20.0, id="twenty"),
        pytest.param(["--wait-for-nodes", "0"], 0.0, id="zero"),
    ],
)
def test_wait_for_nodes(extra: list[str], seconds: float) -> None:
    words = [*BASE, *extra]
    assert build_parser(words).parse_args(words).wait_for_nodes == seconds


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_wait_for_nodes_must_be_seconds(value: str, capsys) -> None:
    words = [*BASE, "--wait-for-nodes", value]
    with pytest.raises(SystemExit) as exited:
        build_parser(words).parse_args(words)
    assert exited.value.code == 2
    assert "--wait-for-nodes" in capsys.readouterr().err
