"""A Node following the hub's Service (`services=`): it looks again at once when a link drops,
and it leaves an Edge the Service no longer lists without cutting the runs it has there.

Real node hubs in process over real gRPC (mutual TLS); the Service's DNS answer is the test's,
through the agent's resolver seam.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import orjson
import pytest

from iop.edge.hub.nodehub import NodeHub
from iop.node import NodeAgent
from iop.wire import RunDone, RunEvent, RunFailed, RunRequest, statuses
from iop.wire.nodestates import DRAINING

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

#: 20 tokens a second: a run of n tokens streams for about n / 20 s.
SLOW = {"type": "fake", "tokens_per_second": 20, "completion_tokens": 40}


class Service:
    """The hub's Service as the Node's resolver sees it."""

    def __init__(self, *hubs: NodeHub) -> None:
        self.ready = [address(hub) for hub in hubs]
        self.lookups = 0

    async def resolve(self, host: str, port: int) -> list[str]:
        self.lookups += 1
        return list(self.ready)


def address(hub: NodeHub) -> str:
    return f"127.0.0.1:{hub.port}"


def request(run_id: str, tokens: int) -> RunRequest:
    body: dict[str, Any] = {"model": "served", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"max_tokens": tokens, "stream": True}
    return RunRequest(run_id, "p1", "served", "chat", orjson.dumps(body), True)


async def events_of(hub: NodeHub, run: RunRequest) -> list[RunEvent]:
    async with hub.run(run) as stream:
        return [event async for event in stream]


@pytest.fixture
async def following(node_token: str, tls: Any) -> AsyncIterator[Callable[[Service, float], Any]]:
    """`await following(service, interval)`: a Node agent following `service` (looking it up
    every `interval` seconds when all is well), stopped at the end."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(service: Service, interval: float) -> NodeAgent:
            agent = NodeAgent(
                node_id="node-1",
                token=node_token,
                services=["iop-hub:7443"],
                resolve=service.resolve,
                resolve_interval=interval,
                backoff_initial=0.05,
                backoff_max=0.5,
                tls=tls.client(),
            )
            return await stack.enter_async_context(agent)

        yield start


async def welcomed_by(agent: NodeAgent, hubs: Sequence[NodeHub], until: Any) -> None:
    """Until the Node is linked to exactly `hubs`, as both sides see it: the Node was welcomed by
    each, and each lists the Node's providers as healthy (it dispatches to them)."""
    wanted = {address(hub) for hub in hubs}

    def welcomed() -> bool:
        links = agent.connections
        return (
            set(links) == wanted
            and all(link.connected.is_set() for link in links.values())
            and all(
                (providers := hub.connected_providers())
                and all(p.healthy for p in providers.values())
                for hub in hubs
            )
        )

    await until(welcomed)


async def test_a_link_that_drops_makes_the_node_look_again_at_once(
    wire_config, start_hub, following, until
) -> None:
    config = wire_config([{"id": "p1", "adapter": {"type": "fake"}}])
    one, two = await start_hub(config), await start_hub(config)
    service = Service(one, two)
    agent = await following(service, 3600.0)  # any lookup but the first ones is caused below
    await welcomed_by(agent, [one, two], until)
    lookups = service.lookups

    # `one` is replaced: it stops and leaves the Service; its successor (here: a third hub)
    # will be listed once it is ready.
    service.ready = [address(two)]
    await one.stop()
    await until(lambda: service.lookups > lookups)  # at once, not in an hour
    three = await start_hub(config)
    service.ready = [address(two), address(three)]
    # The Node still has `two`, so every address listed has welcomed it; it looks again all the
    # same (every second) until it is back to two Edges.
    await welcomed_by(agent, [two, three], until)


async def test_an_edge_the_service_no_longer_lists_is_left_once_its_runs_are_done(
    wire_config, start_hub, following, until
) -> None:
    """An Edge that stops leaves the Service's endpoints at once but drains its requests: the
    Node lets the runs it has there finish, refuses new ones (retryable), and then leaves."""
    config = wire_config([{"id": "p1", "adapter": SLOW}])
    leaving, staying = await start_hub(config), await start_hub(config)
    service = Service(leaving, staying)
    agent = await following(service, 0.1)
    await welcomed_by(agent, [leaving, staying], until)
    running = asyncio.create_task(events_of(leaving, request("a", 40)))  # 2 s
    await until(lambda: agent.runner.running == 1)

    service.ready = [address(staying)]
    await until(lambda: leaving.connected_providers()["p1"].reason == DRAINING)
    assert agent.runner.running == 1  # the run goes on
    (late,) = await events_of(leaving, request("b", 1))
    assert isinstance(late, RunFailed)
    assert (late.code, late.retryable) == (statuses.PROVIDER_BUSY, True)

    events = await running
    assert isinstance(events[-1], RunDone), events[-1]
    await until(lambda: "node-1" not in leaving.nodes())  # left once its run was done
    assert list(agent.connections) == [address(staying)]
    assert staying.connected_providers()["p1"].healthy
    assert isinstance((await events_of(staying, request("c", 1)))[-1], RunDone)
