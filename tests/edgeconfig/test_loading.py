"""Loading and validation: every rule, each reported with its path, all at once."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from iop.edgeconfig import ConfigError, EdgeConfig, load_data, load_file, load_text

REPO = Path(__file__).resolve().parents[2]


def problems_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_data(data)
    return [str(p) for p in info.value.problems]


def test_the_sample_config_is_valid() -> None:
    config = load_file(REPO / "configs" / "edge.yaml")
    assert len(config.nodes) >= 3
    assert sum(len(n.providers) for n in config.nodes) >= 6
    assert len(config.models) >= 3
    assert config.openai.principal_tokens
    assert any(p.long_context_slots for n in config.nodes for p in n.providers)


def test_a_small_valid_config_loads(config_data: dict[str, Any]) -> None:
    config = load_data(config_data)
    assert isinstance(config, EdgeConfig)
    assert config.nodes[0].providers[0].capacity == 4
    assert config.models[0].generation.max_tokens == 512


def test_defaults_fill_what_is_left_out() -> None:
    config = load_data({"edge": {"id": "e"}})
    assert config.edge.listen == "0.0.0.0:7443"
    assert config.edge.admin.listen == "127.0.0.1:9090"
    assert config.openai.long_context_threshold_tokens == 100_000
    assert config.models == [] and config.nodes == []


def test_camel_case_is_the_same_config(config_data: dict[str, Any]) -> None:
    snake = load_data(config_data)
    camel_document = snake.model_dump(by_alias=True, mode="json")
    assert "longContextThresholdTokens" in camel_document["openai"]
    assert "servedModels" in camel_document["nodes"][0]["providers"][0]
    assert "tokenHashSha256" in camel_document["nodes"][0]
    assert "a2a" in camel_document  # only underscores start a word: not "a2A"
    assert load_data(camel_document) == snake


def test_sections_compare_by_their_values(config_data: dict[str, Any]) -> None:
    """`Spec.__eq__` (pydantic's, sped up) keeps pydantic's meaning: equal values, equal
    sections, whatever the spelling; one value apart, not equal; another type, not equal."""
    config = load_data(config_data)
    assert config == load_data(copy.deepcopy(config_data))
    assert hash(config.nodes[0].providers[0].health) == hash(
        load_data(config_data).nodes[0].providers[0].health
    )
    changed = copy.deepcopy(config_data)
    changed["nodes"][0]["providers"][0]["capacity"] += 1
    other = load_data(changed)
    assert other != config and other.nodes[0] != config.nodes[0]
    assert other.nodes[0].providers[0].health == config.nodes[0].providers[0].health
    assert config.nodes[0] != config.nodes[0].providers[0]
    assert config.nodes[0] != object()


def test_camel_case_errors_use_the_camel_path(config_data: dict[str, Any]) -> None:
    camel = load_data(config_data).model_dump(by_alias=True, mode="json")
    camel["nodes"][0]["providers"][0]["capacity"] = 0
    camel["nodes"][0]["providers"][0]["longContextSlots"] = 7
    assert problems_of(camel) == [
        "nodes[0].providers[0].capacity: must be >= 1, got 0",
        "nodes[0].providers[0].longContextSlots: must be <= capacity (0), got 7",
    ]


def test_long_context_slots_null_means_no_separate_limit(config_data: dict[str, Any]) -> None:
    config_data["nodes"][0]["providers"][0]["long_context_slots"] = None
    assert load_data(config_data).nodes[0].providers[0].long_context_slots is None


def _set(path: str, value: object) -> Any:
    """A mutator that sets `a.b[0].c` in a document."""

    def mutate(data: dict[str, Any]) -> None:
        *parents, leaf = _parse(path)
        target: Any = data
        for part in parents:
            target = target[part]
        target[leaf] = value

    return mutate


def _parse(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for chunk in path.replace("]", "").split("."):
        name, *indexes = chunk.split("[")
        parts.append(name)
        parts += [int(i) for i in indexes]
    return parts


RULES = [
    pytest.param(
        _set("nodes[1].id", "node-1"),
        'nodes[1].id: duplicate node id "node-1" (first at nodes[0].id)',
        id="duplicate-node-id",
    ),
    pytest.param(
        _set("models[1].id", "llama"),
        'models[1].id: duplicate model id "llama" (first at models[0].id)',
        id="duplicate-model-id",
    ),
    pytest.param(
        _set("nodes[1].providers[0].id", "vllm-a"),
        'nodes[1].providers[0].id: duplicate provider id "vllm-a" '
        "(first at nodes[0].providers[0].id)",
        id="duplicate-provider-id-across-nodes",
    ),
    pytest.param(
        _set("models[0].providers", {"vllm-x": "meta/llama"}),
        'models[0].providers.vllm-x: unknown provider "vllm-x"; did you mean "vllm-a"?',
        id="unknown-provider",
    ),
    pytest.param(
        _set("models[0].providers", {"ollama-b": "llama3.1"}),
        'models[0].providers.ollama-b: "llama3.1" is not served by provider "ollama-b" '
        '(nodes[0].providers[1].served_models: ["llama3", "mistral"]); did you mean "llama3"?',
        id="served-name-not-served",
    ),
    pytest.param(
        _set("nodes[0].providers[0].capacity", 0),
        "nodes[0].providers[0].capacity: must be >= 1, got 0",
        id="capacity-below-one",
    ),
    pytest.param(
        _set("nodes[0].providers[0].long_context_slots", -1),
        "nodes[0].providers[0].long_context_slots: must be >= 0, got -1",
        id="long-slots-negative",
    ),
    pytest.param(
        _set("nodes[0].providers[0].long_context_slots", 5),
        "nodes[0].providers[0].long_context_slots: must be <= capacity (4), got 5",
        id="long-slots-above-capacity",
    ),
    pytest.param(
        _set("nodes[0].providers[0].priority", -3),
        "nodes[0].providers[0].priority: must be >= 0, got -3",
        id="priority-negative",
    ),
    pytest.param(
        _set("nodes[0].providers[0].max_queue", -1),
        "nodes[0].providers[0].max_queue: must be >= 0, got -1",
        id="max-queue-negative",
    ),
    pytest.param(
        _set("nodes[0].providers[0].queue_timeout_ms", 0),
        "nodes[0].providers[0].queue_timeout_ms: must be > 0, got 0",
        id="queue-timeout-zero",
    ),
    pytest.param(
        _set("openai.long_context_threshold_tokens", 0),
        "openai.long_context_threshold_tokens: must be > 0, got 0",
        id="threshold-zero",
    ),
    pytest.param(
        _set("openai.long_context_threshold_tokens", -5),
        "openai.long_context_threshold_tokens: must be > 0, got -5",
        id="threshold-negative",
    ),
    pytest.param(
        _set("models[0].providers", {"ollama-b": "llama3"}),
        "models[0].providers: no provider of this model can take a long-context request "
        "(long_context_slots is 0 on ollama-b); give one of them long slots",
        id="long-context-budget",
    ),
    pytest.param(
        _set("openai.principal_tokens[1].token_ref", "app-1"),
        'openai.principal_tokens[1].token_ref: duplicate token_ref "app-1" '
        "(first at openai.principal_tokens[0].token_ref)",
        id="duplicate-token-ref",
    ),
    pytest.param(
        _set("openai.principal_tokens[1].token_hash_sha256", "a" * 64),
        'openai.principal_tokens[1].token_hash_sha256: duplicate token_hash_sha256 "'
        + "a" * 64
        + '" (first at openai.principal_tokens[0].token_hash_sha256)',
        id="duplicate-token-hash",
    ),
    pytest.param(
        _set("openai.principal_weights", {"team-a": 2, "tema-b": 1}),
        'openai.principal_weights.tema-b: no principal_tokens entry bills to principal "tema-b"'
        '; did you mean "team-a"?',
        id="weight-of-an-unknown-principal",
    ),
    pytest.param(
        _set("openai.principal_weights", {"team-a": 0}),
        "openai.principal_weights.team-a: must be >= 1, got 0",
        id="weight-zero",
    ),
    pytest.param(
        _set(
            "openai.priority",
            {"classes": [{"name": "chat", "priority": 5}, {"name": "chat", "priority": 1}]},
        ),
        'openai.priority.classes[1].name: duplicate priority class "chat" '
        "(first at openai.priority.classes[0].name)",
        id="priority-class-twice",
    ),
    pytest.param(
        _set(
            "openai.priority",
            {
                "classes": [{"name": "batch", "priority": -1}],
                "principals": [{"principal_ref": "team-a", "priority_class": "bulk"}],
            },
        ),
        'openai.priority.principals[0].priority_class: unknown priority class "bulk" '
        "(known: batch, default)",
        id="principal-in-an-unknown-class",
    ),
    pytest.param(
        _set("models[0].priority_class", "batc"),
        'models[0].priority_class: unknown priority class "batc" (known: default)',
        id="model-in-an-unknown-class",
    ),
    pytest.param(
        _set(
            "openai.priority",
            {"principals": [{"principal_ref": "tema-b", "priority_class": "default"}]},
        ),
        "openai.priority.principals[0].principal_ref: no principal_tokens entry bills to "
        'principal "tema-b"; did you mean "team-a"?',
        id="class-of-an-unknown-principal",
    ),
    pytest.param(
        _set("openai.priority", {"classes": [{"name": "x", "priority": 1001}]}),
        "openai.priority.classes[0].priority: must be <= 1000, got 1001",
        id="priority-class-out-of-range",
    ),
    pytest.param(
        _set("openai.principal_tokens[0].token_hash_sha256", "A" * 64),
        "openai.principal_tokens[0].token_hash_sha256: must be 64 lowercase hex characters: the "
        'SHA-256 of the token, never the token itself (printf %s "$TOKEN" | sha256sum) '
        "(got 64 characters)",
        id="hash-uppercase",
    ),
    pytest.param(
        _set("nodes[0].token_hash_sha256", "abc123"),
        "nodes[0].token_hash_sha256: must be 64 lowercase hex characters: the SHA-256 of the "
        'token, never the token itself (printf %s "$TOKEN" | sha256sum) (got 6 characters)',
        id="node-hash-short",
    ),
    pytest.param(
        _set("edge.listen", "0.0.0.0"),
        'edge.listen: must be host:port, for example 127.0.0.1:8080, got "0.0.0.0"',
        id="listener-without-port",
    ),
    pytest.param(
        _set("openai.listen", "localhost:http"),
        "openai.listen: port 'http' must be a number from 0 to 65535, got \"localhost:http\"",
        id="listener-bad-port",
    ),
    pytest.param(
        _set("a2a", {"listen": "bad host:1"}),
        "a2a.listen: 'bad host' is not a host name or IP address (IPv6 goes in brackets), "
        'got "bad host:1"',
        id="listener-bad-host",
    ),
    pytest.param(
        _set("edge.admin", {"listen": "0.0.0.0:9090"}),
        'edge.admin.listen: "0.0.0.0:9090" is off loopback, so the admin API needs auth: set '
        "edge.admin.token_hash_sha256 or edge.admin.token_file",
        id="admin-off-loopback-without-auth",
    ),
    pytest.param(
        _set("nodes[0].providers[0].capcity", 3),
        'nodes[0].providers[0].capcity: unknown key; did you mean "capacity"?',
        id="unknown-key-with-hint",
    ),
    pytest.param(
        _set("edge.zzz", 1),
        "edge.zzz: unknown key",
        id="unknown-key-without-hint",
    ),
    pytest.param(
        _set("nodes[0].providers[0].capacity", "4"),
        'nodes[0].providers[0].capacity: must be an integer, got "4"',
        id="wrong-type-string-for-int",
    ),
    pytest.param(
        _set("nodes[0].providers[0].enabled", "yes"),
        'nodes[0].providers[0].enabled: must be true or false, got "yes"',
        id="wrong-type-bool",
    ),
    pytest.param(
        _set("nodes", {"id": "node-1"}),
        'nodes: must be a list, got {"id": "node-1"}',
        id="wrong-type-list",
    ),
    pytest.param(
        _set("nodes[0].providers[0].adapter", {"type": "grpc"}),
        "nodes[0].providers[0].adapter: type must be one of 'openai', 'fake', got \"grpc\"",
        id="unknown-adapter-type",
    ),
    pytest.param(
        _set("nodes[0].providers[0].adapter", {"type": "openai"}),
        "nodes[0].providers[0].adapter.base_url: is required",
        id="missing-required-field",
    ),
    pytest.param(
        _set("nodes[0].providers[0].served_models", []),
        "nodes[0].providers[0].served_models: must have at least 1 item(s)",
        id="no-served-models",
    ),
    pytest.param(
        _set("nodes[0].providers[0].health", {"interval_ms": 50}),
        "nodes[0].providers[0].health.interval_ms: must be 0 (no probing) or at least 100, got 50",
        id="probe-interval-too-short",
    ),
    pytest.param(
        _set("nodes[0].providers[0].health", {"path": "health"}),
        "nodes[0].providers[0].health.path: must be a URL path starting with '/', without "
        'spaces, query or fragment, got "health"',
        id="probe-path-relative",
    ),
    pytest.param(
        _set("nodes[0].providers[0].health", {"failure_threshold": 0}),
        "nodes[0].providers[0].health.failure_threshold: must be >= 1, got 0",
        id="probe-threshold-zero",
    ),
    pytest.param(
        _set("models[0].generation", {"temperature": 3}),
        "models[0].generation.temperature: must be <= 2, got 3",
        id="generation-bound",
    ),
    pytest.param(
        _set("models[0].fallbacks", ["ecoh"]),
        'models[0].fallbacks[0]: unknown model "ecoh"; did you mean "echo"?',
        id="fallback-unknown",
    ),
    pytest.param(
        _set("models[0].fallbacks", ["llama"]),
        "models[0].fallbacks[0]: a model cannot fall back to itself",
        id="fallback-to-itself",
    ),
    pytest.param(
        _set("models[0].fallbacks", ["echo", "echo"]),
        'models[0].fallbacks[1]: duplicate fallback "echo" (first at models[0].fallbacks[0])',
        id="fallback-twice",
    ),
    pytest.param(
        lambda d: (
            d["models"][0].update(fallbacks=["echo"]),
            d["models"][1].update(fallbacks=["llama"]),
        ),
        "models[1].fallbacks[0]: fallbacks must not form a cycle: llama -> echo -> llama",
        id="fallback-cycle",
    ),
    pytest.param(
        lambda d: (
            d["models"][0].update(fallbacks=["echo"]),
            d["models"][1].update(fallbacks=["third"]),
            d["models"].append(
                {"id": "third", "providers": {"fake-c": "echo"}, "fallbacks": ["llama"]}
            ),
        ),
        "models[2].fallbacks[0]: fallbacks must not form a cycle: llama -> echo -> third -> llama",
        id="fallback-cycle-through-three",
    ),
    pytest.param(
        _set("models[0].fallbacks", "echo"),
        'models[0].fallbacks: must be a list, got "echo"',
        id="fallbacks-not-a-list",
    ),
    pytest.param(
        _set("openai.retries", {"budget_percent": 150}),
        "openai.retries.budget_percent: must be <= 100, got 150",
        id="retry-budget-above-100",
    ),
    pytest.param(
        _set("openai.retries", {"max_per_request": -1}),
        "openai.retries.max_per_request: must be >= 0, got -1",
        id="retries-negative",
    ),
    pytest.param(
        _set("openai.retries", {"budget_window_ms": 10}),
        "openai.retries.budget_window_ms: must be >= 1000, got 10",
        id="retry-window-too-short",
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), RULES)
def test_each_rule_is_reported_with_its_path(build: Any, mutate: Any, expected: str) -> None:
    assert expected in problems_of(build(mutate))


def test_fallbacks_may_share_a_target_and_chain_without_a_cycle(
    config_data: dict[str, Any],
) -> None:
    config_data["models"][0]["fallbacks"] = ["echo", "third"]
    config_data["models"][1]["fallbacks"] = ["third"]
    config_data["models"].append({"id": "third", "providers": {"fake-c": "echo"}})
    config = load_data(config_data)
    assert [m.fallbacks for m in config.models] == [["echo", "third"], ["third"], []]


def test_every_fallback_cycle_is_reported_once(config_data: dict[str, Any]) -> None:
    config_data["models"][0]["fallbacks"] = ["echo"]
    config_data["models"][1]["fallbacks"] = ["llama"]
    config_data["models"] += [
        {"id": "x", "providers": {"fake-c": "echo"}, "fallbacks": ["y"]},
        {"id": "y", "providers": {"fake-c": "echo"}, "fallbacks": ["x"]},
    ]
    assert [p for p in problems_of(config_data) if "cycle" in p] == [
        "models[1].fallbacks[0]: fallbacks must not form a cycle: llama -> echo -> llama",
        "models[3].fallbacks[0]: fallbacks must not form a cycle: x -> y -> x",
    ]


def test_admin_off_loopback_with_auth_is_fine(config_data: dict[str, Any]) -> None:
    config_data["edge"]["admin"] = {"listen": "0.0.0.0:9090", "token_file": "/run/admin/token"}
    assert load_data(config_data).edge.admin.token_file == "/run/admin/token"


@pytest.mark.parametrize(
    ("mutate", "path", "points_to"),
    [
        pytest.param(
            _set("openai.principal_tokens[0].token", "hunter2-raw-token"),
            "openai.principal_tokens[0].token",
            "token_hash_sha256",
            id="token-key",
        ),
        pytest.param(
            _set("nodes[0].token", "node-secret"),
            "nodes[0].token",
            "token_hash_sha256",
            id="node-token-key",
        ),
        pytest.param(
            _set("nodes[0].providers[0].adapter.api_key", "abc"),
            "nodes[0].providers[0].adapter.api_key",
            "api_key_env",
            id="api-key",
        ),
        pytest.param(
            _set("openai.principal_tokens[0].alias", "sk-proj-abcdefghijklmnop"),
            "openai.principal_tokens[0].alias",
            "token_hash_sha256",
            id="sk-value-anywhere",
        ),
        pytest.param(
            _set("openai.principal_tokens[0].token_hash_sha256", "sk-proj-abcdefghijklmnop"),
            "openai.principal_tokens[0].token_hash_sha256",
            "SHA-256",
            id="sk-value-in-hash-field",
        ),
        pytest.param(
            _set("nodes[1].token_hash_sha256", "Bearer my-node-token"),
            "nodes[1].token_hash_sha256",
            "SHA-256",
            id="bearer-in-node-hash",
        ),
    ],
)
def test_raw_secrets_are_refused_without_echoing_them(
    build: Any, mutate: Any, path: str, points_to: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_data(build(mutate))
    mine = [p for p in info.value.problems if p.path == path]
    assert len(mine) == 1, info.value.problems
    assert points_to in mine[0].message
    for secret in ("hunter2", "node-secret", "abcdefghijklmnop", "my-node-token"):
        assert secret not in str(info.value)


DOZEN_MISTAKES = Path(__file__).parent / "testdata" / "dozen-mistakes.yaml"


def test_a_dozen_mistakes_are_all_reported_in_one_run() -> None:
    with pytest.raises(ConfigError) as info:
        load_file(DOZEN_MISTAKES)
    paths = [p.path for p in info.value.problems]
    assert paths == [
        "edge.admin.listen",
        "edge.id",
        "edge.listen",
        "openai.long_context_threshold_tokens",
        "openai.principal_tokens[0].token_hash_sha256",
        "openai.principal_tokens[1].token",
        "openai.principal_tokens[1].token_ref",
        "models[0].providers.vllm-z",
        "models[1].id",
        "models[1].providers",
        "models[1].providers.ollama-b",
        "nodes[0].providers[0].capacity",
        "nodes[0].providers[0].long_context_slots",
        "nodes[0].providers[0].priorty",
        "nodes[0].providers[1].adapter",
        "nodes[0].providers[1].capacity",
        "nodes[1].id",
        "nodes[1].token_hash_sha256",
    ]
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("", ": the config is empty", id="empty"),
        pytest.param("   \n# only a comment\n", ": the config is empty", id="blank"),
        pytest.param("~\n", ": the config is empty", id="null"),
        pytest.param("- a\n- b\n", "must be a mapping of sections, got a list", id="list"),
        pytest.param("42\n", "must be a mapping of sections, got a int", id="scalar"),
        pytest.param(
            "edge:\n  id: a\n  id: b\n",
            'line 3, column 3: invalid YAML: duplicate key "id" (first on line 2)',
            id="duplicate-key",
        ),
        pytest.param("edge: [1, 2\n", "invalid YAML", id="syntax"),
        pytest.param('{"edge": {"id": "a", "id": "b"}}', 'duplicate key "id"', id="json-duplicate"),
        pytest.param("edge: {id: a}\n\tnodes: []\n", "invalid YAML", id="tab"),
        pytest.param("edge: !!python/object:os.system {}\n", "invalid YAML", id="unsafe-tag"),
        pytest.param("? [a, b]\n: 1\n", "a mapping key must be a plain value", id="list-key"),
    ],
)
def test_bad_yaml_gets_a_clear_error(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_text(text)
    assert any(expected in f": {p}" or expected in str(p) for p in info.value.problems), (
        info.value.problems
    )


def test_json_text_is_the_same_config(config_data: dict[str, Any]) -> None:
    import json

    assert load_text(json.dumps(config_data)) == load_data(config_data)
    assert load_text("{edge: {id: a}}").edge.id == "a"  # a YAML flow mapping, not JSON


@pytest.mark.parametrize(
    "document",
    [
        pytest.param({"²": 1}, id="superscript-digit-key"),
        pytest.param({"edge": {"id": "a", "listen": "h:²"}}, id="superscript-digit-port"),
        pytest.param({"edge": {"id": "a", "listen": "h:١٢"}}, id="arabic-indic-port"),
    ],
)
def test_non_ascii_digits_are_plain_errors(document: dict[str, Any]) -> None:
    # Found by hypothesis: str.isdigit() accepts "²", which int() refuses.
    assert problems_of(document)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_file(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_file(binary)


def test_config_is_immutable(config_data: dict[str, Any]) -> None:
    config = load_data(config_data)
    with pytest.raises(ValueError, match="frozen"):
        config.nodes[0].providers[0].capacity = 99  # type: ignore[misc]


def test_yaml_round_trip_of_the_sample(tmp_path: Path) -> None:
    config = load_file(REPO / "configs" / "edge.yaml")
    dumped = yaml.safe_dump(config.model_dump(mode="json"))
    assert load_text(dumped) == config


def _nodes(data: dict[str, Any], count: int, *, max_connections: int | None = None) -> None:
    """`count` nodes that dial in (beside those of `data`, providers of their own), and the
    hub's cap when given."""
    data["nodes"] += [
        {
            "id": f"extra-{i}",
            "token_hash_sha256": f"{i:064x}",
            "providers": [
                {"id": f"extra-p{i}", "adapter": {"type": "fake"}, "served_models": ["echo"]}
            ],
        }
        for i in range(count)
    ]
    if max_connections is not None:
        data["edge"]["node_link"] = {"max_connections": max_connections}


def test_more_nodes_than_the_hub_admits_are_refused_naming_both_numbers(build: Any) -> None:
    # The measured case: 2,000 nodes against the default cap of 1,024.
    assert problems_of(build(lambda d: _nodes(d, 1998))) == [
        "edge.node_link.max_connections: must be >= the 2000 nodes that dial in (each keeps "
        "one connection per Edge replica; nodes with placement edge do not count), got 1024"
    ]
    (problem,) = problems_of(build(lambda d: _nodes(d, 2, max_connections=3)))
    assert problem.startswith("edge.node_link.max_connections: must be >= the 4 nodes")
    assert problem.endswith("got 3")


def test_a_cap_that_admits_every_dialing_node_loads(build: Any) -> None:
    config = load_data(build(lambda d: _nodes(d, 2, max_connections=4)))
    assert len(config.nodes) == 4 and config.edge.node_link.max_connections == 4


def test_nodes_placed_on_the_edge_dial_nothing_and_take_no_connection(build: Any) -> None:
    def one_on_edge(data: dict[str, Any]) -> None:
        _nodes(data, 1, max_connections=2)
        node = data["nodes"][0]
        del node["token_hash_sha256"]
        node["placement"] = "edge"

    config = load_data(build(one_on_edge))
    assert sum(not node.on_edge for node in config.nodes) == 2


def test_the_hello_caps_are_not_held_against_the_nodes(build: Any) -> None:
    # A reconnect storm past them is admitted in turns (each Node retries), not turned away.
    def storm(data: dict[str, Any]) -> None:
        _nodes(data, 8, max_connections=10)
        link = data["edge"]["node_link"]
        link.update(max_unauthenticated_connections=1, max_unauthenticated_per_client=1)

    assert len(load_data(build(storm)).nodes) == 10


def test_the_cap_is_named_in_camel_case_when_the_document_is(build: Any) -> None:
    def camel(data: dict[str, Any]) -> None:
        _nodes(data, 1)
        data["edge"]["nodeLink"] = {"maxConnections": 2}

    (problem,) = problems_of(build(camel))
    assert problem.startswith("edge.nodeLink.maxConnections: must be >= the 3 nodes")


def _link(data: dict[str, Any], **link: int) -> None:
    data["edge"]["node_link"] = link


@pytest.mark.parametrize(
    ("link", "quiet"),
    [
        pytest.param({}, (10_000, 40_000), id="defaults"),
        pytest.param({"idle_heartbeat_interval_ms": 0}, (0, 0), id="off"),
        pytest.param(  # an idle interval not above the heartbeat's: nothing to save
            {"heartbeat_interval_ms": 20_000, "heartbeat_timeout_ms": 60_000},
            (0, 0),
            id="not-above-the-heartbeat",
        ),
        pytest.param(  # the idle deadline never shorter than the busy one
            {"heartbeat_timeout_ms": 60_000, "idle_heartbeat_interval_ms": 8000},
            (8000, 60_000),
            id="deadline-raised",
        ),
    ],
)
def test_a_quiet_links_interval_and_deadline_in_effect(
    build: Any, link: dict[str, int], quiet: tuple[int, int]
) -> None:
    config = load_data(build(lambda d: _link(d, **link)))
    assert config.edge.node_link.quiet_link_ms() == quiet


def test_a_quiet_links_deadline_at_or_below_its_interval_is_refused_naming_both(
    build: Any,
) -> None:
    link = {"idle_heartbeat_interval_ms": 30_000, "idle_heartbeat_timeout_ms": 30_000}
    (problem,) = problems_of(build(lambda d: _link(d, **link)))
    assert problem.startswith("edge.node_link: idle_heartbeat_timeout_ms (30000) must be above ")
    assert "idle_heartbeat_interval_ms (30000)" in problem
