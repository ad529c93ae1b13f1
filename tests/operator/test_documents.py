"""What the operator writes: the rendered edge.yaml, and the compact record of the last apply."""

from __future__ import annotations

import base64
import gzip
from dataclasses import replace

import orjson

from iop.edgeconfig import config_hash, load_data, load_text
from iop.operator.documents import (
    AppliedState,
    EdgeBaseline,
    NodeBaseline,
    Owner,
    RestartRecord,
    decode_state,
    edge_configmap,
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
    broken = {**body, "data": {**body["data"], "edgeBaseline": '{"configHash": "x"}'}}
    assert decode_state(broken) is None  # unreadable: start afresh


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
