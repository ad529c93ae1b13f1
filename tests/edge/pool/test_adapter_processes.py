"""LoRA adapters with real processes: `iop edge run`, `iop node run` and two `iop fake-upstream
--gpu` servers with one adapter slot each, driven by the official openai client. A request for
an adapter goes to the server that has it loaded (as its `vllm:lora_requests_info` says, read by
the Node's probe), one for another adapter to the server with room for it; neither server swaps.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from iop.processes import spawn_fake_upstream, spawn_iop, terminate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: Simulated servers with one adapter slot; an answer of 2,000 tokens runs for some seconds.
GPU = ["--gpu", "--gpu-step-ms", "5", "--gpu-step-ms-per-seq", "0.1"]
GPU += ["--gpu-prefill-tokens-per-s", "500000", "--model", "served", "--completion-tokens", "2000"]
GPU += ["--gpu-lora-adapters", "sql,chat", "--gpu-max-loras", "1", "--gpu-lora-load-ms", "20"]


async def test_an_adapters_requests_go_where_it_is_loaded(
    document_of: Any,
    tokens: dict[str, str],
    node_token: str,
    iop_processes: Any,
    tmp_path: Path,
    until: Any,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        upstreams = [await stack.enter_async_context(spawn_fake_upstream(GPU)) for _ in range(2)]
        providers = [
            {
                "id": f"gpu-{i}",
                "adapter": {"type": "openai", "base_url": upstream.base_url},
                "served_models": ["served"],
                "capacity": 4,
                "health": {"interval_ms": 200},
            }
            for i, upstream in enumerate(upstreams, start=1)
        ]
        document: dict[str, Any] = document_of(
            providers,
            {"m": ["gpu-1", "gpu-2"]},
            model_settings={"m": {"adapters": ["sql", "chat"]}},
            edge={"admin": {"listen": "127.0.0.1:0"}},
        )
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        _, started = await iop_processes.edge(stack, tmp_path / "edge.yaml")
        (tmp_path / "node.token").write_text(node_token)
        node = await spawn_iop(
            *("node", "run", "--edge", f"127.0.0.1:{started['hub_port']}", "--node-id"),
            *("node-1", "--token-file", str(tmp_path / "node.token"), "--log-level", "WARNING"),
            *iop_processes.tls.node_args(),
        )
        stack.push_async_callback(terminate, node)
        await iop_processes.wait_available(started["url"], ["gpu-1", "gpu-2"])
        admin = await stack.enter_async_context(httpx.AsyncClient(base_url=started["admin_url"]))
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=60))
        client = await stack.enter_async_context(
            openai.AsyncOpenAI(
                base_url=f"{started['url']}/v1", api_key=tokens["search-chat"], max_retries=0
            )
        )

        listed = {m.id: m.model_dump() for m in (await client.models.list()).data}
        assert listed["sql"]["parent"] == "m" and listed["chat"]["parent"] == "m"
        assert "parent" not in listed["m"]

        # Another client of gpu-1 (not through the Edge) runs a long request of `sql` there.
        first_chunk = asyncio.Event()

        async def hold() -> None:
            body = {"model": "sql", "prompt": "hold", "max_tokens": 2000, "stream": True}
            async with http.stream("POST", f"{upstreams[0].base_url}/completions", json=body):
                first_chunk.set()
                await asyncio.Event().wait()  # until cancelled

        holder = asyncio.create_task(hold())
        try:
            await asyncio.wait_for(first_chunk.wait(), 30)

            async def loaded_on_gpu_1() -> bool:
                status = (await admin.get("/status")).json()
                loads = {
                    p["provider_id"]: p["load"] for n in status["nodes"] for p in n["providers"]
                }
                server = loads["gpu-1"]["server"] or {}
                return "sql" in server.get("running_adapters", [])

            await until(loaded_on_gpu_1, timeout=20, what="gpu-1's report of sql running")

            for _ in range(6):
                answer = await client.completions.create(model="sql", prompt="q", max_tokens=2)
                assert answer.model == "sql"  # the server's name for it: the adapter's
            for _ in range(3):
                await client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
            stats = [(await http.get(f"http://{u.listen}/fake/stats")).json() for u in upstreams]
        finally:
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holder
    # gpu-1 had sql loaded: every sql request went there (with the holder: 7); chat went to
    # gpu-2, whose slot was free. Round-robin would have sent half of each to the other server,
    # and every one of those would have waited there for a swap.
    assert [s["completions"] for s in stats] == [7, 3]
    assert [(s["adapter_loads"], s["adapter_swaps"]) for s in stats] == [(1, 0), (1, 0)]
