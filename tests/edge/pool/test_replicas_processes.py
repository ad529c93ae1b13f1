"""Two Edge replicas share two Nodes under load, and no provider ever runs more than its capacity.

Real processes: two `iop edge run` with the same config, two `iop node run` each dialing both
Edges, and one `iop fake-upstream` per provider (so each upstream's peak concurrency is that
provider's). Each Edge counts only its own runs, so together they offer a provider up to twice
its capacity; the Node enforces the capacity across every Edge and refuses the excess with the
retryable `provider_busy`, which the Edge retries elsewhere or later (docs/edge.md).

What must hold: every request, sent to either replica, succeeds; no upstream ever sees more
completions at once than its provider's capacity; and the load did reach the capacity on both
(the test would prove nothing otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from iop.processes import spawn_fake_upstream, spawn_iop, terminate
from testkit import CLIENT_TOKEN, edge_document, node_token_of, provider

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CAPACITY = 3
WORKERS_PER_EDGE = 16
REQUESTS = 320


def document(upstreams: list[str]) -> dict[str, Any]:
    nodes = {
        f"node-{i}": [
            provider(f"p{i}", {"type": "openai", "base_url": url}, capacity=CAPACITY, max_queue=64)
        ]
        for i, url in enumerate(upstreams, start=1)
    }
    return edge_document(nodes, edge_id="edge-replicas", admin=True)


async def test_capacity_holds_across_two_replicas_under_load(
    tmp_path: Path, iop_processes: Any
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        upstreams = [
            await stack.enter_async_context(spawn_fake_upstream(["--latency-ms", "15"]))
            for _ in range(2)
        ]
        config = tmp_path / "edge.yaml"
        config.write_text(yaml.safe_dump(document([u.base_url for u in upstreams])))
        edges = [await iop_processes.edge(stack, config) for _ in range(2)]
        hubs = [f"127.0.0.1:{started['hub_port']}" for _, started in edges]
        for i in (1, 2):
            (tmp_path / f"token-{i}").write_text(node_token_of(f"node-{i}"))
            node = await spawn_iop(
                *("node", "run", "--edge", hubs[0], "--edge", hubs[1], "--node-id", f"node-{i}"),
                *("--token-file", str(tmp_path / f"token-{i}"), "--log-level", "WARNING"),
            )
            stack.push_async_callback(terminate, node)
        urls = [str(started["url"]) for _, started in edges]
        for url in urls:
            await iop_processes.wait_available(url, ["p1", "p2"])

        statuses: list[int] = []
        served_by_edge = [0, 0]
        budget = iter(range(REQUESTS))

        async def worker(http: httpx.AsyncClient, edge: int, stream: bool) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
            for _ in budget:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    text = await response.aread()
                ok = response.status_code == 200 and (
                    text.rstrip().endswith(b"data: [DONE]") if stream else b'"choices"' in text
                )
                statuses.append(response.status_code if ok else -response.status_code)
                served_by_edge[edge] += 1

        headers = {"authorization": f"Bearer {CLIENT_TOKEN}"}
        limits = httpx.Limits(max_connections=WORKERS_PER_EDGE)
        async with (
            httpx.AsyncClient(base_url=urls[0], headers=headers, limits=limits) as first,
            httpx.AsyncClient(base_url=urls[1], headers=headers, limits=limits) as second,
        ):
            await asyncio.gather(
                *(
                    worker(http, edge, stream=n % 2 == 1)
                    for edge, http in enumerate((first, second))
                    for n in range(WORKERS_PER_EDGE)
                )
            )

        assert statuses == [200] * REQUESTS
        assert all(count > 0 for count in served_by_edge), served_by_edge
        async with httpx.AsyncClient() as http:
            stats = [
                orjson.loads((await http.get(f"http://{u.listen}/fake/stats")).content)
                for u in upstreams
            ]
        assert [s["peak_in_flight"] for s in stats] == [CAPACITY, CAPACITY], stats
        assert sum(s["completed"] for s in stats) == REQUESTS
