"""The Edge's readiness as its nodes make it: the rule (`judge`, pure) and `NodeWait` over a real
node hub with real Nodes (in process, over gRPC and mutual TLS)."""

from __future__ import annotations

import logging

import pytest

from iop.edge.hub.nodehub import NodeHub
from iop.edge.hub.nodewait import NodeWait, Readiness, judge

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

TWO = ("node-a", "node-b")
FAKE = {"id": "pa", "adapter": {"type": "fake"}}


@pytest.mark.parametrize(
    ("connected", "waited", "wait", "expected"),
    [
        pytest.param((), 0.0, 0.0, Readiness(ready=True), id="no-wait"),
        pytest.param((), 5.0, 0.0, Readiness(ready=True), id="no-wait-later-too"),
        pytest.param(
            (), 0.5, 2.0, Readiness(ready=False, awaited=TWO, wait_left=1.5), id="none-yet"
        ),
        pytest.param(
            ("node-b",),
            1.0,
            2.0,
            Readiness(ready=False, awaited=("node-a",), wait_left=1.0),
            id="one-of-two",
        ),
        pytest.param(TWO, 1.0, 2.0, Readiness(ready=True), id="all-connected"),
        pytest.param(
            ("node-a", "node-b", "stranger"), 0.1, 2.0, Readiness(ready=True), id="and-more"
        ),
        pytest.param(
            ("node-a",),
            2.0,
            2.0,
            Readiness(ready=True, awaited=("node-b",), timed_out=True),
            id="timed-out",
        ),
        pytest.param(
            (),
            9.0,
            2.0,
            Readiness(ready=True, awaited=TWO, timed_out=True),
            id="timed-out-none-came",
        ),
    ],
)
def test_the_rule(
    connected: tuple[str, ...], waited: float, wait: float, expected: Readiness
) -> None:
    assert judge(TWO, connected, waited, wait) == expected


def test_no_node_to_wait_for_is_ready_at_once() -> None:
    assert judge((), (), 0.0, 30.0) == Readiness(ready=True)


async def test_ready_once_all_nodes_connected_and_for_good(
    wire_config, start_hub, start_node, until, node_token, caplog
) -> None:
    config = wire_config([FAKE], node_id="node-1", token=node_token)
    hub: NodeHub = await start_hub(config)
    wait = NodeWait(hub, ["node-1"], 60.0)
    assert wait.readiness() == Readiness(ready=False, awaited=("node-1",), wait_left=60.0)
    wait.start()
    try:
        waiting = wait.readiness()
        assert not waiting.ready and waiting.awaited == ("node-1",)
        assert 0 < waiting.wait_left <= 60.0
        caplog.set_level(logging.INFO, logger="iop.edge.hub.nodewait")
        agent = await start_node(hub)
        # The hub's listener turned it ready as the node took its config: no probe needed.
        await until(lambda: "edge ready: all 1 node(s)" in caplog.text)
        assert wait.readiness() == Readiness(ready=True)
        await agent.stop()
        await until(lambda: not hub.nodes())
        assert wait.readiness() == Readiness(ready=True)  # a node that drops changes nothing
    finally:
        wait.stop()


async def test_ready_when_the_wait_runs_out(wire_config, start_hub, until, caplog) -> None:
    config = wire_config([FAKE], node_id="node-1")
    hub: NodeHub = await start_hub(config)
    caplog.set_level(logging.WARNING, logger="iop.edge.hub.nodewait")
    wait = NodeWait(hub, ["node-1"], 0.2)
    wait.start()
    try:
        assert not wait.readiness().ready
        # The deadline's timer makes it ready and logs it, with no probe asking.
        await until(lambda: "0 of 1 connected, still missing node-1" in caplog.text)
        assert wait.readiness() == Readiness(ready=True)
    finally:
        wait.stop()
