"""Change classification: the spec's live / restart-required table, path by path."""

from __future__ import annotations

from typing import Any

import pytest

from iop.edgeconfig import (
    EdgeConfig,
    ModelSpec,
    RestartPath,
    classify,
    config_hash,
    load_data,
    node_payloads,
)

P0 = "nodes[node-1].providers[vllm-a]"


def change(build: Any, mutate: Any) -> Any:
    return classify(load_data(build()), load_data(build(mutate)))


def provider(data: dict[str, Any], index: int = 0) -> dict[str, Any]:
    result: dict[str, Any] = data["nodes"][0]["providers"][index]
    return result


LIVE = [
    pytest.param(lambda d: provider(d).update(capacity=3), f"{P0}.capacity", id="capacity"),
    pytest.param(lambda d: provider(d).update(priority=1), f"{P0}.priority", id="priority"),
    pytest.param(lambda d: provider(d).update(max_queue=1), f"{P0}.max_queue", id="max-queue"),
    pytest.param(
        lambda d: provider(d).update(queue_timeout_ms=5),
        f"{P0}.queue_timeout_ms",
        id="queue-timeout",
    ),
    pytest.param(lambda d: provider(d).update(enabled=False), f"{P0}.enabled", id="enabled"),
    pytest.param(
        lambda d: provider(d).update(health={"interval_ms": 1000}),
        f"{P0}.health.interval_ms",
        id="health-probe-interval",
    ),
    pytest.param(
        lambda d: provider(d).update(long_context_slots=2),
        f"{P0}.long_context_slots",
        id="long-slots",
    ),
    pytest.param(
        lambda d: provider(d)["served_models"].append("meta/llama-2"),
        f"{P0}.served_models",
        id="served-models",
    ),
    pytest.param(
        lambda d: d["models"].append({"id": "new", "providers": {"fake-c": "echo"}}),
        "models[new]",
        id="model-added",
    ),
    pytest.param(lambda d: d["models"].pop(1), "models[echo]", id="model-removed"),
    pytest.param(
        lambda d: d["models"][0]["providers"].pop("ollama-b"),
        "models[llama].providers.ollama-b",
        id="model-mapping",
    ),
    pytest.param(
        lambda d: d["models"][0]["generation"].update(max_tokens=64),
        "models[llama].generation.max_tokens",
        id="generation-policy",
    ),
    pytest.param(
        lambda d: d["openai"].update(long_context_threshold_tokens=5),
        "openai.long_context_threshold_tokens",
        id="long-context-threshold",
    ),
    pytest.param(
        lambda d: d["nodes"][0].update(runtime={"concurrency": 4}),
        "nodes[node-1].runtime.concurrency",
        id="legacy-concurrency",
    ),
    pytest.param(
        lambda d: d["models"][0].update(fallbacks=["echo"]),
        "models[llama].fallbacks",
        id="fallbacks",
    ),
    pytest.param(
        lambda d: d["models"][0].update(first_byte_timeout_ms=500),
        "models[llama].first_byte_timeout_ms",
        id="first-byte-timeout",
    ),
    pytest.param(
        lambda d: d["openai"].update(retries={"budget_percent": 5}),
        "openai.retries.budget_percent",
        id="retry-budget",
    ),
    pytest.param(
        lambda d: d["openai"].update(retries={"max_per_request": 0}),
        "openai.retries.max_per_request",
        id="retries-per-request",
    ),
]


@pytest.mark.parametrize(("mutate", "path"), LIVE)
def test_live_changes(build: Any, mutate: Any, path: str) -> None:
    report = change(build, mutate)
    assert report.live_paths == (path,)
    assert report.restart_required_paths == ()
    assert not report.restart_required


@pytest.mark.parametrize(("mutate", "path"), LIVE)
def test_the_payloads_a_caller_has_classify_as_those_built(
    build: Any, mutate: Any, path: str
) -> None:
    """`payloads` (the hub's, built beside the classification) change nothing in the report."""
    old, new = load_data(build()), load_data(build(mutate))
    payloads = (node_payloads(old), node_payloads(new))
    assert classify(old, new, payloads=payloads) == classify(old, new)


RESTART = [
    pytest.param(lambda d: d["edge"].update(id="edge-b"), "edge.id", "edge", id="edge-id"),
    pytest.param(
        lambda d: d["edge"].update(listen="0.0.0.0:7444"), "edge.listen", "edge", id="node-listener"
    ),
    pytest.param(
        lambda d: d["edge"]["admin"].update(listen="127.0.0.1:9999"),
        "edge.admin.listen",
        "edge",
        id="admin-listener",
    ),
    pytest.param(
        lambda d: d["edge"].update(bootstrap={"artifact_path": "/srv/boot"}),
        "edge.bootstrap.artifact_path",
        "edge",
        id="bootstrap-path",
    ),
    pytest.param(
        lambda d: d.update(control_plane={"url": "https://cp.example/api"}),
        "control_plane.url",
        "edge",
        id="control-plane",
    ),
    pytest.param(
        lambda d: d["openai"].update(listen="0.0.0.0:8081"),
        "openai.listen",
        "edge",
        id="openai-listener",
    ),
    pytest.param(
        lambda d: d.update(a2a={"listen": "0.0.0.0:8090"}), "a2a.listen", "edge", id="a2a-listener"
    ),
    pytest.param(
        lambda d: d["openai"]["principal_tokens"].append(
            {"token_ref": "app-3", "token_hash_sha256": "e" * 64, "principal_ref": "t"}
        ),
        "openai.principal_tokens[app-3]",
        "edge",
        id="principal-token-added",
    ),
    pytest.param(
        lambda d: d["openai"]["principal_tokens"][0].update(principal_ref="team-b"),
        "openai.principal_tokens[app-1].principal_ref",
        "edge",
        id="principal-token-changed",
    ),
    pytest.param(
        lambda d: d["openai"].update(allow_unauthenticated=True),
        "openai.allow_unauthenticated",
        "edge",
        id="anonymous-access",
    ),
    pytest.param(
        lambda d: d["nodes"].append({"id": "node-3", "token_hash_sha256": "f" * 64}),
        "nodes[node-3]",
        "edge",
        id="node-added",
    ),
    pytest.param(
        lambda d: d["nodes"].pop(1) and d["models"].pop(1),
        "nodes[node-2]",
        "edge",
        id="node-removed",
    ),
    pytest.param(
        lambda d: d["nodes"][0].update(token_hash_sha256="9" * 64),
        "nodes[node-1].token_hash_sha256",
        "edge",
        id="node-token",
    ),
    pytest.param(
        lambda d: d["nodes"][0].update(alias="gpu-x"),
        "nodes[node-1].alias",
        "edge",
        id="node-alias",
    ),
    pytest.param(
        lambda d: provider(d)["adapter"].update(base_url="http://10.0.0.1:8000/v1"),
        f"{P0}.adapter.base_url",
        "node:node-1",
        id="adapter-url",
    ),
    pytest.param(
        lambda d: provider(d)["adapter"].update(api_key_env="VLLM_KEY"),
        f"{P0}.adapter.api_key_env",
        "node:node-1",
        id="adapter-key-env",
    ),
    pytest.param(
        lambda d: provider(d).update(adapter={"type": "fake"}),
        f"{P0}.adapter",
        "node:node-1",
        id="adapter-type",
    ),
    pytest.param(
        lambda d: d["nodes"][1]["providers"].append(
            {"id": "fake-d", "adapter": {"type": "fake"}, "served_models": ["echo"]}
        ),
        "nodes[node-2].providers[fake-d]",
        "node:node-2",
        id="provider-added",
    ),
]


@pytest.mark.parametrize(("mutate", "path", "scope"), RESTART)
def test_restart_required_changes(build: Any, mutate: Any, path: str, scope: str) -> None:
    report = change(build, mutate)
    assert RestartPath(path, scope) in report.restart_required_paths
    assert report.restart_required
    assert scope in report.restart_scopes


def test_provider_removed_is_restart_of_its_node(build: Any) -> None:
    def remove(d: dict[str, Any]) -> None:
        d["nodes"][0]["providers"].pop(1)
        d["models"][0]["providers"].pop("ollama-b")

    report = change(build, remove)
    assert report.restart_required_paths == (
        RestartPath("nodes[node-1].providers[ollama-b]", "node:node-1"),
    )
    assert report.live_paths == ("models[llama].providers.ollama-b",)
    assert report.changed_providers == ("ollama-b",)
    assert report.changed_nodes == ("node-1",)
    assert report.changed_models == ("llama",)


def test_no_change_is_empty_and_lists_are_never_none(build: Any) -> None:
    report = change(build, None)
    assert not report.changed
    document = report.as_dict()
    for key in (
        "changed_nodes",
        "changed_providers",
        "changed_models",
        "live_paths",
        "restart_required_paths",
        "nodes_to_push",
    ):
        assert document[key] == []
    assert document["node_payload_changed"] == {"node-1": False, "node-2": False}


def test_reordering_ids_is_no_change(build: Any) -> None:
    def shuffle(d: dict[str, Any]) -> None:
        provider(d, 1)["served_models"].reverse()
        d["nodes"][0]["providers"].reverse()
        d["nodes"].reverse()
        d["models"].reverse()
        d["openai"]["principal_tokens"].reverse()

    assert not change(build, shuffle).changed


def test_reordering_fallbacks_is_a_change_with_its_own_hash(build: Any) -> None:
    def three(d: dict[str, Any]) -> None:
        d["models"].append({"id": "third", "providers": {"fake-c": "echo"}})
        d["models"][0]["fallbacks"] = ["echo", "third"]

    def reversed_three(d: dict[str, Any]) -> None:
        three(d)
        d["models"][0]["fallbacks"].reverse()

    before, after = load_data(build(three)), load_data(build(reversed_three))
    assert classify(before, after).live_paths == ("models[llama].fallbacks",)
    assert config_hash(before) != config_hash(after)


def test_a_field_a_later_release_adds_with_a_default_keeps_every_hash(build: Any) -> None:
    """An operator and an Edge of two releases (mid-upgrade), one knowing a field the other does
    not, agree on the hash of a config that leaves the field at its default."""

    class LaterModelSpec(ModelSpec):
        added_later: int = 7

    class LaterEdgeConfig(EdgeConfig):
        models: list[LaterModelSpec]  # type: ignore[assignment]

    config = load_data(build())
    document = config.model_dump()
    later = LaterEdgeConfig.model_validate(document)
    assert config_hash(later) == config_hash(config)
    for model in document["models"]:
        model["added_later"] = 8
    assert config_hash(LaterEdgeConfig.model_validate(document)) != config_hash(config)


def test_changed_ids_are_reported(build: Any) -> None:
    def edit(d: dict[str, Any]) -> None:
        provider(d).update(capacity=1)
        d["models"][1]["generation"] = {"max_tokens": 9}

    report = change(build, edit)
    assert report.changed_nodes == ("node-1",)
    assert report.changed_providers == ("vllm-a",)
    assert report.changed_models == ("echo",)


@pytest.mark.parametrize(
    ("mutate", "pushed"),
    [
        pytest.param(lambda d: provider(d).update(capacity=3), ["node-1"], id="capacity"),
        pytest.param(lambda d: provider(d).update(enabled=False), ["node-1"], id="enabled"),
        pytest.param(
            lambda d: provider(d)["served_models"].append("x"), ["node-1"], id="served-models"
        ),
        pytest.param(
            lambda d: provider(d).update(health={"path": "/health"}), ["node-1"], id="health"
        ),
        pytest.param(lambda d: provider(d).update(priority=3), [], id="priority-stays-on-edge"),
        pytest.param(lambda d: provider(d).update(max_queue=3), [], id="queue-stays-on-edge"),
        pytest.param(
            lambda d: d["models"][0]["generation"].update(max_tokens=1), [], id="model-policy"
        ),
        pytest.param(
            lambda d: d["nodes"].append({"id": "node-3", "token_hash_sha256": "f" * 64}),
            ["node-3"],
            id="new-node",
        ),
    ],
)
def test_only_nodes_whose_payload_changed_are_pushed(
    build: Any, mutate: Any, pushed: list[str]
) -> None:
    assert list(change(build, mutate).nodes_to_push) == pushed


def test_many_changes_at_once_are_sorted_and_deterministic(build: Any) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["edge"]["listen"] = "0.0.0.0:1"
        provider(d).update(capacity=2, priority=0)
        provider(d, 1)["adapter"]["base_url"] = "http://127.0.0.1:1/v1"
        d["models"].append({"id": "a-model", "providers": {"fake-c": "echo"}})

    first = change(build, edit)
    assert first == change(build, edit)
    assert first.live_paths == (
        "models[a-model]",
        f"{P0}.capacity",
        f"{P0}.priority",
    )
    assert first.restart_required_paths == (
        RestartPath("edge.listen", "edge"),
        RestartPath("nodes[node-1].providers[ollama-b].adapter.base_url", "node:node-1"),
    )
