"""Every benchmark runs, briefly, so that none rots: `python -m bench.NAME` with the smallest
sizes and durations it takes, as a child process from the checkout's root, and prints its table.

Nothing here is timed or compared: the figures of such a run mean nothing (docs/benchmarks.md
holds the real ones). Three kinds run only far enough to import and parse their arguments, and
the reason is named beside each: the operator's two need a Kubernetes cluster (`e2e/cluster`),
and the studies install their candidates from PyPI into environments of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Each run starts its processes (up to seven for bench.replicas): on a machine shared with other
# runs that takes minutes, not seconds, and the bound is for a run that hangs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: name -> the arguments of a run of a second or so (a few for those that start several
#: processes), and what its output must show.
RUNS = {
    "config_scale": (["--base-nodes", "10", "--repeat", "1"], "classify"),
    "edge": (["--seconds", "0.2", "--concurrency", "1", "--paths", "edge-alone"], "edge alone"),
    "wire": (["--seconds", "0.2", "--concurrency", "1"], "wire/direct"),
    "refresh": (
        [
            "--nodes",
            "2",
            "--applies",
            "2",
            "--rounds",
            "1",
            "--window",
            "0.3",
            "--concurrency",
            "2",
        ],
        "apply",
    ),
    "peers": (
        [
            *["--paths", "direct", "iop", "iop-local", "--rounds", "1", "--seconds", "0.2"],
            *["--concurrency", "1", "--modes", "whole", "stream-16"],
        ],
        "iop-local",
    ),
    "grpc_hops": (["--seconds", "0.2", "--rounds", "1", "--in-flight", "1"], "aio-options"),
    "tracing": (
        ["--rounds", "1", "--seconds", "0.2", "--concurrency", "1", "--modes", "whole"],
        "all sampled",
    ),
    "sse_passthrough": (["--tokens", "16", "--repeat", "1"], "passed through"),
    "fleet": (["--nodes", "3", "--idle-seconds", "0.2", "--seconds", "0.2"], "apply -> acks"),
    "replicas": (["--rounds", "1", "--seconds", "0.2", "--concurrency", "2"], "req/s"),
    "tail": (["--rounds", "1", "--seconds", "0.2", "--concurrency", "1"], "p99"),
    "memory": (["--connections", "5", "--streams", "5", "--cycles", "1"], "KiB"),
    # Its smallest part that starts children: this interpreter as its own baseline.
    "retries": (["--parts", "relay", "--rounds", "1", "--baseline", sys.executable], "baseline"),
    "limits": (["--parts", "admission", "--rounds", "1"], "admission"),
    "limitstore": (["--only", "stop", "--wait", "2"], "stop"),
    "health": (["--rounds", "1", "--interval-ms", "200", "--cost-seconds", "0.5"], "out"),
    "hostile": (["--only", "wrong-tokens"], "wrong"),
    "canary": (["--rounds", "1", "--window", "0.3", "--concurrency", "2"], "canary / none"),
    "reliability": (["--rounds", "1", "--only", "headers"], "header"),
    "lora": (
        [
            *["--rates", "4", "--seconds", "1", "--warmup", "0"],
            *["--systems", "iop:adapters", "iop:round_robin"],
        ],
        "iop:adapters",
    ),
    "routing": (
        ["--loads", "0.5", "--seconds", "2", "--warmup", "1", "--systems", "iop:prefix_affinity"],
        "prefix-cache hits",
    ),
    "priorities": (
        [
            *["--loads", "1.5", "--seconds", "3", "--warmup", "1", "--drain", "2"],
            *["--systems", "iop:classes+engine", "--no-alone"],
        ],
        "goodput",
    ),
}
#: name -> why it runs only as far as `--help` here.
HELP_ONLY = {
    "operator": "needs a Kubernetes cluster (bench.operator finds e2e/cluster's)",
    "edgeconfig_sizes": "needs a Kubernetes cluster (bench.edgeconfig_sizes finds e2e/cluster's)",
    "studies.yaml_parsers": "installs its candidates from PyPI first",
    "studies.http_clients": "installs its candidates from PyPI first",
}


def run(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m bench.NAME ARGS` in a session of its own: a run that overstays its bound is
    stopped with every process it started (its Edges, Nodes and upstreams), not just itself."""
    with subprocess.Popen(
        [sys.executable, "-m", f"bench.{name}", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=280)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"bench.{name} ran past 280 s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_every_benchmark_module_is_listed_here() -> None:
    found = {
        path.relative_to(REPO / "bench").with_suffix("").as_posix().replace("/", ".")
        for path in (REPO / "bench").rglob("*.py")
        if path.stem not in ("__init__", "benchkit")
    }
    assert found == set(RUNS) | set(HELP_ONLY)


@pytest.mark.parametrize(
    ("name", "args", "shows"), [(n, *r) for n, r in RUNS.items()], ids=list(RUNS)
)
def test_a_short_run_prints_its_table(name: str, args: list[str], shows: str) -> None:
    finished = run(name, *args)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert shows in finished.stdout, finished.stdout[-3000:]


@pytest.mark.parametrize("name", list(HELP_ONLY), ids=list(HELP_ONLY))
def test_a_benchmark_that_needs_more_than_this_machine_parses_its_arguments(name: str) -> None:
    finished = run(name, "--help")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "usage:" in finished.stdout
