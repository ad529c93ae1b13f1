"""The hub's snapshot of a config (`HubSnapshot.of`): what a live change rebuilds."""

from __future__ import annotations

import copy
from typing import Any

from iop.edge.hub import NodeHub
from iop.edge.hub.snapshots import HubSnapshot
from iop.edgeconfig import EdgeConfig, NodePayload
from testkit import edge_document, provider

FAKE = {"type": "fake"}


def fleet(nodes: int) -> dict[str, Any]:
    return edge_document(
        {f"node-{i}": [provider(f"p{i}", FAKE)] for i in range(nodes)},
        {f"m{i}": [f"p{i}"] for i in range(nodes)},
    )


def test_a_node_whose_spec_did_not_change_keeps_its_payload_and_digest() -> None:
    document = fleet(3)
    first = HubSnapshot.of(EdgeConfig.model_validate(document), 1)
    changed = copy.deepcopy(document)
    changed["nodes"][1]["providers"][0]["capacity"] += 1
    second = HubSnapshot.of(EdgeConfig.model_validate(changed), 2, first)

    # The same objects, not rebuilt: a change to one node of thousands builds one payload.
    assert second.payloads["node-0"] is first.payloads["node-0"]
    assert second.payloads["node-2"] is first.payloads["node-2"]
    assert second.digests["node-0"] == first.digests["node-0"]
    node_1 = NodePayload.of(EdgeConfig.model_validate(changed).nodes[1])
    assert second.payloads["node-1"] == node_1
    assert second.digests["node-1"] == node_1.digest != first.digests["node-1"]


def test_a_node_added_or_removed_is_built_or_gone() -> None:
    document = fleet(2)
    first = HubSnapshot.of(EdgeConfig.model_validate(document), 1)
    grown = fleet(3)
    second = HubSnapshot.of(EdgeConfig.model_validate(grown), 2, first)
    assert set(second.payloads) == {"node-0", "node-1", "node-2"}
    assert second.digests["node-2"] == second.payloads["node-2"].digest
    assert second.provider_nodes["p2"] == "node-2"
    third = HubSnapshot.of(EdgeConfig.model_validate(fleet(1)), 3, second)
    assert set(third.payloads) == set(third.digests) == {"node-0"}
    assert third.payloads["node-0"] is first.payloads["node-0"]


async def test_a_swap_prepared_off_the_loop_is_the_snapshot_swapped_in() -> None:
    """`prepare` (in the refresher's worker thread) builds what `swap_config` swaps in; one of
    another config or generation is not used."""
    document = fleet(2)
    hub = NodeHub(EdgeConfig.model_validate(document))
    changed = copy.deepcopy(document)
    changed["nodes"][1]["providers"][0]["capacity"] += 1
    config = EdgeConfig.model_validate(changed)

    prepared = hub.prepare(config, 2)
    assert prepared.replaces is hub.snapshot.config is not config
    assert prepared.replaced_payloads is hub.snapshot.payloads
    await hub.swap_config(config, generation=2, prepared=prepared)
    assert hub.snapshot is prepared.snapshot
    assert hub.snapshot.payloads is prepared.payloads

    stale = hub.prepare(config, 3)
    await hub.swap_config(config, generation=4, prepared=stale)
    assert hub.snapshot is not stale.snapshot and hub.snapshot.generation == 4
