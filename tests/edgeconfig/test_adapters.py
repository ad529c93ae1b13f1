"""`models[].adapters`: LoRA adapters named in the catalog, each problem with its path, and a
change of them live."""

from __future__ import annotations

from typing import Any

import pytest

from iop.edgeconfig import ConfigError, classify, load_data


def problems_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_data(data)
    return [str(p) for p in info.value.problems]


def test_a_model_names_its_adapters(config_data: dict[str, Any]) -> None:
    config_data["models"][0]["adapters"] = ["sql-lora", "chat-lora"]
    config = load_data(config_data)
    assert config.models[0].adapters == ["sql-lora", "chat-lora"]
    assert config.models[1].adapters == []


def test_an_adapter_named_like_a_model_is_refused(config_data: dict[str, Any]) -> None:
    config_data["models"][0]["adapters"] = ["echo"]
    assert problems_of(config_data) == [
        'models[0].adapters[0]: adapter "echo" has the name of a model (models[1].id): a '
        "request's model must name one or the other"
    ]


def test_an_adapter_named_twice_is_refused_wherever_it_is(config_data: dict[str, Any]) -> None:
    config_data["models"][0]["adapters"] = ["sql-lora", "sql-lora"]
    config_data["models"][1]["adapters"] = ["sql-lora"]
    assert problems_of(config_data) == [
        'models[0].adapters[1]: duplicate adapter "sql-lora" (first at models[0].adapters[0])',
        'models[1].adapters[0]: duplicate adapter "sql-lora" (first at models[0].adapters[0])',
    ]


def test_an_adapter_on_a_model_with_no_providers_is_refused(config_data: dict[str, Any]) -> None:
    config_data["models"].append({"id": "bare", "providers": {}, "adapters": ["sql-lora"]})
    problems = problems_of(config_data)
    assert (
        "models[2].adapters: a LoRA adapter runs on its model's providers, and this model has "
        "none: map the providers that serve its base model"
    ) in problems
    assert any(p.startswith("models[2].providers:") for p in problems)  # the schema's too


def test_an_adapter_is_no_fallback_but_a_limit_may_name_it(config_data: dict[str, Any]) -> None:
    config_data["models"][0]["adapters"] = ["sql-lora"]
    config_data["models"][1]["fallbacks"] = ["sql-lora"]
    assert problems_of(config_data) == [
        'models[1].fallbacks[0]: "sql-lora" is a LoRA adapter: a fallback is a model'
    ]
    del config_data["models"][1]["fallbacks"]
    config_data["openai"]["limits"] = [
        {"principal_ref": "team-a", "model": "sql-lora", "requests_per_minute": 10}
    ]
    assert load_data(config_data).openai.limits[0].model == "sql-lora"


def test_an_adapter_name_is_a_model_id(config_data: dict[str, Any]) -> None:
    config_data["models"][0]["adapters"] = ["no spaces"]
    assert [p for p in problems_of(config_data) if p.startswith("models[0].adapters[0]")]


def test_adding_an_adapter_is_live(config_data: dict[str, Any]) -> None:
    before = load_data(config_data)
    config_data["models"][0]["adapters"] = ["sql-lora"]
    report = classify(before, load_data(config_data))
    assert report.live_paths == ("models[llama].adapters",)
    assert report.restart_required_paths == ()
    assert report.changed_models == ("llama",)
    assert not any(report.node_payload_changed.values())  # the Nodes need no push
