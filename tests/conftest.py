"""Fixtures shared across test areas: the runtime wire's real servers on port 0.

`wire_config(...)` builds a valid EdgeConfig with one node and its providers; `fake_upstream`
is a real fake OpenAI server on a loopback socket; `start_hub` and `start_node` start the Edge's
node hub and an in-process Node agent and stop them when the test ends. `no_leaked_tasks` fails
a test that leaves an asyncio task behind (wire tests use it through `pytestmark`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from iop.edge.nodehub import NodeHub
from iop.edgeconfig import EdgeConfig, load_data
from iop.node import NodeAgent
from iop.upstream import FakeUpstream, FakeUpstreamSettings

NODE_TOKEN = "node-1-secret-token"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def build_wire_config(
    providers: list[dict[str, Any]], *, node_id: str = "node-1", token: str = NODE_TOKEN
) -> EdgeConfig:
    """One Edge, one node holding `providers` (each needs id and adapter), one model each."""
    full = [{"served_models": ["served"], "capacity": 8, **provider} for provider in providers]
    return load_data(
        {
            "edge": {"id": "edge-test", "listen": "127.0.0.1:0"},
            "models": [{"id": f"m-{p['id']}", "providers": {p["id"]: "served"}} for p in full],
            "nodes": [{"id": node_id, "token_hash_sha256": sha256(token), "providers": full}],
        }
    )


@pytest.fixture
def wire_config() -> Callable[..., EdgeConfig]:
    return build_wire_config


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    before = asyncio.all_tasks()
    yield
    loop = asyncio.get_running_loop()
    until = loop.time() + 0.5  # closing sockets and finalizing generators take a few turns
    while True:
        await asyncio.sleep(0.01)
        leaked = [
            t
            for t in asyncio.all_tasks() - before
            if t is not asyncio.current_task() and not t.done()
        ]
        if not leaked or loop.time() > until:
            break
    assert not leaked, f"tasks leaked out of the test: {[t.get_name() for t in leaked]}"


@pytest.fixture
async def fake_upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream(FakeUpstreamSettings()) as upstream:
        yield upstream


@pytest.fixture
async def start_hub() -> AsyncIterator[Callable[[EdgeConfig], Awaitable[NodeHub]]]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(config: EdgeConfig) -> NodeHub:
            return await stack.enter_async_context(NodeHub(config))

        yield start


@pytest.fixture
async def start_node() -> AsyncIterator[Callable[..., Awaitable[NodeAgent]]]:
    """`await start_node(*hubs, token=..., **agent_options)`: a Node connected to the hubs."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(*hubs: NodeHub, wait: bool = True, **options: Any) -> NodeAgent:
            options.setdefault("node_id", "node-1")
            options.setdefault("token", NODE_TOKEN)
            options.setdefault("backoff_initial", 0.05)
            options.setdefault("backoff_max", 0.5)
            agent = NodeAgent(edges=[f"127.0.0.1:{hub.port}" for hub in hubs], **options)
            await stack.enter_async_context(agent)
            if wait:
                for hub in hubs:
                    await wait_until(hub.connected_providers)
            return agent

        yield start


async def wait_until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll `condition` until it holds (an event-free wait for state in another process)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while not condition():
        if loop.time() > until:
            raise TimeoutError("the condition did not hold in time")
        await asyncio.sleep(0.01)


@pytest.fixture
def until() -> Callable[..., Awaitable[None]]:
    """`await until(lambda: condition, timeout=10)`."""
    return wait_until


@pytest.fixture
def node_token() -> str:
    return NODE_TOKEN
