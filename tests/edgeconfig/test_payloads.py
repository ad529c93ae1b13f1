"""The node payload: defaults do not travel. A provider's health policy goes only when it is not
the defaults (a payload that uses them keeps the digest it had before health policies existed),
and an adapter's settings go as its type and what differs from their defaults (an older Node
takes a newer Edge's payload whose added settings are unused). So a Node and an Edge of different
releases agree mid-rollout."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
import pytest

from iop.edgeconfig import HealthPolicy, OpenAIAdapterSettings, load_data, node_payloads
from iop.edgeconfig.payloads import (
    NodePayload,
    ProviderPayload,
    _generic_digest,
    _provider_tree,
)
from iop.edgeconfig.trees import to_tree
from iop.providers import AdapterError, OpenAIAdapter, build_adapter


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


def test_an_adapter_travels_as_its_type_and_what_differs_from_the_defaults(build: Any) -> None:
    tuned_id = ""

    def tuned(document: dict[str, Any]) -> None:
        nonlocal tuned_id
        tuned_id = document["nodes"][0]["providers"][0]["id"]
        document["nodes"][0]["providers"][0]["adapter"] = {
            "type": "openai",
            "base_url": "http://10.0.0.1:8000/v1",
            "request_timeout_s": 30,
            "max_connections": 256,  # the default, spelled out
        }

    payload = node_payloads(load_data(build(tuned)))["node-1"]
    (provider,) = [p for p in payload.providers if p.id == tuned_id]
    assert provider.adapter == {
        "type": "openai",
        "base_url": "http://10.0.0.1:8000/v1",
        "request_timeout_s": 30.0,
    }
    assert all(p.adapter["type"] for p in payload.providers)  # the type always travels


class _NewerOpenAIAdapterSettings(OpenAIAdapterSettings):
    """The adapter's settings as a later release might have them: one more, with a default."""

    added_later: int = 7


@pytest.mark.parametrize(("added", "accepted"), [(7, True), (8, False)], ids=["default", "used"])
def test_an_older_node_takes_a_newer_edges_adapter_while_its_new_setting_is_unused(
    added: int, accepted: bool
) -> None:
    newer = _NewerOpenAIAdapterSettings(base_url="http://10.0.0.1:8000/v1", added_later=added)
    provider = ProviderPayload(
        id="p1",
        adapter=ProviderPayload.adapter_document(newer),
        served_models=("m",),
        enabled=True,
        capacity=1,
        long_context_slots=None,
    )
    if accepted:
        assert isinstance(build_adapter(provider), OpenAIAdapter)
    else:
        with pytest.raises(AdapterError, match="added_later"):
            build_adapter(provider)


def _provider(provider_id: str, **fields: Any) -> ProviderPayload:
    values: dict[str, Any] = {
        "adapter": {"type": "fake"},
        "served_models": ("m",),
        "enabled": True,
        "capacity": 1,
        "long_context_slots": None,
    }
    return ProviderPayload(id=provider_id, **(values | fields))


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(NodePayload(node_id="n", alias=None, providers=(_provider("p"),)), id="plain"),
        pytest.param(
            NodePayload(
                node_id="n",
                alias="gpu-a",
                providers=(
                    _provider(
                        "b",
                        adapter={"type": "openai", "base_url": "http://h/v1", "x": [3, 1, "a"]},
                        served_models=("z", "a", "it's"),
                        enabled=False,
                        capacity=8,
                        long_context_slots=2,
                        health=HealthPolicy(interval_ms=1000, path="/health"),
                    ),
                    _provider("a", served_models=()),
                ),
            ),
            id="every-field-set",
        ),
        pytest.param(NodePayload(node_id="n", alias=None, providers=()), id="no-providers"),
    ],
)
def test_the_digest_is_the_generic_trees(payload: NodePayload) -> None:
    """The digest writes its tree out field by field; it must stay the generic tree's (a Node
    and an Edge of two releases compare digests)."""
    assert payload.digest == _generic_digest(payload)


def test_the_digests_tree_names_every_field_of_a_provider() -> None:
    """A field added to `ProviderPayload` must be added to the digest's tree too."""
    provider = _provider("p", health=HealthPolicy(interval_ms=1000))
    assert set(_provider_tree(provider)) == set(ProviderPayload.model_fields)
