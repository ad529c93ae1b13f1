"""`nodes[].placement`: a node placed on the Edge has no token, its restarts are the Edge's, and
its providers' capacity is shared equally among the Edge replicas."""

from __future__ import annotations

from typing import Any

import pytest

from iop.edgeconfig import ConfigError, RestartPath, classify, edge_share, load_data


def on_edge(data: dict[str, Any]) -> None:
    node = data["nodes"][0]
    node.pop("token_hash_sha256", None)
    node.pop("token_secret", None)
    node["placement"] = "edge"


def problems_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_data(data)
    return [str(p) for p in info.value.problems]


def test_a_node_placed_on_the_edge_loads_without_a_token(build: Any) -> None:
    config = load_data(build(on_edge))
    assert config.nodes[0].on_edge and not config.nodes[1].on_edge
    assert config.nodes[0].token_hash_sha256 is None


def test_a_node_placed_on_the_edge_refuses_a_token_and_a_node_needs_one(build: Any) -> None:
    def with_token(data: dict[str, Any]) -> None:
        on_edge(data)
        data["nodes"][0]["token_hash_sha256"] = "a" * 64

    (problem,) = problems_of(build(with_token))
    assert problem.startswith("nodes[0]: ")
    assert "placement edge" in problem and "remove its token_hash_sha256" in problem

    def without_token(data: dict[str, Any]) -> None:
        data["nodes"][0].pop("token_hash_sha256", None)

    (problem,) = problems_of(build(without_token))
    assert problem.startswith("nodes[0]: ") and "needs exactly one of" in problem


def test_an_unknown_placement_names_the_choices(build: Any) -> None:
    (problem,) = problems_of(build(lambda d: d["nodes"][0].update(placement="gpu")))
    assert problem.startswith("nodes[0].placement: ") and "'node'" in problem


def test_what_restarts_a_node_placed_on_the_edge_restarts_the_edge(build: Any) -> None:
    def new_url(data: dict[str, Any]) -> None:
        on_edge(data)
        provider = data["nodes"][0]["providers"][0]
        provider["adapter"]["base_url"] = "http://10.0.0.9:8000/v1"
        provider["capacity"] = 9

    report = classify(load_data(build(on_edge)), load_data(build(new_url)))
    (restart,) = report.restart_required_paths
    assert restart == RestartPath("nodes[node-1].providers[vllm-a].adapter.base_url", "edge")
    assert report.live_paths == ("nodes[node-1].providers[vllm-a].capacity",)

    # The same change on a node in a Node agent restarts only that node.
    def new_url_in_a_node(data: dict[str, Any]) -> None:
        data["nodes"][0]["providers"][0]["adapter"]["base_url"] = "http://10.0.0.9:8000/v1"

    report = classify(load_data(build()), load_data(build(new_url_in_a_node)))
    assert report.restart_scopes == ("node:node-1",)


def test_moving_a_node_onto_the_edge_restarts_the_edge(build: Any) -> None:
    report = classify(load_data(build()), load_data(build(on_edge)))
    assert RestartPath("nodes[node-1].placement", "edge") in report.restart_required_paths


@pytest.mark.parametrize(
    ("value", "replicas", "share"),
    [(8, 1, 8), (8, 2, 4), (9, 2, 4), (8, 3, 2), (2, 3, 1), (1, 5, 1), (0, 4, 0), (5, 0, 5)],
)
def test_each_replica_takes_the_floor_of_an_equal_share_at_least_one(
    value: int, replicas: int, share: int
) -> None:
    assert edge_share(value, replicas) == share
