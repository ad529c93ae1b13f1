"""`iop config history`, run as a real process: the cluster revisions of an EdgeConfig read
through the Kubernetes API (the fake one of tests/operator, over a socket, with a kubeconfig
naming it), and an Edge's own log through its admin API (a real in-process Edge)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import yaml

from iop.edge import EdgeServer
from testkit import edge_document, provider
from tests.operator.fakeapi import FakeApi, fake_api

HASH = "ab" * 32

STATUS: dict[str, Any] = {
    "revision": 1,
    "rollout": {"stable": 1, "candidate": 2, "state": "Watching"},
    "history": [
        {
            "revision": 2,
            "configHash": "cd" * 32,
            "generation": 4,
            "appliedAt": "2026-01-02T03:04:05Z",
            "livePaths": ["nodes[n].providers[p].capacity"],
            "restartPaths": [{"path": "edge.listen", "scope": "edge"}],
            "omittedPaths": 3,
            "outcome": "Watching",
            "reason": "",
        },
        {
            "revision": 1,
            "configHash": HASH,
            "generation": 1,
            "appliedAt": "2026-01-02T03:00:00Z",
            "livePaths": [],
            "restartPaths": [],
            "outcome": "Promoted",
            "reason": "40 requests in 15s passed every check",
            "check": "bake",
        },
    ],
}


async def iop(*args: str | Path) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "iop.cli",
        *map(str, args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def kubeconfig(tmp_path: Path, server: str, namespace: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [
                    {"name": "x", "context": {"cluster": "c", "user": "u", "namespace": namespace}}
                ],
                "current-context": "x",
            }
        )
    )
    return path


async def test_the_cluster_history_newest_first_with_paths_and_outcomes(tmp_path: Path) -> None:
    fake = FakeApi()
    fake.objects["/apis/iop.dev/v1alpha1/namespaces/team/edgeconfigs/demo"] = {
        "metadata": {"name": "demo", "namespace": "team", "resourceVersion": "1"},
        "status": STATUS,
    }
    async with fake_api(fake) as api:
        config = kubeconfig(tmp_path, api.settings.server, "team")  # the context's namespace
        code, out, err = await iop("config", "history", "--name", "demo", "--kubeconfig", config)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split()[:5] == ["REV", "GEN", "HASH", "APPLIED", "OUTCOME"]
        assert lines[1].startswith("?   2    4  cdcdcdcdcdcd  2026-01-02T03:04:05Z  Watching")
        assert "paths: nodes[n].providers[p].capacity, edge.listen (restart edge) (+3)" in lines[1]
        assert lines[2].startswith("*   1    1  abababababab")
        assert "Promoted    paths: -; bake: 40 requests in 15s passed every check" in lines[2]

        code, out, _ = await iop(
            "config", "history", "--name", "demo", "--kubeconfig", config, "--json"
        )
        assert code == 0 and orjson.loads(out) == STATUS

        code, _, err = await iop(
            "config", "history", "--name", "other", "-n", "team", "--kubeconfig", config
        )
        assert code == 1 and "iop config history:" in err and "not found" in err


async def test_an_edges_own_history_through_its_admin_api(
    start_edge: Callable[..., Awaitable[EdgeServer]],
) -> None:
    edge = await start_edge(edge_document({"n": [provider("p")]}, admin=True))
    code, out, err = await iop("config", "history", "--admin", str(edge.admin_url))
    assert code == 0, err
    assert out.splitlines()[0].split()[:4] == ["REV", "HASH", "APPLIED", "OUTCOME"]
    assert out.splitlines()[1].startswith("*   1  ") and "started" in out
