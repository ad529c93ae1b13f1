"""What the operator writes: the rendered edge.yaml, the compact record of the last apply, and
the kept configs of the cluster revisions (what a pin to a revision number puts back)."""

from __future__ import annotations

import base64
import copy
import gzip
import os
from dataclasses import replace
from typing import Any

import orjson
import pytest

from iop.edgeconfig import EdgeConfig, config_hash, load_data, load_text
from iop.operator.documents import (
    KEPT_BUDGET,
    AppliedState,
    EdgeBaseline,
    KeptConfigs,
    NodeBaseline,
    Owner,
    RestartRecord,
    decode_kept,
    decode_state,
    edge_configmap,
    kept_configmap,
    render_config,
    state_configmap,
)
from iop.verdicts import Figures

OWNER = Owner("demo", "ns", "uid-1")


def test_the_rendered_config_loads_back_to_the_same_hash(document) -> None:
    config = load_data(document)
    text = render_config(config)
    assert text.startswith("{") and "\n" not in text  # compact JSON: YAML, parsed at C speed
    assert config_hash(load_text(text)) == config_hash(config)
    assert "max_queue" not in text  # only what the spec set


def test_a_camel_case_spec_renders_snake_case(document) -> None:
    document["nodes"][0]["tokenHashSha256"] = document["nodes"][0].pop("token_hash_sha256")
    assert "token_hash_sha256" in render_config(load_data(document))


def test_the_edge_configmap_is_owned_and_stamped(document) -> None:
    config = load_data(document)
    body = edge_configmap(OWNER, config, config_hash(config))
    metadata = body["metadata"]
    assert metadata["name"] == "demo-edge"
    assert metadata["annotations"] == {"iop.dev/config-hash": config_hash(config)}
    assert metadata["ownerReferences"][0]["uid"] == "uid-1"
    assert body["data"]["edge.yaml"] == render_config(config)


def test_the_record_round_trips_compressed(document) -> None:
    config = load_data(document)
    state = AppliedState(
        config,
        config_hash(config),
        7,
        {"Deployment/demo-edge": "ab" * 32},
        (RestartRecord("node:node-2", "cd" * 32),),
    )
    body = state_configmap(OWNER, state)
    packed = base64.b64decode(body["binaryData"]["config.json.gz"])
    assert len(packed) < len(render_config(config))
    assert decode_state(orjson.loads(orjson.dumps(body))) == state


def test_a_node_restarts_baseline_survives_in_the_record(document) -> None:
    """What a node's new process is held to outlives the operator that noted it."""
    config = load_data(document)
    baseline = NodeBaseline("cd" * 32, frozenset({"p-1", "p-2"}), frozenset({"vllm-a"}))
    state = AppliedState(
        config,
        config_hash(config),
        7,
        restarts=(RestartRecord("node:node-2", "cd" * 32),),
        baselines={"node:node-2": baseline},
    )
    body = state_configmap(OWNER, state)
    assert orjson.loads(body["data"]["nodeBaselines"]) == {
        "node:node-2": {"configHash": "cd" * 32, "instances": ["p-1", "p-2"], "healthy": ["vllm-a"]}
    }
    back = decode_state(orjson.loads(orjson.dumps(body)))
    assert back is not None and back.baselines == {"node:node-2": baseline}
    assert "nodeBaselines" not in state_configmap(OWNER, replace(state, baselines={}))["data"]


def test_an_edge_restarts_baseline_survives_in_the_record(document) -> None:
    """What the Edge's old pods had served when it was stamped outlives the operator too."""
    config = load_data(document)
    figures = Figures(
        120, 3, 1, 2, (1,) * len(Figures().first_tokens), (2,) * len(Figures().durations)
    )
    baseline = EdgeBaseline("cd" * 32, {"demo-edge-0": figures, "demo-edge-1": Figures()})
    state = AppliedState(
        config,
        config_hash(config),
        7,
        restarts=(RestartRecord("edge", "cd" * 32),),
        edge_baseline=baseline,
    )
    body = state_configmap(OWNER, state)
    back = decode_state(orjson.loads(orjson.dumps(body)))
    assert back is not None and back.edge_baseline == baseline
    assert "edgeBaseline" not in state_configmap(OWNER, replace(state, edge_baseline=None))["data"]
    # Unreadable (another release's buckets, say): the record still is, without it.
    broken = {**body, "data": {**body["data"], "edgeBaseline": '{"configHash": "x"}'}}
    assert decode_state(broken) == replace(state, edge_baseline=None)
    broken["data"]["nodeBaselines"] = '{"node:node-2": {"configHash": "x"}}'
    assert decode_state(broken) == replace(state, edge_baseline=None)


def test_many_nodes_compress_about_tenfold(document) -> None:
    template = document["nodes"][0]
    document["nodes"] = [
        {
            **template,
            "id": f"node-{n}",
            "token_hash_sha256": f"{n:064x}",
            "providers": [{**p, "id": f"{p['id']}-{n}"} for p in template["providers"]],
        }
        for n in range(300)
    ]
    document["models"] = [{"id": "m", "providers": {"pa-0": "served-1"}}]
    config = load_data(document)
    body = state_configmap(OWNER, AppliedState(config, config_hash(config), 1))
    plain = len(render_config(config))
    packed = len(gzip.decompress(base64.b64decode(body["binaryData"]["config.json.gz"])))
    assert packed == plain
    assert len(base64.b64decode(body["binaryData"]["config.json.gz"])) * 5 < plain


def test_an_unreadable_record_means_starting_afresh(document) -> None:
    config = load_data(document)
    body = state_configmap(OWNER, AppliedState(config, config_hash(config), 1))
    broken = {**body, "binaryData": {"config.json.gz": base64.b64encode(b"not gzip").decode()}}
    assert decode_state(broken) is None
    lying = {**body, "data": {**body["data"], "configHash": "0" * 64}}
    assert decode_state(lying) is None
    assert decode_state({"metadata": {"name": "x"}}) is None


def test_the_stable_revision_round_trips_once_when_it_is_the_config(document) -> None:
    config = load_data(document)
    stamps = {"Deployment/demo-edge": "ab" * 32}
    state = AppliedState(config, config_hash(config), 7, stamps).with_stable()
    body = state_configmap(OWNER, state)
    assert set(body["binaryData"]) == {"config.json.gz"}  # the same config kept once
    assert decode_state(orjson.loads(orjson.dumps(body))) == state

    document["nodes"][0]["providers"][0]["capacity"] = 9
    newer = load_data(document)
    next_state = AppliedState(newer, config_hash(newer), 8, {}, stable=state.stable)
    body = state_configmap(OWNER, next_state)
    assert set(body["binaryData"]) == {"config.json.gz", "stable.json.gz"}
    back = decode_state(orjson.loads(orjson.dumps(body)))
    assert back == next_state
    assert back is not None and back.stable is not None
    assert (back.stable.config_hash, dict(back.stable.stamps)) == (config_hash(config), stamps)
    lying = {**body, "data": {**body["data"], "stableConfigHash": "0" * 64}}
    assert decode_state(lying) is None  # a stable config that does not match: start afresh


# -- the kept configs ----------------------------------------------------------------------------


def revision_configs(document: dict[str, Any], count: int) -> list[EdgeConfig]:
    """`count` configs that differ in one provider's capacity (revision 1 first)."""
    configs = []
    for capacity in range(1, count + 1):
        changed = copy.deepcopy(document)
        changed["nodes"][0]["providers"][0]["capacity"] = capacity
        configs.append(load_data(changed))
    return configs


def through_the_api(body: dict[str, Any]) -> dict[str, Any]:
    """The ConfigMap as the API server gives it back (JSON; binaryData keys in sorted order)."""
    back: dict[str, Any] = orjson.loads(orjson.dumps(body))
    back["binaryData"] = dict(sorted(back["binaryData"].items()))
    return back


def test_the_kept_configs_round_trip_newest_first_each_config_once(document) -> None:
    one, two = revision_configs(document, 2)
    h1, h2 = config_hash(one), config_hash(two)
    # Revision 3 restores revision 1: the same config, kept once, for both numbers.
    history = [(3, h1), (2, h2), (1, h1)]
    kept = KeptConfigs().keeping(history, {h1: one, h2: two})
    assert kept.hashes() == (h1, h2)
    assert kept.revisions == ((3, h1), (2, h2), (1, h1))
    body = kept_configmap(OWNER, kept)
    metadata = body["metadata"]
    assert metadata["name"] == "demo-edge-revisions"
    assert metadata["ownerReferences"][0]["uid"] == "uid-1"
    assert set(body["binaryData"]) == {f"{h1}.json.gz", f"{h2}.json.gz"}
    back = decode_kept(through_the_api(body))
    assert back == kept
    assert back.config_of(h1) == one and back.config_of(h2) == two
    assert back.config_of("0" * 64) is None  # never kept
    assert back.size() == kept.size() > 0


def test_what_is_kept_is_not_packed_again_and_what_left_the_history_goes(document) -> None:
    one, two, three = revision_configs(document, 3)
    h1, h2, h3 = (config_hash(c) for c in (one, two, three))
    kept = KeptConfigs().keeping([(2, h2), (1, h1)], {h1: one, h2: two})
    # The next pass knows only the new config: the others come from what is kept.
    later = kept.keeping([(3, h3), (2, h2)], {h3: three})
    assert later.hashes() == (h3, h2)
    assert dict(later.packed)[h2] == dict(kept.packed)[h2]
    assert later.config_of(h1) is None  # revision 1 left the history: its config goes
    # A revision whose config neither is kept nor known (an operator before this record) is
    # left out; the rest are kept.
    assert KeptConfigs().keeping([(3, h3), (2, h2)], {h3: three}).hashes() == (h3,)


def test_the_budget_drops_the_oldest_first(document) -> None:
    configs = revision_configs(document, 4)
    hashes = [config_hash(c) for c in configs]
    history = [(n, hashes[n - 1]) for n in (4, 3, 2, 1)]
    known = dict(zip(hashes, configs, strict=True))
    every = KeptConfigs().keeping(history, known)
    sizes = {digest: KeptConfigs(((digest, text),)).size() for digest, text in every.packed}
    assert every.size() == sum(sizes.values()) <= KEPT_BUDGET
    # Room for the newest two only: revisions 2 and 1 are dropped.
    budget = sizes[hashes[3]] + sizes[hashes[2]] + sizes[hashes[1]] - 1
    kept = KeptConfigs().keeping(history, known, budget=budget)
    assert kept.hashes() == (hashes[3], hashes[2])
    assert kept.revisions == ((4, hashes[3]), (3, hashes[2]))
    assert kept.size() <= budget
    # The newest alone over the budget: nothing is kept (an older one is never kept before it).
    assert KeptConfigs().keeping(history, known, budget=sizes[hashes[3]] - 1).hashes() == ()


def test_a_config_that_does_not_compress_is_counted_by_its_compressed_bytes(document) -> None:
    document["nodes"][0]["token_hash_sha256"] = os.urandom(32).hex()
    config = load_data(document)
    kept = KeptConfigs().keeping([(1, config_hash(config))], {config_hash(config): config})
    ((_, text),) = kept.packed
    assert kept.size() == len(base64.b64decode(text))


@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(base64.b64encode(b"not gzip").decode(), id="not-gzip"),
        pytest.param("%%%", id="not-base64"),
        pytest.param(base64.b64encode(gzip.compress(b"{}")).decode(), id="not-a-config"),
    ],
)
def test_an_unreadable_kept_config_is_none(document, packed: str) -> None:
    one, two = revision_configs(document, 2)
    h1, h2 = config_hash(one), config_hash(two)
    kept = KeptConfigs().keeping([(2, h2), (1, h1)], {h1: one, h2: two})
    body = through_the_api(kept_configmap(OWNER, kept))
    body["binaryData"][f"{h1}.json.gz"] = packed
    back = decode_kept(body)
    assert back.config_of(h1) is None
    assert back.config_of(h2) == two  # the others still serve


def test_a_config_kept_under_another_hash_is_none(document) -> None:
    one, two = revision_configs(document, 2)
    h1, h2 = config_hash(one), config_hash(two)
    body = through_the_api(kept_configmap(OWNER, KeptConfigs().keeping([(1, h1)], {h1: one})))
    swapped = kept_configmap(OWNER, KeptConfigs().keeping([(2, h2)], {h2: two}))
    body["binaryData"][f"{h1}.json.gz"] = swapped["binaryData"][f"{h2}.json.gz"]
    assert decode_kept(body).config_of(h1) is None


def test_an_unreadable_index_keeps_none_and_an_unnamed_key_is_left_out(document) -> None:
    one, two = revision_configs(document, 2)
    h1, h2 = config_hash(one), config_hash(two)
    body = through_the_api(kept_configmap(OWNER, KeptConfigs().keeping([(1, h1)], {h1: one})))
    assert decode_kept({**body, "data": {"revisions": "not json"}}) == KeptConfigs()
    assert decode_kept({**body, "data": {"revisions": '[{"revision": 1}]'}}) == KeptConfigs()
    assert decode_kept({"metadata": {"name": "x"}}) == KeptConfigs()
    # A key left by an older write (a merge, not an apply) that the index does not name.
    extra = kept_configmap(OWNER, KeptConfigs().keeping([(2, h2)], {h2: two}))["binaryData"]
    body["binaryData"].update(extra)
    assert decode_kept(body).hashes() == (h1,)
