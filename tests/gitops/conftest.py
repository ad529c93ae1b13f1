"""Fixtures for the GitOps health tests: kstatus built from its pinned Go module
(`e2e/tools/kstatus`) and the Argo CD health check run in Lua (`e2e/tools/healthcheck.py`).

kstatus is built on first use and cached. The build runs once collection is done and only when a
selected test needs it, outside any test's timeout, with its progress shown (as tests/chart does
for helm and kubeconform); if it fails, every test that needs it fails with the reason. Nothing is
skipped.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURE = "health_readers"
SESSION = pytest.StashKey["Any | str"]()


def _prepare(config: pytest.Config) -> Any | str:
    """healthcheck.HealthReaders, or why there are none."""
    sys.path.insert(0, str(REPO / "e2e" / "tools"))
    return importlib.import_module("healthcheck").prepare_for_pytest(config)


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if config.option.collectonly or SESSION in config.stash:
        return
    if any(FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        config.stash[SESSION] = _prepare(config)


@pytest.fixture(scope="session")
def health_readers(pytestconfig: pytest.Config) -> Any:
    """kstatus and the Argo CD health check (`healthcheck.HealthReaders`)."""
    if SESSION not in pytestconfig.stash:
        pytestconfig.stash[SESSION] = _prepare(pytestconfig)
    prepared = pytestconfig.stash[SESSION]
    if isinstance(prepared, str):
        pytest.fail(prepared, pytrace=False)
    return prepared
