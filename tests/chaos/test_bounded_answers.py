"""Nothing a provider sends back is held whole past a bound: a 108 MB answer (with a length, or
chunked without one), one 108 MB event of a stream, a 108 MB error body. The Node reads at most
`openai.max_response_bytes` of an answer (64 KiB of an error) and the client gets an
OpenAI-shaped 502; an answer under the bound but larger than a wire message arrives whole.

Real processes: an Edge, a Node, and its providers' model server, a hostile one
(`hostileupstream.py`: it answers as the request's model says), the official `openai` client as
the client. Whole, the 108 MB answer cost the Node some 500 MB and the Edge 127 MB.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml

from iop.processes import spawn_edge, spawn_node, terminate
from testkit import CLIENT_TOKEN, node_token_of

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

HOSTILE = Path(__file__).with_name("hostileupstream.py")
MODES = ("whole", "length", "chunked", "event", "error")
LIMIT = 8 * 1024 * 1024
WHOLE_BYTES = 5 * 1024 * 1024


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no VmRSS for process {pid}")


@contextlib.asynccontextmanager
async def stack(document_of: Any, tmp_path: Path) -> AsyncIterator[tuple[int, int, str]]:
    """The hostile upstream, and an Edge and a Node over it with a provider per mode (model =
    mode); yields the Edge's and the Node's pids and the Edge's URL."""
    async with contextlib.AsyncExitStack() as exits:
        upstream = await asyncio.create_subprocess_exec(
            sys.executable, str(HOSTILE), stdout=asyncio.subprocess.PIPE
        )
        exits.push_async_callback(terminate, upstream)
        assert upstream.stdout is not None
        port = orjson.loads(await asyncio.wait_for(upstream.stdout.readline(), 60))["port"]
        providers = [
            {
                "id": f"p-{mode}",
                "adapter": {"type": "openai", "base_url": f"http://127.0.0.1:{port}/v1"},
                "served_models": [mode],
                "capacity": 4,
                "health": {"interval_ms": 0},
            }
            for mode in MODES
        ]
        document = document_of(
            providers,
            {mode: [f"p-{mode}"] for mode in MODES},
            openai={"max_response_bytes": LIMIT},
            edge={"tls": None},
        )
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        (tmp_path / "node.token").write_text(node_token_of("node-1"))
        edge, started = await spawn_edge(tmp_path / "edge.yaml")
        exits.push_async_callback(terminate, edge)
        node = await spawn_node(started["hub_port"], "node-1", tmp_path / "node.token")
        exits.push_async_callback(terminate, node)
        async with httpx.AsyncClient(base_url=started["url"]) as http:
            for _ in range(900):
                if len((await http.get("/readyz")).json()["providers_available"]) == len(MODES):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the node never connected")
        yield edge.pid, node.pid, started["url"]


async def test_an_answer_past_the_bound_is_refused_with_memory_bounded_and_one_under_it_arrives(
    document_of, tmp_path: Path
) -> None:
    async with stack(document_of, tmp_path) as (edge_pid, node_pid, url):
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=CLIENT_TOKEN, max_retries=0, timeout=120
        )
        messages: Any = [{"role": "user", "content": "hi"}]
        async with client:
            # Larger than a wire message, under the bound: it arrives whole (in pieces).
            answer = await client.chat.completions.create(model="whole", messages=messages)
            assert answer.choices[0].message.content == "a" * WHOLE_BYTES
            idle = {"edge": rss_mb(edge_pid), "node": rss_mb(node_pid)}
            peak = dict(idle)

            async def sample() -> None:
                while True:
                    peak["edge"] = max(peak["edge"], rss_mb(edge_pid))
                    peak["node"] = max(peak["node"], rss_mb(node_pid))
                    await asyncio.sleep(0.02)

            sampler = asyncio.create_task(sample())
            try:
                for mode, stream in [("length", False), ("chunked", False), ("event", True)]:
                    with pytest.raises(openai.APIStatusError) as refused:
                        await client.chat.completions.create(
                            model=mode, messages=messages, stream=stream
                        )
                    assert refused.value.status_code == 502, mode
                    error = orjson.loads(refused.value.response.content)["error"]
                    assert error["code"] == "response_too_large", (mode, error)
                    assert "openai.max_response_bytes" in error["message"]
                with pytest.raises(openai.APIStatusError) as failed:
                    await client.chat.completions.create(model="error", messages=messages)
                assert failed.value.status_code == 502
                assert len(failed.value.response.content) < 2048
            finally:
                sampler.cancel()
    grown = {name: peak[name] - idle[name] for name in idle}
    assert grown["node"] < 2 * LIMIT / 2**20 + 24, f"Node grew {grown['node']:.0f} MB"
    assert grown["edge"] < 24, f"Edge grew {grown['edge']:.0f} MB"
