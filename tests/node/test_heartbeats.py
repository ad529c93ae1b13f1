"""What a Node's heartbeat says that the Edge acts on: a quiet link beats sooner than its idle
interval only when that changed, not when a server's reading merely grew older."""

from __future__ import annotations

import pytest

from iop.node.connecting import _says
from iop.wire import ServerLoad


def test_a_server_load_that_only_grew_older_says_nothing_new() -> None:
    before = _says({}, {"p": ServerLoad(1, 0, 0.25, age_s=0.5)})
    after = _says({}, {"p": ServerLoad(1, 0, 0.25, age_s=1.0)})
    assert before == after


@pytest.mark.parametrize(
    ("in_flight", "load"),
    [
        pytest.param({"p": 1}, ServerLoad(1, 0, 0.25), id="in-flight"),
        pytest.param({}, ServerLoad(2, 0, 0.25), id="running"),
        pytest.param({}, ServerLoad(1, 3, 0.25), id="waiting"),
        pytest.param({}, ServerLoad(1, 0, 0.5), id="kv-cache"),
        pytest.param({}, ServerLoad(1, 0, 0.25, not_ours=1), id="not-ours"),
    ],
)
def test_a_change_the_edge_acts_on_says_something_new(
    in_flight: dict[str, int], load: ServerLoad
) -> None:
    assert _says({}, {"p": ServerLoad(1, 0, 0.25)}) != _says(in_flight, {"p": load})
