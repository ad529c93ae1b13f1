"""Properties of loading and classification over many generated configs (hypothesis)."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop.edgeconfig import ConfigError, classify, load_data, load_text

SERVED = ["m-a", "m-b", "m-c"]


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    """A valid config document with 1-3 nodes, 1-3 providers each, 1-3 models."""
    nodes = []
    providers: list[dict[str, Any]] = []
    for n in range(draw(st.integers(1, 3))):
        node_providers = []
        for p in range(draw(st.integers(1, 3))):
            capacity = draw(st.integers(1, 8))
            provider = {
                "id": f"p-{n}-{p}",
                "adapter": draw(
                    st.sampled_from(
                        [{"type": "fake"}, {"type": "openai", "base_url": f"http://h{n}:80{p}/v1"}]
                    )
                ),
                "served_models": draw(st.lists(st.sampled_from(SERVED), min_size=1, unique=True)),
                "capacity": capacity,
                "long_context_slots": draw(st.none() | st.integers(0, capacity)),
                "priority": draw(st.integers(0, 3)),
                "enabled": draw(st.booleans()),
                "max_queue": draw(st.integers(0, 10)),
            }
            node_providers.append(provider)
            providers.append(provider)
        nodes.append(
            {"id": f"node-{n}", "token_hash_sha256": f"{n:x}" * 64, "providers": node_providers}
        )
    models = []
    for m in range(draw(st.integers(1, 3))):
        chosen = draw(st.lists(st.sampled_from(providers), min_size=1, max_size=3, unique_by=id))
        if all(p["long_context_slots"] == 0 for p in chosen):
            chosen[0]["long_context_slots"] = None
        models.append(
            {
                "id": f"model-{m}",
                "providers": {p["id"]: p["served_models"][0] for p in chosen},
                "generation": {"max_tokens": draw(st.integers(1, 4096))},
            }
        )
    tokens = [
        {"token_ref": f"app-{t}", "token_hash_sha256": f"{t + 10:02x}" * 32, "principal_ref": "p"}
        for t in range(draw(st.integers(0, 2)))
    ]
    return {
        "edge": {"id": "edge-a"},
        "openai": {"principal_tokens": tokens},
        "models": models,
        "nodes": nodes,
    }


@given(documents())
def test_generated_documents_are_valid_and_unchanged_by_themselves(doc: dict[str, Any]) -> None:
    config = load_data(doc)
    assert not classify(config, config).changed
    assert not classify(config, load_data(copy.deepcopy(doc))).changed


@given(documents(), st.randoms(use_true_random=False))
def test_classification_ignores_list_order(doc: dict[str, Any], rnd: Any) -> None:
    shuffled = copy.deepcopy(doc)
    rnd.shuffle(shuffled["nodes"])
    rnd.shuffle(shuffled["models"])
    rnd.shuffle(shuffled["openai"]["principal_tokens"])
    for node in shuffled["nodes"]:
        rnd.shuffle(node["providers"])
        for provider in node["providers"]:
            rnd.shuffle(provider["served_models"])
    report = classify(load_data(doc), load_data(shuffled))
    assert not report.changed, report


def _first_provider(doc: dict[str, Any]) -> dict[str, Any]:
    provider: dict[str, Any] = doc["nodes"][0]["providers"][0]
    return provider


RESTART_MUTATIONS = {
    "edge.listen": lambda d: d["edge"].update(listen="0.0.0.0:1"),
    "edge.admin.listen": lambda d: d["edge"].update(admin={"listen": "127.0.0.1:1"}),
    "openai.listen": lambda d: d["openai"].update(listen="0.0.0.0:2"),
    "control_plane.url": lambda d: d.update(control_plane={"url": "http://cp:1"}),
    "nodes[node-0].alias": lambda d: d["nodes"][0].update(alias="renamed"),
    "nodes[node-0].token_hash_sha256": lambda d: d["nodes"][0].update(token_hash_sha256="f" * 64),
    "nodes[node-0].providers[p-0-0].adapter": lambda d: _first_provider(d).update(
        adapter={"type": "openai", "base_url": "http://elsewhere:1/v1"}
    ),
    "openai.principal_tokens[app-new]": lambda d: d["openai"]["principal_tokens"].append(
        {"token_ref": "app-new", "token_hash_sha256": "e" * 64, "principal_ref": "x"}
    ),
    "nodes[node-new]": lambda d: d["nodes"].append(
        {"id": "node-new", "token_hash_sha256": "d" * 64}
    ),
}

LIVE_MUTATIONS = {
    "capacity": lambda d: _first_provider(d).update(capacity=_first_provider(d)["capacity"] + 1),
    "priority": lambda d: _first_provider(d).update(priority=9),
    "enabled": lambda d: _first_provider(d).update(enabled=not _first_provider(d)["enabled"]),
    "queue_timeout_ms": lambda d: _first_provider(d).update(queue_timeout_ms=123),
    "max_tokens": lambda d: d["models"][0]["generation"].update(max_tokens=5000),
    "threshold": lambda d: d["openai"].update(long_context_threshold_tokens=7),
}


@given(documents(), st.sampled_from(sorted(RESTART_MUTATIONS)))
def test_a_restart_field_change_is_always_restart_required(doc: dict[str, Any], path: str) -> None:
    changed = copy.deepcopy(doc)
    RESTART_MUTATIONS[path](changed)
    report = classify(load_data(doc), load_data(changed))
    if report.changed:  # an alias set to the same value, say, is no change
        restart = [p.path for p in report.restart_required_paths]
        assert any(p == path or p.startswith(f"{path}.") for p in restart), report


@given(documents(), st.sampled_from(sorted(LIVE_MUTATIONS)))
def test_a_live_field_change_is_never_restart_required(doc: dict[str, Any], name: str) -> None:
    changed = copy.deepcopy(doc)
    LIVE_MUTATIONS[name](changed)
    report = classify(load_data(doc), load_data(changed))
    assert not report.restart_required, report


KEYS = [
    "edge", "id", "listen", "nodes", "models", "providers", "capacity", "openai", "adapter",
    "type", "fake", "openai", "served_models", "long_context_slots", "token", "principal_tokens",
    "token_hash_sha256", "priority", "generation", "max_tokens", "servedModels", "x",
]  # fmt: skip
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 10)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.sampled_from(["0.0.0.0:80", "sk-abcdefghijklmnop", "a" * 64, "fake", "openai"])
)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=25,
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(JSONISH)
def test_arbitrary_documents_raise_only_config_errors(document: object) -> None:
    try:
        load_data(document)
    except ConfigError as error:
        assert error.problems
        assert all(isinstance(p.path, str) and p.message for p in error.problems)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_arbitrary_text_raises_only_config_errors(text: str) -> None:
    try:
        load_text(text)
    except ConfigError as error:
        assert error.problems
