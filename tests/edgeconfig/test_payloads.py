"""The node payload: a provider's health policy travels only when it is not the defaults, and a
payload that uses the defaults keeps the digest it had before health policies existed (so a Node
and an Edge of different releases agree on it mid-rollout)."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from iop.edgeconfig import HealthPolicy, load_data, node_payloads
from iop.edgeconfig.trees import to_tree


def payload_of(build: Any, **health: Any) -> Any:
    def mutate(document: dict[str, Any]) -> None:
        if health:
            document["nodes"][0]["providers"][0]["health"] = health

    return node_payloads(load_data(build(mutate)))["node-1"]


def digest_without_health(payload: Any) -> str:
    """The digest as a release that predates health policies computes it."""
    tree = to_tree(payload)
    for provider in tree["providers"].values():
        del provider["health"]
    return hashlib.sha256(orjson.dumps(tree, option=orjson.OPT_SORT_KEYS)).hexdigest()


def test_default_health_travels_as_nothing_and_keeps_the_older_digest(build: Any) -> None:
    payload = payload_of(build)
    assert all(p.health is None for p in payload.providers)
    assert all(p.health_policy == HealthPolicy() for p in payload.providers)
    assert payload.digest == digest_without_health(payload)


def test_a_health_policy_of_its_own_travels_and_changes_the_digest(build: Any) -> None:
    default = payload_of(build)
    tuned = payload_of(build, interval_ms=1000, path="/health")
    (changed,) = [p for p in tuned.providers if p.health is not None]
    assert changed.health == HealthPolicy(interval_ms=1000, path="/health")
    assert tuned.digest != default.digest
    # Spelling the defaults out is the same payload as leaving them out.
    assert payload_of(build, interval_ms=5000) == default
