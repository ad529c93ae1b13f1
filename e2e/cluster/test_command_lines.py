"""The cluster's command lines start from any folder and import this checkout's package: the
executables beside localcluster.py and the kubelet's `python -P -m e2e.cluster.kubelet`. They are
run here from a folder holding an `e2e` package of its own, as another checkout's root would;
no cluster is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cluster.layout import HERE, python_command, python_env


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A folder whose `e2e` package exits with 99 when imported."""
    decoy = tmp_path / "elsewhere" / "e2e"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit(99)\n")
    return decoy.parent


def test_status_runs_from_another_folder(elsewhere: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = subprocess.run(
        [str(HERE / "status"), "--json"],
        cwd=elsewhere,
        env={**os.environ, "IOP_CLUSTER_STATE": str(state)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 3, result.stderr  # stopped
    report = json.loads(result.stdout)
    assert (report["status"], report["state_dir"]) == ("stopped", str(state))


def test_the_kubelets_command_line_runs_from_another_folder(elsewhere: Path) -> None:
    result = subprocess.run(
        python_command("e2e.cluster.kubelet", "--help", python=sys.executable),
        cwd=elsewhere,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--node-name" in result.stdout
