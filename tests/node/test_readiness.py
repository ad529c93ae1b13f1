"""A Node's readiness (`NodeAgent.readiness`, its `/readyz`) names what of its config cannot run.

Real node hub (gRPC on loopback) and a real in-process Node; tests/node/test_node_processes.py
asks `iop node run`'s own `/readyz`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from iop.edge.hub.nodehub import NodeHub
from iop.edgeconfig import EdgeConfig
from iop.node import NodeAgent
from iop.node.agents import MAX_REASON_CHARS
from iop.processes import free_port

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


async def test_the_reason_is_bounded_and_counts_the_providers_it_leaves_out(
    wire_config: Callable[..., EdgeConfig],
    start_hub: Callable[[EdgeConfig], Awaitable[NodeHub]],
    start_node: Callable[..., Awaitable[NodeAgent]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """30 providers whose key variable is unset: the reason names as many as fit in
    `MAX_REASON_CHARS`, whole, and says how many more there are."""
    down = f"http://127.0.0.1:{free_port()}/v1"
    names = [f"IOP_TEST_UNSET_KEY_{i:02d}_".ljust(52, "X") for i in range(30)]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    providers = [
        {"id": f"p{i:02d}", "adapter": {"type": "openai", "base_url": down, "api_key_env": name}}
        for i, name in enumerate(names)
    ]
    agent = await start_node(await start_hub(wire_config(providers)))
    await agent.wait_connected()  # welcomed: the config applied

    entries = [
        f"provider p{i:02d}: environment variable {n} is not set" for i, n in enumerate(names)
    ]
    assert {len(entry) for entry in entries} == {98}  # 9 of them and the count fit in 1,000
    assert agent.readiness() == (False, "; ".join(entries[:9]) + "; and 21 more")
    assert len(agent.readiness()[1]) <= MAX_REASON_CHARS
