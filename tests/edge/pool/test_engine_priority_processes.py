"""The class's priority sent to a server that schedules by it (`providers[].engine_priority`),
with real processes: `iop edge run` with a node placed on the Edge in front of `iop fake-upstream
--gpu --gpu-scheduling-policy priority` (a batch of one), driven by the official openai client.

The Edge has room for two runs, the server's batch for one: a standard request runs, an
interactive one arrives. With the class sent as vLLM's `priority`, the server preempts the
standard request and answers the interactive one first; without it, first come first served.
A client's own `priority` in its body never reaches a server the Edge sends the class to.
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

from iop.processes import spawn_fake_upstream
from testkit import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

GPU = ("--gpu", "--gpu-step-ms", "50", "--gpu-step-ms-per-seq", "0", "--gpu-max-batch", "1")


def metric(text: str, name: str) -> float:
    (line,) = (line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize(
    ("engine_priority", "order", "preemptions"),
    [
        pytest.param(True, ["interactive", "standard"], 1, id="class-sent"),
        pytest.param(False, ["standard", "interactive"], 0, id="first-come-first-served"),
    ],
)
async def test_an_interactive_request_preempts_a_standard_one_on_a_server_that_schedules_by_it(
    document_of: Any,
    iop_processes: Any,
    tmp_path: Path,
    engine_priority: bool,
    order: list[str],
    preemptions: int,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        upstream = await stack.enter_async_context(
            spawn_fake_upstream([*GPU, "--gpu-scheduling-policy", "priority"])
        )
        provider = {
            "id": "p1",
            "adapter": {"type": "openai", "base_url": upstream.base_url},
            "served_models": ["served"],
            "capacity": 2,
            "engine_priority": engine_priority,
        }
        priority = {
            "classes": [
                {"name": "interactive", "priority": 10},
                {"name": "standard", "priority": 0},
            ],
            "default_class": "standard",
            "principals": [{"principal_ref": "chat", "priority_class": "interactive"}],
        }
        document = document_of(
            [provider],
            placement="edge",
            clients=[Client(f"app-{name}", f"sk-{name}", name) for name in ("chat", "evals")],
            openai={"priority": priority},
        )
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        _, started = await iop_processes.edge(stack, tmp_path / "edge.yaml")
        await iop_processes.wait_available(started["url"], ["p1"])
        metrics = await stack.enter_async_context(
            httpx.AsyncClient(base_url=f"http://{upstream.listen}")
        )
        finished: list[str] = []

        async def chat(principal: str, name: str, tokens: int, **body: Any) -> None:
            async with openai.AsyncOpenAI(
                base_url=f"{started['url']}/v1", api_key=f"sk-{principal}", max_retries=0
            ) as client:
                await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": name}],
                    max_tokens=tokens,
                    extra_body=body,
                )
            finished.append(name)

        # 40 tokens at 50 ms a step: two seconds on the server's one place. Its client asks for
        # the first place in any queue: the Edge sends its class's instead.
        standard = asyncio.ensure_future(chat("evals", "standard", 40, priority=-100))
        for _ in range(200):
            running = metric((await metrics.get("/metrics")).text, "vllm:num_requests_running")
            if running == 1:
                break
            await asyncio.sleep(0.01)
        await chat("chat", "interactive", 2)
        await standard
        assert finished == order
        text = (await metrics.get("/metrics")).text
        assert metric(text, "vllm:num_preemptions_total") == preemptions
