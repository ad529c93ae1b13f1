"""A Node serving two Edge replicas that disagree mid-rollout runs one payload and never flips.

The rule (iop.node.arbitrating): payloads are known by their content hash; the Node switches only
when every Edge it is connected to sends the same payload, keeps the one in use while they
disagree (acknowledging the new one as pending), and takes the most common one only when no
connected Edge offers the payload in use any more.
"""

from __future__ import annotations

import pytest

from iop.edgeconfig import EdgeConfig, node_payloads

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]

FAKE = {"type": "fake", "completion_tokens": 2}


def config_with(wire_config, capacity: int) -> EdgeConfig:
    config: EdgeConfig = wire_config([{"id": "p1", "adapter": FAKE, "capacity": capacity}])
    return config


def digest(config: EdgeConfig) -> str:
    return node_payloads(config)["node-1"].digest


async def test_replicas_that_disagree_never_flip_the_node(
    wire_config, start_hub, start_node, until
) -> None:
    old, new = config_with(wire_config, 4), config_with(wire_config, 6)
    edge_a, edge_b = await start_hub(old), await start_hub(old)
    node = await start_node(edge_a, edge_b)
    runner = node.runner
    assert runner.registry.digest == digest(old)
    applied: list[str] = []
    real_apply = runner.apply

    def apply(payload, known_digest=None):
        changed = real_apply(payload, known_digest)
        if changed:
            applied.append(runner.registry.digest)
        return changed

    runner.apply = apply

    # Replica A is refreshed first: the node holds the new payload as pending.
    acks = await edge_a.swap_config(new)
    (ack,) = acks.values()
    assert ack is not None and ack.ok and ack.pending
    assert ack.in_use_hash == digest(old)
    assert runner.registry.digest == digest(old)

    # Back and forth between the two replicas' views: nothing flips.
    for config in (old, new, old, new):
        await edge_a.swap_config(config)
    assert applied == []

    # Replica B catches up: now every Edge agrees, and the node switches, once.
    (ack,) = (await edge_b.swap_config(new)).values()
    assert ack is not None and ack.ok and not ack.pending
    assert applied == [digest(new)]
    assert runner.registry.provisions["p1"].payload.capacity == 6
