"""Priority classes with real processes: `iop edge run` with a node placed on the Edge in front of
a real `iop fake-upstream`, one slot, driven by the official openai client. Each rule of
docs/edge.md, "Priority classes": the order, displacement from a full queue, shedding at
saturation, the class's and the request's wait bounds, a class a principal may not take, and a
live change of the classes under load that loses no request.

A request holds the one slot as long as the upstream takes to answer it (`fake_upstream`'s
`latency_ms`, per request); the tests queue requests behind it one by one, each after the Edge's
`GET /status` shows the one before it waiting, so the queue's order is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from iop.processes import spawn_fake_upstream
from testkit import Client, node_token_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

#: How long the request that holds the slot runs: the time the tests have to queue the others.
HOLD_MS = 4000
PRINCIPALS = ("chat", "web", "evals", "locked")
CLASSES = [
    {"name": "interactive", "priority": 10},
    {"name": "standard", "priority": 0},
    {"name": "batch", "priority": -1},
]


def priority_section(**changes: Any) -> dict[str, Any]:
    return {
        "classes": CLASSES,
        "default_class": "standard",
        "saturation": {"queue_depth": 1},
        "principals": [
            {"principal_ref": "chat", "priority_class": "interactive"},
            {"principal_ref": "evals", "priority_class": "batch"},
            {"principal_ref": "locked", "priority_class": "standard", "lower_per_request": False},
        ],
        **changes,
    }


@dataclass
class Edge:
    url: str
    admin: httpx.AsyncClient
    document: dict[str, Any]

    def client(self, principal: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=f"sk-{principal}", max_retries=0, timeout=60
        )

    async def waiting(self) -> int:
        status = (await self.admin.get("/status")).json()
        return int(status["dispatch"]["m"]["waiting"])

    async def status(self) -> dict[str, Any]:
        answer: dict[str, Any] = (await self.admin.get("/status")).json()
        return answer


@contextlib.asynccontextmanager
async def edge(
    document_of: Any, processes: Any, folder: Path, *, max_queue: int = 64, **priority: Any
) -> AsyncIterator[Edge]:
    async with contextlib.AsyncExitStack() as stack:
        upstream = await stack.enter_async_context(spawn_fake_upstream())
        provider = {
            "id": "p1",
            "adapter": {"type": "openai", "base_url": upstream.base_url},
            "served_models": ["served"],
            "capacity": 1,
            "max_queue": max_queue,
        }
        document: dict[str, Any] = document_of(
            [provider],
            edge={"admin": {"listen": "127.0.0.1:0"}},
            placement="edge",
            clients=[Client(f"app-{name}", f"sk-{name}", name) for name in PRINCIPALS],
            openai={"priority": priority_section(**priority)},
        )
        (folder / "edge.yaml").write_text(yaml.safe_dump(document))
        _, started = await processes.edge(stack, folder / "edge.yaml")
        await processes.wait_available(started["url"], ["p1"])
        admin = await stack.enter_async_context(httpx.AsyncClient(base_url=started["admin_url"]))
        yield Edge(started["url"], admin, document)


async def chat(
    client: openai.AsyncOpenAI,
    latency_ms: int = 0,
    headers: dict[str, str] | None = None,
    extra: str = "",
) -> str:
    answer = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": f"hi{extra}"}],
        max_tokens=2,
        extra_body={"fake_upstream": {"latency_ms": latency_ms}},
        extra_headers=headers,
    )
    return answer.id


class Line:
    """Requests sent one by one, each after the one before it is seen waiting; `ended` records
    the order they finished in (one slot: the order they were served in)."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.ended: list[str] = []
        self.tasks: list[asyncio.Task[Any]] = []

    async def hold(self, until: Any) -> None:
        """A request of `web` takes the one slot for HOLD_MS."""
        await self.send("holder", "web", HOLD_MS, waiting=0)
        await until(lambda: self._running(), timeout=10)

    async def _running(self) -> bool:
        status = await self.edge.status()
        return any(
            provider["load"]["edge_in_flight"] == 1
            for node in status["nodes"]
            for provider in node["providers"]
        )

    async def send(
        self,
        label: str,
        principal: str,
        latency_ms: int = 0,
        headers: dict[str, str] | None = None,
        waiting: int | None = None,
    ) -> asyncio.Task[Any]:
        """Send one request; with `waiting`, return once the queue holds that many."""
        client = self.edge.client(principal)

        async def run() -> None:
            try:
                await chat(client, latency_ms, headers)
                self.ended.append(label)
            finally:
                await client.close()

        task = asyncio.create_task(run(), name=label)
        self.tasks.append(task)
        if waiting:
            while await self.edge.waiting() < waiting and not task.done():
                await asyncio.sleep(0.01)
        return task


async def test_a_higher_class_is_served_first_and_a_lower_request_cannot_raise_its_own(
    document_of, iop_processes, tmp_path, until
) -> None:
    async with edge(document_of, iop_processes, tmp_path) as running:
        line = Line(running)
        await line.hold(until)
        await line.send("web-0", "web", waiting=1)
        await line.send("evals-lowered-web", "web", headers={"x-iop-priority-class": "batch"})
        # A sheddable request is shed, not queued: the queue still holds one.
        with pytest.raises(openai.RateLimitError):
            await line.tasks[-1]
        await line.send("locked-0", "locked", waiting=2)
        await line.send("chat-0", "chat", waiting=3)
        await line.send("chat-1", "chat", waiting=4)
        # A principal may not raise a request above its class, and one that may not choose
        # may not lower either: refused and named, before any queue.
        async with running.client("web") as web, running.client("locked") as locked:
            with pytest.raises(openai.PermissionDeniedError) as raised:
                await chat(web, headers={"x-iop-priority-class": "interactive"})
            with pytest.raises(openai.PermissionDeniedError) as fixed:
                await chat(locked, headers={"x-iop-priority-class": "batch"})
            with pytest.raises(openai.BadRequestError) as unknown:
                await chat(web, headers={"x-iop-priority-class": "urgent"})
        await asyncio.gather(*line.tasks[:1], *line.tasks[3:])
        status = await running.status()
    assert line.ended == ["holder", "chat-0", "chat-1", "web-0", "locked-0"]
    assert raised.value.code == "priority_class_not_allowed"
    assert "may only lower" in raised.value.message
    assert "lower_per_request" in fixed.value.message
    assert "unknown priority class" in unknown.value.message
    classes = status["priority_classes"]
    assert classes["interactive"]["admitted"] == 2 and classes["interactive"]["queued"] == 2
    # Both waited behind the holder, and were given their slot: their waits are counted.
    assert classes["interactive"]["waited"] == 2 and classes["interactive"]["waited_ms_total"] > 0
    assert classes["batch"]["shed"] == {"saturated": 1}


async def test_a_full_queue_displaces_the_latest_lowest_request_and_sheds_batch_at_once(
    document_of, iop_processes, tmp_path, until
) -> None:
    async with edge(document_of, iop_processes, tmp_path, max_queue=2) as running:
        line = Line(running)
        await line.hold(until)
        first = await line.send("web-0", "web", waiting=1)
        latest = await line.send("web-1", "web", waiting=2)
        async with running.client("evals") as evals:
            started = time.perf_counter()
            with pytest.raises(openai.RateLimitError) as shed:
                await chat(evals)
            shed_after = time.perf_counter() - started
        await line.send("chat-0", "chat")
        with pytest.raises(openai.InternalServerError) as displaced:
            await latest
        await asyncio.gather(first, line.tasks[0], line.tasks[-1])
    assert shed.value.status_code == 429 and shed.value.code == "model_saturated"
    assert int(shed.value.response.headers["retry-after"]) >= 1
    assert int(shed.value.response.headers["retry-after-ms"]) > 0
    assert shed_after < 2.0, "a shed request is answered at admission, not after a wait"
    assert displaced.value.status_code == 503 and displaced.value.code == "displaced"
    assert "retry-after" in displaced.value.response.headers
    assert line.ended == ["holder", "chat-0", "web-0"]


async def test_a_shed_request_that_comes_back_when_told_is_queued_though_still_saturated(
    document_of, iop_processes, tmp_path, until
) -> None:
    """The official client honours a 429's `retry-after-ms` and sends the same request again:
    the model is still saturated then (the holder runs on, a request waits), and the request
    takes a place in the queue, behind the higher class, instead of a second 429."""
    async with edge(document_of, iop_processes, tmp_path) as running:
        line = Line(running)
        await line.hold(until)
        waiting = await line.send("web-0", "web", waiting=1)
        honouring = openai.AsyncOpenAI(
            base_url=f"{running.url}/v1", api_key="sk-evals", max_retries=1, timeout=60
        )
        async with honouring:
            done = asyncio.ensure_future(chat(honouring))
            await until(lambda: class_count(running, "batch", "shed"), timeout=10)
            await until(lambda: class_count(running, "batch", "queued"), timeout=10)
            assert not line.tasks[0].done(), "it came back while the model was still saturated"
            answer = await done
            await asyncio.gather(waiting, line.tasks[0])
        classes = (await running.status())["priority_classes"]
        # An impatient copy of it, never told anything, is still shed at once.
        async with running.client("evals") as evals:
            await line.hold(until)
            await line.send("web-1", "web", waiting=1)
            with pytest.raises(openai.RateLimitError):
                await chat(evals, extra="never told")
            await asyncio.gather(*line.tasks[2:])
    assert answer
    assert classes["batch"]["shed"] == {"saturated": 1}
    assert classes["batch"]["came_back"] == 1
    assert classes["batch"]["admitted"] == 1 and classes["batch"]["queued"] == 1
    assert line.ended[:2] == ["holder", "web-0"]


async def class_count(running: Edge, name: str, key: str) -> bool:
    """Whether class `name`'s count `key` in `GET /status` is above 0."""
    return bool((await running.status())["priority_classes"][name][key])


@pytest.mark.parametrize(
    ("classes", "headers", "says"),
    [
        pytest.param(
            [{**CLASSES[1], "max_queue_wait_ms": 300}],
            None,
            "class `standard`'s max_queue_wait_ms (300)",
            id="class",
        ),
        pytest.param(
            [CLASSES[1]],
            {"x-iop-max-queue-wait-ms": "300"},
            "the request's x-iop-max-queue-wait-ms (300)",
            id="request",
        ),
    ],
)
async def test_a_request_past_its_wait_bound_gets_504_before_reaching_a_server(
    document_of, iop_processes, tmp_path, until, classes, headers, says
) -> None:
    section = {"classes": classes, "principals": []}
    async with edge(document_of, iop_processes, tmp_path, **section) as running:
        line = Line(running)
        await line.hold(until)
        async with running.client("web") as web:
            with pytest.raises(openai.InternalServerError) as ended:
                await chat(web, headers=headers)
        await line.tasks[0]
        stats = (await running.status())["priority_classes"]["standard"]
    assert ended.value.status_code == 504
    assert ended.value.code == "queue_wait_exceeded"
    assert says in ended.value.message
    assert stats["admitted"] == 1  # the holder alone reached the server
    assert sum(stats["shed"].values()) == 1


async def test_a_live_change_of_classes_under_load_loses_no_request(
    document_of, iop_processes, tmp_path, until
) -> None:
    async with edge(document_of, iop_processes, tmp_path) as running:
        statuses: list[int] = []
        stop = asyncio.Event()

        async def worker(principal: str) -> None:
            async with running.client(principal) as client:
                while not stop.is_set():
                    try:
                        await chat(client, latency_ms=5)
                        statuses.append(200)
                    except openai.APIStatusError as error:
                        statuses.append(error.status_code)

        workers = [asyncio.create_task(worker(p)) for p in ("chat", "web", "web", "locked")]
        changes = [
            priority_section(
                principals=[{"principal_ref": "web", "priority_class": "interactive"}]
            ),
            priority_section(classes=[*CLASSES, {"name": "gold", "priority": 50}]),
            {},
            priority_section(),
        ]
        document = running.document
        for change in changes:
            served = len(statuses)
            await until(lambda served=served: len(statuses) >= served + 10, timeout=30)
            document = {**document, "openai": {**document["openai"], "priority": change}}
            answer = await running.admin.post(
                "/refresh", json={"mode": "apply", "config": document}
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["outcome"] == "applied"
        served = len(statuses)
        await until(lambda: len(statuses) >= served + 10, timeout=30)
        stop.set()
        await asyncio.gather(*workers)
    assert statuses and set(statuses) == {200}


async def test_a_sheddable_request_is_refused_at_once_when_every_server_has_a_queue(
    document_of, iop_processes, tmp_path, until
) -> None:
    """Saturation as the model server says it, through a real Node: the simulated GPU server's
    `vllm:num_requests_waiting`, which the Node reads after each probe and reports on its link.
    The Edge's own queue is empty all along: its four slots are above the server's batch of
    one, so the server queues what it cannot run."""
    probes = {"interval_ms": 200, "timeout_ms": 1000}
    async with contextlib.AsyncExitStack() as stack:
        gpu = ["--gpu", "--gpu-max-batch", "1", "--gpu-step-ms", "100"]
        upstream = await stack.enter_async_context(spawn_fake_upstream(gpu))
        provider = {
            "id": "p1",
            "adapter": {"type": "openai", "base_url": upstream.base_url},
            "served_models": ["served"],
            "capacity": 4,
            "health": probes,
        }
        document = document_of(
            [provider],
            edge={"admin": {"listen": "127.0.0.1:0"}},
            placement="node",
            clients=[Client(f"app-{name}", f"sk-{name}", name) for name in PRINCIPALS],
            openai={"priority": priority_section()},  # server_waiting: 1, the default
        )
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        (tmp_path / "node.token").write_text(node_token_of("node-1"))
        _, started = await iop_processes.edge(stack, tmp_path / "edge.yaml")
        await iop_processes.node(stack, started["hub_port"], "node-1", tmp_path / "node.token")
        await iop_processes.wait_available(started["url"], ["p1"])
        admin = await stack.enter_async_context(httpx.AsyncClient(base_url=started["admin_url"]))
        running = Edge(started["url"], admin, document)

        async def long_chat(principal: str) -> None:
            async with running.client(principal) as client:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=20
                )

        # Three standard requests: one runs on the server, two wait in its own queue.
        holders = [asyncio.create_task(long_chat("web")) for _ in range(3)]

        async def saturated() -> bool:
            status = await running.status()
            return bool(status["dispatch"]["m"]["saturated"])

        await until(saturated, timeout=20)
        assert await running.waiting() == 0  # nothing waits at the Edge: the server's queue
        async with running.client("evals") as evals:
            with pytest.raises(openai.RateLimitError) as shed:
                await chat(evals)
        await asyncio.gather(*holders)  # the standard requests are all served

    assert shed.value.code == "model_saturated"
    assert int(shed.value.response.headers["retry-after"]) >= 1
    assert "retry-after-ms" in shed.value.response.headers
