"""How a change goes on trial (`trials.plan_trial`): which models it touches, which of them take
a canary, and why the others apply to all at once."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from iop.edgeconfig import load_data, plan_trial
from testkit import find_provider, provider

Change = Callable[[dict[str, Any]], None]


def fake(pid: str, **settings: Any) -> dict[str, Any]:
    settings = {"priority": 10, **settings}
    return provider(pid, {"type": "fake"}, served=f"{pid}-served", capacity=4, **settings)


@pytest.fixture
def base(document_of) -> dict[str, Any]:
    document: dict[str, Any] = document_of(
        [fake("pa"), fake("pb"), fake("pc", served_models=["pc-served", "alias"])],
        {"m": ["pa", "pb"], "other": ["pc"]},
    )
    return document


def trial(base: dict[str, Any], change: Change, mode: str = "canary") -> Any:
    after = copy.deepcopy(base)
    change(after)
    after["rollout"] = {"mode": mode}
    return plan_trial(load_data(base), load_data(after))


def capacity(config: dict[str, Any]) -> None:
    find_provider(config, "pa")["capacity"] = 1


def priority(config: dict[str, Any]) -> None:
    find_provider(config, "pb")["priority"] = 0


def served_name(config: dict[str, Any]) -> None:
    config["models"][1]["providers"] = {"pc": "alias"}


def provider_added(config: dict[str, Any]) -> None:
    node = config["nodes"][0]
    node["providers"].append({**copy.deepcopy(node["providers"][0]), "id": "pnew"})
    config["models"][0]["providers"]["pnew"] = "pa-served"


def policy(config: dict[str, Any]) -> None:
    config["models"][0]["dispatch"] = {"policy": "least_load"}


def engine_priority(config: dict[str, Any]) -> None:
    find_provider(config, "pc")["engine_priority"] = True


def url_moved(config: dict[str, Any]) -> None:
    find_provider(config, "pa")["adapter"] = {"type": "openai", "base_url": "http://127.0.0.1:9/v1"}
    config["models"][0]["providers"] = {"pa": "pa-served"}


@pytest.mark.parametrize(
    ("change", "touched", "shared"),
    [
        pytest.param(capacity, ("m",), (), id="capacity-all-at-once"),
        pytest.param(priority, ("m",), (), id="priority-all-at-once"),
        pytest.param(served_name, ("other",), ("other",), id="served-name-canary"),
        pytest.param(provider_added, ("m",), ("m",), id="new-provider-canary"),
        pytest.param(policy, ("m",), ("m",), id="policy-canary"),
        # A server that schedules first come first served refuses a class sent as `priority`.
        pytest.param(engine_priority, ("other",), ("other",), id="engine-priority-canary"),
    ],
)
def test_what_serves_a_model_takes_a_canary_how_much_does_not(
    base, change: Change, touched: tuple[str, ...], shared: tuple[str, ...]
) -> None:
    planned = trial(base, change)
    assert (planned.touched, planned.shared, planned.all_at_once) == (touched, shared, ())


def test_a_provider_whose_settings_changed_applies_to_all_at_once_and_says_why(base) -> None:
    planned = trial(base, url_moved)
    assert (planned.touched, planned.shared) == (("m",), ())
    assert planned.all_at_once == (
        "m all at once: provider pa's adapter settings on node node-1 changed (its node "
        "restarts with them: one adapter per provider)",
    )
    assert "all at once, watched, for m" in planned.describe([5, 25, 100])


def test_an_adapter_change_alone_touches_the_models_of_its_provider(base) -> None:
    """A provider's URL moved (the caller restarts its node): nothing of the dispatch view
    changed, yet every model it serves is watched."""

    def only_url(config: dict[str, Any]) -> None:
        find_provider(config, "pc")["adapter"] = {"type": "openai", "base_url": "http://h:1/v1"}

    planned = trial(base, only_url)
    assert (planned.touched, planned.shared) == (("other",), ())
    assert planned.all_at_once[0].startswith("other all at once: provider pc's adapter settings")


def test_watch_mode_takes_no_canary(base) -> None:
    planned = trial(base, served_name, mode="watch")
    assert (planned.touched, planned.shared) == (("other",), ())


def test_the_plan_in_one_line(base) -> None:
    def both_changes(config: dict[str, Any]) -> None:
        served_name(config)
        capacity(config)

    both = trial(base, both_changes)
    assert both.describe([5, 25, 100]) == (
        "canary 5% -> 25% -> 100% for other; all at once, watched, for m"
    )


def test_a_lora_adapter_is_touched_and_shared_with_its_model(base) -> None:
    base["models"][0]["adapters"] = ["sql"]
    planned = trial(base, provider_added)
    assert (planned.touched, planned.shared) == (("m", "sql"), ("m", "sql"))
    added = trial(base, lambda config: config["models"][0]["adapters"].append("chat"))
    assert (added.touched, added.shared) == (("chat",), ())  # new: served at once, watched
