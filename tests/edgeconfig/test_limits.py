"""`openai.limits[]` and `openai.limit_store`: validated with paths, live, keyed by selector."""

from __future__ import annotations

from typing import Any

import pytest

from iop.edgeconfig import ConfigError, classify, config_hash, load_data


def limits(*entries: dict[str, Any]) -> Any:
    def mutate(d: dict[str, Any]) -> None:
        d["openai"]["limits"] = list(entries)

    return mutate


def problems(build: Any, mutate: Any) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_data(build(mutate))
    return [str(problem) for problem in caught.value.problems]


def test_a_valid_set_of_limits_loads(build: Any) -> None:
    config = load_data(
        build(
            limits(
                {"principal_ref": "team-a", "requests_per_minute": 60, "max_concurrent": 4},
                {"principal_ref": "team-a", "token_ref": "app-1", "tokens_per_minute": 1000},
                {
                    "principal_ref": "team-a",
                    "model": "llama",
                    "budget": {"tokens": 10, "period": "day"},
                },
                {"principal_ref": "*", "requestsPerMinute": 600},
                {"principal_ref": "anonymous", "max_concurrent": 1},
            )
        )
    )
    entries = config.openai.limits
    assert [entry.list_key for entry in entries] == [
        "team-a|*|*",
        "team-a|app-1|*",
        "team-a|*|llama",
        "*|*|*",
        "anonymous|*|*",
    ]
    budget = entries[2].budget
    assert budget is not None and (budget.period, budget.reset_at) == ("day", "00:00")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        pytest.param(
            {"principal_ref": "team-b", "max_concurrent": 1},
            'openai.limits[0].principal_ref: no principal_tokens entry bills to principal "team-b"',
            id="unknown-principal",
        ),
        pytest.param(
            {"principal_ref": "team-a", "token_ref": "app-9", "max_concurrent": 1},
            'openai.limits[0].token_ref: unknown token_ref "app-9"',
            id="unknown-token",
        ),
        pytest.param(
            {"principal_ref": "*", "token_ref": "app-1", "max_concurrent": 1},
            'openai.limits[0].principal_ref: a token belongs to one principal: name "team-a"',
            id="token-of-every-principal",
        ),
        pytest.param(
            {"principal_ref": "team-a", "model": "lama", "max_concurrent": 1},
            'openai.limits[0].model: unknown model "lama"; did you mean "llama"?',
            id="unknown-model",
        ),
        pytest.param(
            {"principal_ref": "team-a"},
            "openai.limits[0]: sets no limit",
            id="no-limit",
        ),
        pytest.param(
            {"principal_ref": "team-a", "requests_per_minute": 0},
            "openai.limits[0].requests_per_minute: must be >= 1, got 0",
            id="zero-rpm",
        ),
        pytest.param(
            {"principal_ref": "team-a", "budget": {"tokens": 5, "period": "week"}},
            "openai.limits[0].budget.period:",
            id="bad-period",
        ),
        pytest.param(
            {"principal_ref": "team-a", "budget": {"tokens": 5, "period": "day", "reset_at": "7"}},
            "openai.limits[0].budget.reset_at: must be a time of day as HH:MM",
            id="bad-reset",
        ),
    ],
)
def test_a_wrong_entry_is_named_by_its_path(build: Any, entry: Any, expected: str) -> None:
    found = problems(build, limits(entry))
    assert any(problem.startswith(expected) for problem in found), found


def test_two_entries_selecting_the_same_requests_are_refused(build: Any) -> None:
    found = problems(
        build,
        limits(
            {"principal_ref": "team-a", "token_ref": "app-2", "max_concurrent": 1},
            {"principal_ref": "team-a", "tokenRef": "app-2", "requests_per_minute": 1},
        ),
    )
    assert found == [
        "openai.limits[1]: selects the same requests as openai.limits[0] (principal_ref=team-a, "
        "token_ref=app-2, model=*): put every limit of one selection in one entry"
    ]


def test_a_token_of_another_principal_is_refused(build: Any) -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["openai"]["principal_tokens"][1]["principal_ref"] = "team-b"
        d["openai"]["limits"] = [
            {"principal_ref": "team-a", "token_ref": "app-2", "max_concurrent": 1}
        ]

    assert problems(build, mutate) == [
        'openai.limits[0].token_ref: token_ref "app-2" bills to principal "team-b", not "team-a"'
    ]


def test_a_store_url_with_credentials_is_refused(build: Any) -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["openai"]["limit_store"] = {"url": "redis://:hunter2@redis:6379/0"}

    (problem,) = problems(build, mutate)
    assert problem.startswith("openai.limit_store.url: must be redis://host:port")
    assert "hunter2" not in problem


def test_limits_are_live_and_keyed_by_their_selector(build: Any) -> None:
    before = limits(
        {"principal_ref": "team-a", "requests_per_minute": 60},
        {"principal_ref": "team-a", "model": "llama", "max_concurrent": 2},
    )
    after = limits(
        {"principal_ref": "team-a", "model": "llama", "max_concurrent": 3},
        {"principal_ref": "team-a", "requests_per_minute": 60},
        {"principal_ref": "team-a", "token_ref": "app-1", "tokens_per_minute": 100},
    )
    report = classify(load_data(build(before)), load_data(build(after)))
    assert report.live_paths == (
        "openai.limits[team-a|*|llama].max_concurrent",
        "openai.limits[team-a|app-1|*]",
    )
    assert report.restart_required_paths == ()
    reordered = limits(
        {"principal_ref": "team-a", "model": "llama", "max_concurrent": 2},
        {"principal_ref": "team-a", "requests_per_minute": 60},
    )
    assert config_hash(load_data(build(before))) == config_hash(load_data(build(reordered)))


def test_the_store_is_restart_required(build: Any) -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["openai"]["limit_store"] = {"url": "redis://redis:6379"}

    report = classify(load_data(build()), load_data(build(mutate)))
    assert [path.path for path in report.restart_required_paths] == ["openai.limit_store.url"]


def test_a_config_without_limits_keeps_its_hash(build: Any) -> None:
    """The fields are defaulted: configs that do not use them hash as before this release."""
    config = load_data(build())
    assert config.openai.limits == []
    assert config_hash(config) == config_hash(load_data(build(limits())))
