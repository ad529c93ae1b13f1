"""testkit's builder writes documents the config model takes, with each option where it says."""

from __future__ import annotations

from typing import Any

import pytest

from iop.edgeconfig import load_data, token_sha256
from testkit import CLIENT_TOKEN, Client, edge_document, find_provider, node_token_of, provider


def nodes() -> dict[str, list[dict[str, Any]]]:
    openai = {"type": "openai", "base_url": "http://h:1/v1"}
    return {
        "node-1": [provider("pa"), provider("pb", openai)],
        "node-2": [provider("pc", served="other")],
    }


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"placement": "edge"}, id="placed-on-the-edge"),
        pytest.param({"listeners": False, "clients": ()}, id="no-listeners-no-clients"),
        pytest.param({"admin": True, "metrics": True}, id="admin-and-metrics"),
        pytest.param(
            {"limits": [{"principal_ref": "team-search", "requests_per_minute": 5}]}, id="limits"
        ),
        pytest.param(
            {
                "models": {"m": ["pa", "pb"], "o": ["pc"]},
                "model_settings": {"m": {"fallbacks": ["o"], "dispatch": {"policy": "least_load"}}},
            },
            id="models",
        ),
    ],
)
def test_each_option_makes_a_valid_document(options: dict[str, Any]) -> None:
    load_data(edge_document(nodes(), **options))


def test_the_defaults_know_one_client_token_and_each_nodes_token() -> None:
    document = edge_document(nodes(), node_tokens={"node-2": "another"})
    hashes = [t["token_hash_sha256"] for t in document["openai"]["principal_tokens"]]
    assert token_sha256(CLIENT_TOKEN) in hashes
    assert [n["token_hash_sha256"] for n in document["nodes"]] == [
        token_sha256(node_token_of("node-1")),
        token_sha256("another"),
    ]
    assert document["models"] == [
        {"id": "m", "providers": {"pa": "served", "pb": "served", "pc": "other"}}
    ]


def test_sections_land_where_they_say() -> None:
    document = edge_document(
        nodes(),
        listeners=False,
        admin=True,
        clients=[Client("app", "sk-app", "team-app")],
        edge={"node_link": {"heartbeat_interval_ms": 1000}},
        openai={"max_request_bytes": 1024},
    )
    assert "listen" not in document["edge"] and "listen" not in document["openai"]
    assert document["edge"]["admin"] == {"listen": "127.0.0.1:0"}
    assert document["edge"]["node_link"] == {"heartbeat_interval_ms": 1000}
    assert document["openai"]["max_request_bytes"] == 1024
    assert [t["principal_ref"] for t in document["openai"]["principal_tokens"]] == ["team-app"]


def test_find_provider_returns_the_entry_itself() -> None:
    document = edge_document(nodes())
    find_provider(document, "pc")["capacity"] = 3
    assert document["nodes"][1]["providers"][0]["capacity"] == 3
    with pytest.raises(KeyError):
        find_provider(document, "nowhere")
