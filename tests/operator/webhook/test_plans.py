"""The webhook's plan: short warning lines, restarts first, bounded."""

from __future__ import annotations

from typing import Any

import pytest

from iop.edgeconfig import ConfigError, classify, config_hash, load_data
from iop.operator.webhook.plans import MAX_LINE, MAX_TOTAL, admission_message, plan_warnings


def plan(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    before, after = load_data(old), load_data(new)
    return plan_warnings(classify(before, after), after, config_hash(after))


def test_restarts_come_first_then_the_live_paths(document) -> None:
    new = load_data(document).model_dump(mode="json")
    new["openai"]["listen"] = "0.0.0.0:8081"
    new["nodes"][1]["providers"][0]["adapter"] = {"type": "fake", "latency_ms": 5}
    new["nodes"][0]["providers"][0]["capacity"] = 9

    assert plan(document, new) == [
        "restart edge: openai.listen",
        "restart node node-2: nodes[node-2].providers[pc].adapter.latencyMs",
        "live: nodes[node-1].providers[pa].capacity",
    ]


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        pytest.param(lambda d: d, ["plan: nothing in effect changes"], id="no-change"),
        pytest.param(lambda d: {**d, "models": []}, ["live: models[m]"], id="model-removed"),
    ],
)
def test_small_plans(document, edit, says) -> None:
    assert plan(document, edit(load_data(document).model_dump(mode="json"))) == says


def trial_lines(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    before, after = load_data(old), load_data(new)
    warnings = plan_warnings(classify(before, after), after, config_hash(after), base=before)
    return [line for line in warnings if line.startswith("rollout: ")]


def test_the_plan_says_how_the_edges_put_a_change_on_trial_and_how_long_it_takes(
    document,
) -> None:
    served = load_data(document).model_dump(mode="json")
    served["models"][0]["providers"] = {"pa": "served-1", "pc": "served-2", "pb": "served-1"}
    assert trial_lines(document, served) == [
        "rollout: canary 5% -> 25% -> 100% for m",
        "rollout: about 30s with 20 requests judged (at most 60s); the Edges roll it back if it "
        "fails a check",
    ]
    capacity = load_data(document).model_dump(mode="json")
    capacity["nodes"][0]["providers"][0]["capacity"] = 9
    assert trial_lines(document, capacity)[0] == "rollout: all at once, watched, for m"
    assert trial_lines(document, capacity)[1].startswith("rollout: about 15s with 20 requests")
    restart = load_data(document).model_dump(mode="json")
    restart["nodes"][0]["providers"][0]["adapter"] = {"type": "fake", "latency_ms": 5}
    assert trial_lines(document, restart) == [
        "rollout: restart-required: the restart rolls it out, not judged by the Edges"
    ]
    off = {**capacity, "rollout": {"mode": "off"}}
    assert trial_lines(document, off) == ["rollout: off: applied and kept, not judged"]
    untouched = load_data(document).model_dump(mode="json")
    untouched["openai"]["retries"] = {"max_per_request": 1}
    assert trial_lines(document, untouched) == []


def test_a_first_apply_has_no_base(document) -> None:
    config = load_data(document)
    assert plan_warnings(None, config, "ab" * 32) == ["plan: first apply of config abababababab"]


def test_an_admin_api_on_loopback_is_warned_about(document) -> None:
    document["edge"]["admin"] = {"listen": "127.0.0.1:9090"}
    config = load_data(document)
    (warning, _) = plan_warnings(None, config, config_hash(config))
    assert "127.0.0.1:9090 is loopback: the operator cannot reach" in warning


def test_many_changes_stay_within_the_api_limits(document) -> None:
    config = load_data(document).model_dump(mode="json")
    many = {
        **config,
        "models": [
            {"id": f"model-{i:04d}-{'x' * 80}", "providers": {"pa": "served-1"}} for i in range(400)
        ],
    }
    warnings = plan(document, many)
    assert all(len(line) <= MAX_LINE for line in warnings)
    assert sum(map(len, warnings)) <= MAX_TOTAL
    assert warnings[-1].startswith("... and ")
    assert "more" in warnings[-1]


def test_a_refusal_lists_every_problem_with_its_path(document) -> None:
    document["nodes"][0]["providers"][0]["capacity"] = 0
    document["models"][0]["providers"]["zz"] = "x"
    with pytest.raises(ConfigError) as caught:
        load_data(document)
    message = admission_message(caught.value)
    assert message.splitlines()[0] == "2 problems in the EdgeConfig spec:"
    assert "nodes[0].providers[0].capacity: must be >= 1, got 0" in message
    assert 'models[0].providers.zz: unknown provider "zz"' in message
