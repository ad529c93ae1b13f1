"""Refresh with real processes: `iop edge run` re-reads its file on SIGHUP, `iop edge reload`
drives the admin API (exit codes 0 / 2 / 1), and an admin API off loopback without auth keeps
the Edge from starting."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
import yaml

from iop.edgeconfig import config_hash, load_file
from iop.processes import iop_command, terminate
from testkit import node_token_of

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN_TOKEN = "admin-process-token"


@dataclass
class Edge:
    url: str
    admin_url: str
    config_path: Path
    token_file: Path
    document: dict[str, Any]
    process: asyncio.subprocess.Process
    client_token: str

    def admin(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.admin_url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        )


async def spawn(*args: str, stdout: bool = True) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *iop_command(),
        *args,
        stdout=asyncio.subprocess.PIPE if stdout else asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def document_for(refresh_document: Any, token_file: Path) -> dict[str, Any]:
    document: dict[str, Any] = refresh_document()
    document["edge"]["admin"]["token_file"] = str(token_file)
    return document


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def edge(
    tmp_path_factory, refresh_document, refresh_client_token, iop_processes
) -> AsyncIterator[Edge]:
    folder: Path = tmp_path_factory.mktemp("refresh-process")
    token_file = folder / "admin.token"
    token_file.write_text(ADMIN_TOKEN)
    (folder / "node.token").write_text(node_token_of("node-1"))
    document = document_for(refresh_document, token_file)
    config_path = folder / "edge.yaml"
    config_path.write_text(yaml.safe_dump(document))
    async with contextlib.AsyncExitStack() as stack:
        process, started = await iop_processes.edge(stack, config_path)
        await iop_processes.node(stack, started["hub_port"], "node-1", folder / "node.token")
        await iop_processes.wait_available(started["url"], ["pa", "pb"])
        yield Edge(
            started["url"],
            started["admin_url"],
            config_path,
            token_file,
            document,
            process,
            refresh_client_token,
        )


async def reload(edge: Edge, *args: str) -> tuple[int, dict[str, Any] | None, str]:
    """Run `iop edge reload --admin URL ARGS`: exit code, the report (if any), stderr."""
    process = await spawn("edge", "reload", "--admin", edge.admin_url, *args)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    report = orjson.loads(stdout) if stdout.strip() else None
    return process.returncode, report, stderr.decode()


async def served(edge: Edge) -> str:
    async with httpx.AsyncClient(base_url=edge.url, timeout=30) as http:
        response = await http.post(
            "/v1/chat/completions",
            headers={"authorization": f"Bearer {edge.client_token}"},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert response.status_code == 200, response.text
    model: str = response.json()["model"]
    return model


async def current(edge: Edge) -> dict[str, Any]:
    async with edge.admin() as admin:
        response = await admin.get("/config")
    assert response.status_code == 200, response.text
    document: dict[str, Any] = response.json()
    return document


async def test_sighup_rereads_the_config_file(edge: Edge, until) -> None:
    before = await current(edge)
    assert await served(edge) == "served-a"
    document = copy.deepcopy(edge.document)
    document["nodes"][0]["providers"][0]["priority"] = 20
    edge.config_path.write_text(yaml.safe_dump(document))
    edge.process.send_signal(signal.SIGHUP)

    async def applied() -> dict[str, Any] | None:
        shown = await current(edge)
        return shown if shown["generation"] > before["generation"] else None

    shown = await until(applied, timeout=10)
    assert shown["generation"] == before["generation"] + 1
    assert shown["config_hash"] == config_hash(load_file(edge.config_path))
    assert await served(edge) == "served-b"
    async with edge.admin() as admin:
        last = (await admin.get("/refresh/last")).json()
    assert (last["requested_by"], last["outcome"]) == ("SIGHUP", "applied")
    edge.document = document


async def test_iop_edge_reload_exit_codes(edge: Edge, tmp_path: Path) -> None:
    token = ["--token-file", str(edge.token_file)]
    candidate = tmp_path / "candidate.yaml"

    live = copy.deepcopy(edge.document)
    live["nodes"][0]["providers"][0]["capacity"] = 3
    candidate.write_text(yaml.safe_dump(live))
    before = await current(edge)
    code, report, stderr = await reload(edge, *token, "--config", str(candidate), "--dry-run")
    assert (code, report and report["outcome"]) == (0, "valid"), stderr
    assert (await current(edge))["generation"] == before["generation"]
    code, report, stderr = await reload(edge, *token, "--config", str(candidate))
    assert code == 0 and report is not None, stderr
    assert report["outcome"] == "applied"
    assert [(p["node_id"], p["status"]) for p in report["pushes"]] == [("node-1", "acked")]
    assert "applied generation" in stderr

    restart = copy.deepcopy(live)
    restart["edge"]["id"] = "edge-renamed"
    candidate.write_text(yaml.safe_dump(restart))
    for extra in ((), ("--dry-run",)):
        code, report, stderr = await reload(edge, *token, "--config", str(candidate), *extra)
        assert code == 2 and report is not None, stderr
        assert report["restart_required_paths"] == [{"path": "edge.id", "scope": "edge"}]

    candidate.write_text("edge: {id: Not A Name}\n")
    code, report, stderr = await reload(edge, *token, "--config", str(candidate))
    assert code == 1 and report is not None
    assert report["outcome"] == "invalid" and report["problems"]
    assert "  edge.id: " in stderr  # each problem on stderr too, not only in the JSON

    wrong = tmp_path / "wrong.token"
    wrong.write_text("nope")
    code, report, stderr = await reload(edge, "--token-file", str(wrong), "--dry-run")
    assert (code, report) == (1, None)
    assert "401" in stderr and "wrong admin token" in stderr
    assert "--token-file FILE" in stderr

    # No --config: the Edge re-reads its own file (which still has capacity 2 for pa).
    code, report, stderr = await reload(edge, *token)
    assert code == 0 and report is not None, stderr
    assert report["source"] == f"file {edge.config_path}"
    assert report["live_paths"] == ["nodes[node-1].providers[pa].capacity"]


async def test_an_admin_api_off_loopback_without_auth_stops_the_edge(
    refresh_document, tmp_path: Path
) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(yaml.safe_dump(refresh_document()))
    process = await spawn("edge", "run", "--config", str(path), "--admin-listen", "0.0.0.0:0")
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 1
    assert stdout == b""
    assert b"off loopback, without auth" in stderr


async def test_an_edge_started_from_a_relative_path_rereads_its_file(
    refresh_document, tmp_path: Path, until
) -> None:
    """`iop edge run --config edge.yaml`, as docs/edge.md shows it: the path is made absolute at
    start, so a refresh without a source and SIGHUP re-read it; a SIGHUP that finds the file gone
    logs why and changes nothing, and the next one works."""
    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN_TOKEN)
    document = document_for(refresh_document, token_file)
    (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
    process = await asyncio.create_subprocess_exec(
        *iop_command(), "edge", "run", "--config", "edge.yaml", "--log-level", "INFO",
        cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None and process.stderr is not None
        started = orjson.loads(await asyncio.wait_for(process.stdout.readline(), 30))
        headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=started["admin_url"], headers=headers) as admin:
            dry = await admin.post("/refresh", json={"mode": "dry_run"})
            assert dry.status_code == 200, dry.text
            assert dry.json()["source"] == f"file {tmp_path / 'edge.yaml'}"
            (tmp_path / "edge.yaml").rename(tmp_path / "away.yaml")
            process.send_signal(signal.SIGHUP)
            line = await asyncio.wait_for(process.stderr.readline(), 10)
            while b"SIGHUP" not in line:
                line = await asyncio.wait_for(process.stderr.readline(), 10)
            assert b"cannot re-read the config file" in line and b"nothing changed" in line
            document["models"][0]["providers"] = {"pb": "served-b"}
            (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
            process.send_signal(signal.SIGHUP)

            async def applied() -> dict[str, Any] | None:
                last = await admin.get("/refresh/last", params={"mode": "apply"})
                return last.json() if last.status_code == 200 else None

            last = await until(applied, timeout=10)
            assert (last["requested_by"], last["outcome"]) == ("SIGHUP", "applied")
    finally:
        await terminate(process)
