"""Fixtures for the GitOps health tests: kstatus built from its pinned Go module
(`e2e/tools/kstatus`) and the Argo CD health check run in Lua (`e2e/tools/healthcheck.py`).

kstatus is built on first use and cached. The build runs once collection is done and only when a
selected test needs it, outside any test's timeout, with its progress shown (as tests/chart does
for helm and kubeconform); if it fails, every test that needs it fails with the reason. Nothing is
skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.tools import healthcheck

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_finish(session: pytest.Session) -> None:
    healthcheck.collection_finished(session)


@pytest.fixture(scope="session")
def health_readers(pytestconfig: pytest.Config) -> healthcheck.HealthReaders:
    """kstatus and the Argo CD health check (`healthcheck.HealthReaders`)."""
    return healthcheck.readers_for(pytestconfig)
