"""A Node heals itself: any error in a session ends in a reconnect, and sessions leave nothing.

Real node hub (gRPC on loopback) and real Node connections; the fault is injected into the
Node's runner, where a bug in an adapter built from a pushed config would surface.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from iop.edge.hub.nodehub import NodeHub
from iop.edgeconfig import EdgeConfig, NodePayload
from iop.node import Backoff, EdgeConnection, NodeAgent, NodeIdentity
from iop.providers import Runner

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")

FAKE = {"type": "fake", "completion_tokens": 2}


class InjectedBug(Exception):
    """What an adapter constructor with a bug raises."""


async def test_an_unexpected_error_is_logged_and_followed_by_a_reconnect(
    wire_config: Callable[..., EdgeConfig],
    start_hub: Callable[[EdgeConfig], Awaitable[NodeHub]],
    start_node: Callable[..., Awaitable[NodeAgent]],
    until: Callable[..., Awaitable[None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": FAKE}]))
    agent = await start_node(hub)
    (connection,) = agent.connections.values()
    assert connection.welcomes == 1

    # The next config the Node applies blows up, once, the way a buggy adapter would.
    runner = agent.runner
    real_apply = runner.apply
    faults: list[NodePayload] = []

    def apply_with_a_bug(payload: NodePayload, digest: str | None = None) -> bool:
        if not faults:
            faults.append(payload)
            raise InjectedBug("adapter constructor failed")
        return real_apply(payload, digest)

    runner.apply = apply_with_a_bug  # type: ignore[method-assign]
    caplog.set_level(logging.ERROR, logger="iop.node.connecting")
    await hub.swap_config(wire_config([{"id": "p1", "adapter": {**FAKE, "completion_tokens": 3}}]))

    # The session died on the bug; the Node said why, with the traceback, and came back.
    await until(lambda: connection.welcomes == 2)
    await until(lambda: hub.connected_providers())
    assert len(faults) == 1
    assert connection.failures >= 1
    assert "InjectedBug" in connection.last_error
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[0] is InjectedBug]
    assert logged, "the unexpected error was not logged with its traceback"
    # The reconnected session serves the config the Edge holds now.
    assert runner.registry.payload is not None
    assert runner.registry.payload.providers[0].adapter["completion_tokens"] == 3


async def test_health_listeners_stay_flat_over_200_sessions(
    wire_config: Callable[..., EdgeConfig],
    start_hub: Callable[[EdgeConfig], Awaitable[NodeHub]],
    node_token: str,
    tls: Any,
) -> None:
    hub = await start_hub(wire_config([{"id": "p1", "adapter": FAKE}]))
    runner = Runner(drain_timeout=1.0)
    credentials = tls.client().credentials()
    identity = NodeIdentity("node-1", node_token, instance_id="healing")
    try:
        for _ in range(200):
            # An Edge replica that comes and goes: a connection made, welcomed, then dropped.
            connection = EdgeConnection(
                f"127.0.0.1:{hub.port}",
                identity,
                runner,
                backoff=Backoff(0.01, 0.05),
                tls=tls.client(),
                credentials=credentials,
            )
            task = asyncio.create_task(connection.run(), name="healing-connection")
            await asyncio.wait_for(connection.connected.wait(), 10)
            assert runner.health_listeners == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert runner.health_listeners == 0
    finally:
        await runner.aclose()
