"""Fixtures for the chart tests: helm (from the local cluster's build) and kubeconform.

Both are built from pinned Go modules (e2e/cluster, e2e/tools) on first use and cached. The
build runs once collection is done and only when a selected test needs the tools, outside any
test's timeout, with its progress shown (as e2e/conftest.py does for the cluster); if it fails,
every test that needs the tools fails with the reason. Nothing is skipped.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import gobuilding
from e2e.tools import chartcheck

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "iop-edge"
FIXTURE = "chart_tools"
KUBE_VERSION = "1.37.2"


class RenderFailed(AssertionError):
    """helm template refused the values; the message is helm's."""


@dataclass(frozen=True)
class ChartTools:
    """helm and kubeconform, and the schemas kubeconform validates against."""

    helm: Path
    kubeconform: Path
    schemas: Path

    def template(
        self,
        *args: str,
        values: dict[str, Any] | None = None,
        kube_version: str | None = KUBE_VERSION,
    ) -> str:
        """`helm template` of the chart (None: without --kube-version, as many GitOps tools
        render); raises RenderFailed with helm's message."""
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as handle:
            extra: list[str] = []
            if values is not None:
                json.dump(values, handle)
                handle.flush()
                extra = ["--values", handle.name]
            result = subprocess.run(
                [
                    str(self.helm),
                    "template",
                    "iop",
                    str(CHART),
                    "--namespace=iop-system",
                    *([f"--kube-version={kube_version}"] if kube_version else []),
                    *extra,
                    *args,
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        if result.returncode != 0:
            raise RenderFailed(result.stderr)
        return result.stdout

    def documents(self, *args: str, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.template(*args, values=values)) if d]

    def kubeconform_run(self, manifests: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(self.kubeconform),
                "-strict",
                "-summary",
                f"-schema-location={chartcheck.location(self.schemas)}",
                "-",
            ],
            input=manifests,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def lint(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.helm), "lint", "--strict", str(CHART), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


@dataclass
class _Session:
    tools: ChartTools | None = None
    error: str | None = None
    workdir: tempfile.TemporaryDirectory[str] | None = None


SESSION = pytest.StashKey[_Session]()


def _prepare(config: pytest.Config) -> _Session:
    session = _Session(workdir=tempfile.TemporaryDirectory(prefix="iop-chart-"))
    capture = config.pluginmanager.getplugin("capturemanager")
    disabled = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with disabled:
            helm = gobuilding.ensure_built().binary("helm")
            kubeconform = chartcheck.build_kubeconform()
            assert session.workdir is not None
            schemas = chartcheck.write_schemas(Path(session.workdir.name) / "schemas")
        session.tools = ChartTools(helm, kubeconform, schemas)
    except Exception as error:  # reported by every test that needs the tools
        session.error = f"helm/kubeconform could not be prepared: {type(error).__name__}: {error}"
    return session


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if config.option.collectonly or SESSION in config.stash:
        return
    if any(FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        config.stash[SESSION] = _prepare(config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    state = session.config.stash.get(SESSION, None)
    if state is not None and state.workdir is not None:
        state.workdir.cleanup()


@pytest.fixture(scope="session")
def chart_tools(pytestconfig: pytest.Config) -> ChartTools:
    if SESSION not in pytestconfig.stash:
        pytestconfig.stash[SESSION] = _prepare(pytestconfig)
    state = pytestconfig.stash[SESSION]
    if state.tools is None:
        pytest.fail(state.error or "no chart tools", pytrace=False)
    return state.tools


@pytest.fixture
def chart_values() -> Iterator[dict[str, Any]]:
    """The chart's default values, parsed (a test changes its own copy)."""
    yield yaml.safe_load((CHART / "values.yaml").read_text())
