"""`iop node run` as a real process: it connects, dies, and comes back."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from iop.edge.hub.nodehub import NodeHub
from iop.processes import free_port, spawn_iop, spawn_node, terminate
from iop.wire import (
    ADAPTER_ERROR,
    PROBE_FAILED,
    RunChunk,
    RunDone,
    RunFailed,
    RunRequest,
    statuses,
)

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


@contextlib.asynccontextmanager
async def node_process(
    port: int, token_file: Path, tls_args: tuple[str, ...], env: Mapping[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await spawn_node(
        port, "node-1", token_file, "--backoff-max", "0.5", *tls_args, env=env
    )
    try:
        yield process
    finally:
        await terminate(process)


def request(run_id: str, stream: bool) -> RunRequest:
    body = {
        "model": "served",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": 50 if stream else 1,
    }
    return RunRequest(run_id, "p1", "served", "chat", orjson.dumps(body), stream, None)


async def test_a_killed_node_fails_its_runs_at_once_and_reconnects_when_restarted(
    wire_config, start_hub, until, node_token: str, tmp_path: Path, tls
) -> None:
    slow = {"type": "fake", "tokens_per_second": 5, "completion_tokens": 50}
    hub = await start_hub(wire_config([{"id": "p1", "adapter": slow}]))
    token_file = tmp_path / "token"
    token_file.write_text(node_token + "\n")

    async with node_process(hub.port, token_file, tls.node_args()) as node:
        await until(hub.connected_providers, timeout=30)
        async with hub.run(request("run-1", stream=True)) as stream:
            assert isinstance(await anext(stream), RunChunk)
            node.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            rest = [event async for event in stream]
        assert time.monotonic() - killed < 2
        assert isinstance(rest[-1], RunFailed)
        assert rest[-1].code == statuses.NODE_DISCONNECTED
        assert hub.connected_providers() == {}

    async with node_process(hub.port, token_file, tls.node_args()):
        await until(hub.connected_providers, timeout=30)
        async with hub.run(request("run-2", stream=False)) as stream:
            events = [event async for event in stream]
        assert isinstance(events[-1], RunDone)


async def test_the_command_refuses_a_missing_token_file(tmp_path: Path) -> None:
    process = await spawn_iop(
        *("node", "run", "--edge", "127.0.0.1:1", "--node-id", "node-1"),
        *("--token-file", str(tmp_path / "missing")),
        stderr=True,
    )
    _, stderr = await process.communicate()
    assert process.returncode == 2
    assert b"cannot read --token-file" in stderr


async def test_the_health_endpoints_follow_the_nodes_welcome_and_drain(
    wire_config, start_hub, until, node_token: str, tmp_path: Path, tls
) -> None:
    """`--health-listen`: /healthz answers while the process runs; /readyz only once an Edge has
    welcomed the Node, and no longer while it drains (what the chart's probes ask)."""
    slow = {"type": "fake", "tokens_per_second": 5, "completion_tokens": 50}
    hub = await start_hub(wire_config([{"id": "p1", "adapter": slow}]))
    token_file = tmp_path / "token"
    token_file.write_text(node_token + "\n")

    port = free_port()
    health = ("--health-listen", f"127.0.0.1:{port}", *tls.node_args())
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        # No Edge to dial: alive, not ready.
        async with node_process(1, token_file, health):
            await until(lambda: _is(_get(http, "/healthz"), 200), timeout=30)
            assert await _get(http, "/readyz") == (
                503,
                {"ready": False, "reason": "no Edge has welcomed this node yet"},
            )
            assert (await http.post("/readyz")).status_code == 405
            assert (await http.get("/metrics")).status_code == 404

        async with node_process(hub.port, token_file, health) as node:
            await until(lambda: _is(_get(http, "/readyz"), 200), timeout=30)
            assert (await _get(http, "/readyz"))[1] == {
                "ready": True,
                "reason": "welcomed by 1 of 1 Edge(s)",
            }
            async with hub.run(request("run-1", stream=True)) as stream:
                assert isinstance(await anext(stream), RunChunk)
                node.send_signal(signal.SIGTERM)  # drains: the run in flight finishes
                await until(lambda: _is(_get(http, "/readyz"), 503), timeout=10)
                assert (await _get(http, "/readyz"))[1]["reason"] == "draining: the node is leaving"
                assert (await _get(http, "/healthz"))[0] == 200
                rest = [event async for event in stream]
            assert isinstance(rest[-1], RunDone)
            assert await asyncio.wait_for(node.wait(), 30) == 0


def _with_health(tmp_path: Path, node_token: str, tls: Any) -> tuple[Path, int, tuple[str, ...]]:
    """The token file, the health port and the arguments of a Node that serves its probes."""
    token_file = tmp_path / "token"
    token_file.write_text(node_token + "\n")
    port = free_port()
    return token_file, port, ("--health-listen", f"127.0.0.1:{port}", *tls.node_args())


async def test_readyz_names_each_provider_whose_config_cannot_run_on_the_node(
    wire_config, start_hub, until, node_token: str, tmp_path: Path, tls, monkeypatch
) -> None:
    """A Node given a config whose providers cannot run in its environment (an API key variable
    unset, one holding a line break) is not ready, and says which and why (a rollout that does
    this is put back); a config that runs there makes it ready."""
    monkeypatch.delenv("IOP_TEST_UNSET_KEY", raising=False)  # nor in the Node's environment
    env = {"IOP_TEST_BROKEN_KEY": "sk-one\nsk-two", "IOP_TEST_NODE_KEY": "sk-test"}
    down = f"http://127.0.0.1:{free_port()}/v1"

    def openai(pid: str, key: str) -> dict[str, Any]:
        return {"id": pid, "adapter": {"type": "openai", "base_url": down, "api_key_env": key}}

    hub = await start_hub(
        wire_config([openai("p1", "IOP_TEST_UNSET_KEY"), openai("p2", "IOP_TEST_BROKEN_KEY")])
    )
    token_file, port, health = _with_health(tmp_path, node_token, tls)
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http,
        node_process(hub.port, token_file, health, env),
    ):
        await until(lambda: _reasons(hub) == {"p1": ADAPTER_ERROR, "p2": ADAPTER_ERROR}, 30)
        assert await _get(http, "/readyz") == (
            503,
            {
                "ready": False,
                "reason": "provider p1: environment variable IOP_TEST_UNSET_KEY is not set; "
                "provider p2: environment variable IOP_TEST_BROKEN_KEY holds a line break",
            },
        )

        fixed = wire_config([openai("p1", "IOP_TEST_NODE_KEY"), openai("p2", "IOP_TEST_NODE_KEY")])
        acks = await hub.swap_config(fixed)
        assert acks["node-1"] is not None
        assert await _get(http, "/readyz") == (
            200,
            {"ready": True, "reason": "welcomed by 1 of 1 Edge(s)"},
        )


async def test_a_provider_whose_server_is_down_leaves_the_node_ready(
    wire_config, start_hub, until, node_token: str, tmp_path: Path, tls
) -> None:
    """A provider's server that does not answer (a closed port) is its health, which the Edges
    judge: the Node's config runs, and a restart would not mend the server."""
    down = {"type": "openai", "base_url": f"http://127.0.0.1:{free_port()}/v1"}
    policy = {"interval_ms": 100, "timeout_ms": 500, "failure_threshold": 1}
    hub = await start_hub(wire_config([{"id": "p1", "adapter": down, "health": policy}]))
    token_file, port, health = _with_health(tmp_path, node_token, tls)
    async with (
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http,
        node_process(hub.port, token_file, health),
    ):
        await until(lambda: _reasons(hub) == {"p1": PROBE_FAILED}, timeout=30)
        assert await _get(http, "/readyz") == (
            200,
            {"ready": True, "reason": "welcomed by 1 of 1 Edge(s)"},
        )


def _reasons(hub: NodeHub) -> dict[str, str]:
    """provider id -> the reason code of its health on `hub` ("" when healthy)."""
    return {pid: link.reason for pid, link in hub.connected_providers().items()}


async def _get(http: httpx.AsyncClient, path: str) -> tuple[int, dict[str, object]]:
    try:
        response = await http.get(path)
    except httpx.TransportError:
        return 0, {}
    return response.status_code, response.json()


async def _is(answer: Awaitable[tuple[int, object]], status: int) -> bool:
    return (await answer)[0] == status


async def test_a_node_tells_each_edge_the_runs_that_came_from_the_others(
    wire_config, start_hub, until, node_token: str, tmp_path: Path, tls
) -> None:
    """Two Edges (hubs) share a Node: each heartbeat tells an Edge the runs of the other one on
    each provider (what least_load adds to its own), and its total."""
    slow = {"type": "fake", "tokens_per_second": 5, "completion_tokens": 50}
    config = wire_config([{"id": "p1", "adapter": slow}])
    first, second = await start_hub(config), await start_hub(config)
    token_file = tmp_path / "token"
    token_file.write_text(node_token + "\n")
    process = await spawn_node(
        first.port,
        "node-1",
        token_file,
        *("--edge", f"127.0.0.1:{second.port}", *tls.node_args()),
    )
    try:
        await until(lambda: first.connected_providers() and second.connected_providers(), 30)
        async with (
            first.run(request("run-a", stream=True)) as one,
            first.run(request("run-b", stream=True)) as two,
        ):
            assert isinstance(await anext(one), RunChunk)
            assert isinstance(await anext(two), RunChunk)
            seen = await until(
                lambda: (load := second.provider_loads().get("p1")) and load.elsewhere == 2 and load
            )
            assert seen.node_in_flight == 2
            # The same heartbeat round told `first` too (each Edge has its own stream and timer).
            mine = await until(
                lambda: (
                    (load := first.provider_loads().get("p1")) and load.node_in_flight == 2 and load
                )
            )
            assert mine.elsewhere == 0  # its own runs are no one else's
        await until(lambda: second.provider_loads()["p1"].elsewhere == 0)
    finally:
        await terminate(process)
