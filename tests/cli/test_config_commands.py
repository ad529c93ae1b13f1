"""`iop config check | diff | schema`, run as a real process, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "configs" / "edge.yaml"
DOZEN = REPO / "tests" / "edgeconfig" / "testdata" / "dozen-mistakes.yaml"


def iop(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "iop.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def edited(tmp_path: Path, name: str, edit: object) -> Path:
    """A copy of the sample config changed by `edit(document)`."""
    document = yaml.safe_load(SAMPLE.read_text())
    edit(document)  # type: ignore[operator]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document))
    return path


def test_check_accepts_and_explains_the_sample() -> None:
    result = iop("config", "check", SAMPLE)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout
    assert "llama-3.1-8b" in result.stdout and "node-1" in result.stdout
    assert "(prio 30, cap 4, long 1); then llama-3.1-8b" in result.stdout  # mistral's fallback


def test_check_reports_every_mistake_on_stderr() -> None:
    result = iop("config", "check", DOZEN)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = [line.strip() for line in result.stderr.splitlines()[1:]]
    assert len(lines) == 18
    assert "nodes[0].providers[0].capacity: must be >= 1, got 0" in lines
    assert 'models[0].providers.vllm-z: unknown provider "vllm-z"; did you mean "vllm-a"?' in lines
    assert "hunter2" not in result.stderr


def test_check_json_for_machines() -> None:
    good = json.loads(iop("config", "check", SAMPLE, "--format", "json").stdout)
    assert good["valid"] is True and good["problems"] == [] and len(good["hash"]) == 64
    bad = iop("config", "check", DOZEN, "--format", "json")
    document = json.loads(bad.stdout)
    assert bad.returncode == 1 and document["valid"] is False
    assert {"path": "edge.id", "message": document["problems"][1]["message"]} in document[
        "problems"
    ]


def test_check_against_an_upstream_policy(tmp_path: Path) -> None:
    """What a Node or the operator given the policy would refuse, said before anything runs."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "allow: [127.0.0.1/32]\n"
        "keys: [{env: VLLM_A_KEY, hosts: ['127.0.0.1:8001'], providers: [vllm-b]}]\n"
    )
    result = iop("config", "check", SAMPLE, "--upstream-policy", policy)
    assert result.returncode == 1
    assert "nodes[0].providers[0].adapter.api_key_env: the key in VLLM_A_KEY may go only to " in (
        result.stderr
    )
    policy.write_text("allow: [127.0.0.1/32]\nkeys: [{env: VLLM_A_KEY, hosts: ['127.0.0.1:8000']}]")
    assert iop("config", "check", SAMPLE, "--upstream-policy", policy).returncode == 0
    policy.write_text("allow: [not a host]")
    broken = iop("config", "check", SAMPLE, "--upstream-policy", policy)
    assert broken.returncode == 1 and f"{policy}: allow[0]: 'not a host' is not" in broken.stderr


def test_check_refuses_more_dialing_nodes_than_the_hub_admits(tmp_path: Path) -> None:
    """The measured case in small: three nodes dial in, the hub admits two."""
    path = edited(
        tmp_path, "capped.yaml", lambda d: d["edge"]["node_link"].update(max_connections=2)
    )
    result = iop("config", "check", path)
    assert result.returncode == 1 and result.stdout == ""
    assert (
        "edge.node_link.max_connections: must be >= the 3 nodes that dial in (each keeps one "
        "connection per Edge replica; nodes with placement edge do not count), got 2"
    ) in result.stderr
    document = json.loads(iop("config", "check", path, "--format", "json").stdout)
    assert [p["path"] for p in document["problems"]] == ["edge.node_link.max_connections"]
    enough = edited(
        tmp_path, "enough.yaml", lambda d: d["edge"]["node_link"].update(max_connections=3)
    )
    assert iop("config", "check", enough).returncode == 0


def test_check_of_a_missing_file() -> None:
    result = iop("config", "check", "/nonexistent/edge.yaml")
    assert result.returncode == 1
    assert "cannot read /nonexistent/edge.yaml" in result.stderr
    assert "Traceback" not in result.stderr


def test_diff_of_identical_files_is_no_change() -> None:
    result = iop("config", "diff", SAMPLE, SAMPLE)
    assert result.returncode == 0
    assert result.stdout.strip() == "No changes."


def test_diff_live_change_exits_zero(tmp_path: Path) -> None:
    def raise_capacity(d: dict) -> None:  # type: ignore[type-arg]
        d["nodes"][0]["providers"][0]["capacity"] = 12

    new = edited(tmp_path, "new.yaml", raise_capacity)
    result = iop("config", "diff", SAMPLE, new)
    assert result.returncode == 0, result.stderr
    assert "nodes[node-1].providers[vllm-a].capacity" in result.stdout
    assert "Verdict: applies live" in result.stdout
    report = json.loads(iop("config", "diff", SAMPLE, new, "--format", "json").stdout)
    assert report["live_paths"] == ["nodes[node-1].providers[vllm-a].capacity"]
    assert report["restart_required_paths"] == []
    assert report["nodes_to_push"] == ["node-1"]


def test_diff_restart_change_exits_two(tmp_path: Path) -> None:
    def move_listener(d: dict) -> None:  # type: ignore[type-arg]
        d["openai"]["listen"] = "0.0.0.0:9999"
        d["nodes"][1]["providers"][0]["adapter"]["base_url"] = "http://10.1.1.1:11434/v1"

    new = edited(tmp_path, "new.yaml", move_listener)
    result = iop("config", "diff", SAMPLE, new, "--format", "json")
    assert result.returncode == 2
    report = json.loads(result.stdout)
    assert report["restart_required_paths"] == [
        {"path": "nodes[node-2].providers[ollama-c].adapter.base_url", "scope": "node:node-2"},
        {"path": "openai.listen", "scope": "edge"},
    ]
    assert report["restart_scopes"] == ["edge", "node:node-2"]
    text = iop("config", "diff", SAMPLE, new).stdout
    assert "Verdict: restart required (edge, node:node-2)" in text


@pytest.mark.parametrize("order", ["old-invalid", "new-invalid"])
def test_diff_with_an_invalid_file_exits_one(order: str) -> None:
    files = (DOZEN, SAMPLE) if order == "old-invalid" else (SAMPLE, DOZEN)
    result = iop("config", "diff", *files)
    assert result.returncode == 1
    assert str(DOZEN) in result.stderr


def test_schema_describes_every_field() -> None:
    snake = json.loads(iop("config", "schema").stdout)
    camel = json.loads(iop("config", "schema", "--camel").stdout)
    provider = snake["$defs"]["ProviderSpec"]["properties"]
    assert provider["capacity"]["minimum"] == 1
    assert "Live" in provider["capacity"]["description"]
    assert "longContextSlots" in camel["$defs"]["ProviderSpec"]["properties"]


def test_no_arguments_prints_usage() -> None:
    result = iop()
    assert result.returncode == 2
    assert "usage: iop" in result.stderr
