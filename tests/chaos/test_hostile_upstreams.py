"""What a hostile upstream does with its heads and framings, against an Edge that runs its
providers itself (`placement: edge`, so a stall would be the Edge's own event loop): a 64 MiB
header, 100 MB of small headers and 2 million `100 Continue` heads are refused with a 502 that
names the bound while /healthz keeps answering; bytes sent on an idle pooled connection close
it, so the next request is served; a lone CR in a stream, a 301 with a JSON body and statuses
000 and 099 are upstream errors; a stream of comments alone ends after the read timeout.

Real processes: an Edge and the hostile upstream (`hostileupstream.py`, which answers as the
request's model says); the official `openai` client as the client. docs/reliability.md
("Hostile upstreams: heads, idle bytes, SSE") has the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml

from iop.processes import spawn_edge, terminate
from testkit import CLIENT_TOKEN

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

HOSTILE = Path(__file__).with_name("hostileupstream.py")
MODES = (
    "fair",
    "long-header",
    "many-headers",
    "continues",
    "idle-bytes",
    "cr",
    "redirect",
    "status-000",
    "status-099",
    "comments",
)
#: The placed providers' read timeout (what bounds the stream of comments).
READ_TIMEOUT_S = 2.0
MESSAGES: Any = [{"role": "user", "content": "hi"}]


@dataclass
class Stack:
    url: str
    upstream: asyncio.subprocess.Process

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=CLIENT_TOKEN, max_retries=0, timeout=60
        )

    async def upstream_says(self, line: dict[str, Any]) -> None:
        """Until the upstream prints `line`."""
        assert self.upstream.stdout is not None
        while orjson.loads(await self.upstream.stdout.readline()) != line:
            pass


@contextlib.asynccontextmanager
async def stack(document_of: Any, tmp_path: Path) -> AsyncIterator[Stack]:
    """The hostile upstream and an Edge over it with a placed provider per mode (model =
    mode)."""
    async with contextlib.AsyncExitStack() as exits:
        upstream = await asyncio.create_subprocess_exec(
            sys.executable, str(HOSTILE), stdout=asyncio.subprocess.PIPE
        )
        exits.push_async_callback(terminate, upstream)
        assert upstream.stdout is not None
        port = orjson.loads(await asyncio.wait_for(upstream.stdout.readline(), 60))["port"]
        adapter = {
            "type": "openai",
            "base_url": f"http://127.0.0.1:{port}/v1",
            "request_timeout_s": READ_TIMEOUT_S,
        }
        providers = [
            {
                "id": f"p-{mode}",
                "adapter": adapter,
                "served_models": [mode],
                "capacity": 4,
                "health": {"interval_ms": 0},
            }
            for mode in MODES
        ]
        document = document_of(
            providers,
            {mode: [f"p-{mode}"] for mode in MODES},
            placement="edge",
            edge={"tls": None},
            openai={"retries": {"max_per_request": 0}},
        )
        (tmp_path / "edge.yaml").write_text(yaml.safe_dump(document))
        edge, started = await spawn_edge(tmp_path / "edge.yaml")
        exits.push_async_callback(terminate, edge)
        async with httpx.AsyncClient(base_url=started["url"]) as http:
            for _ in range(600):
                if len((await http.get("/readyz")).json()["providers_available"]) == len(MODES):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the placed providers never became available")
        yield Stack(started["url"], upstream)


def error_of(refused: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(refused.value.response.content)["error"]
    return error


@pytest.mark.parametrize(
    ("mode", "bound"),
    [
        pytest.param("long-header", "larger than 65536 bytes", id="64MiB-header"),
        pytest.param("many-headers", "more than 100 headers", id="100MB-of-small-headers"),
        pytest.param("continues", "more than 10 interim (1xx)", id="2M-continues"),
    ],
)
async def test_a_head_past_its_bound_is_refused_and_the_edge_keeps_answering(
    document_of: Any, tmp_path: Path, mode: str, bound: str
) -> None:
    async with stack(document_of, tmp_path) as s, s.client() as client:
        healthz: list[int] = []
        done = asyncio.Event()

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as http:
                while not done.is_set():
                    healthz.append((await http.get("/healthz")).status_code)
                    await asyncio.sleep(0.02)

        prober = asyncio.create_task(probe())
        try:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model=mode, messages=MESSAGES)
        finally:
            done.set()
            await prober
        assert refused.value.status_code == 502
        assert bound in error_of(refused)["message"]
        assert healthz and set(healthz) == {200}
        # The provider still serves what is fair.
        answer = await client.chat.completions.create(model="fair", messages=MESSAGES)
        assert answer.choices[0].message.content == "fair"


async def test_bytes_on_an_idle_connection_close_it_and_the_next_request_is_served(
    document_of: Any, tmp_path: Path
) -> None:
    async with stack(document_of, tmp_path) as s, s.client() as client:
        first = await client.chat.completions.create(model="idle-bytes", messages=MESSAGES)
        assert first.choices[0].message.content == "fair"
        # The upstream then sent another head on the connection the Edge keeps in its pool.
        await asyncio.wait_for(s.upstream_says({"stray": "closed"}), 10)
        again = await client.chat.completions.create(model="idle-bytes", messages=MESSAGES)
        assert again.choices[0].message.content == "fair"


async def test_a_lone_cr_in_a_stream_never_reaches_the_client(
    document_of: Any, tmp_path: Path
) -> None:
    async with stack(document_of, tmp_path) as s:
        async with (
            httpx.AsyncClient(base_url=s.url, timeout=30) as http,
            http.stream(
                "POST",
                "/v1/chat/completions",
                headers={"authorization": f"Bearer {CLIENT_TOKEN}"},
                json={"model": "cr", "messages": MESSAGES, "stream": True},
            ) as response,
        ):
            received = b"".join([piece async for piece in response.aiter_raw()])
        assert response.status_code == 200  # the first event went out before the bad one
        # Nothing but data lines: no field slipped in after a CR.
        assert b"\r" not in received
        assert all(line.startswith(b"data: ") for line in received.split(b"\n") if line)
        assert b'"code":"upstream_error"' in received


@pytest.mark.parametrize("mode", ["redirect", "status-000", "status-099"])
async def test_a_redirect_or_a_status_under_100_is_an_upstream_error(
    document_of: Any, tmp_path: Path, mode: str
) -> None:
    async with stack(document_of, tmp_path) as s, s.client() as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model=mode, messages=MESSAGES)
        assert refused.value.status_code == 502
        message = error_of(refused)["message"]
        assert ("HTTP 301" if mode == "redirect" else f"status {mode[-3:]}") in message


async def test_a_stream_of_comments_alone_ends_after_the_read_timeout(
    document_of: Any, tmp_path: Path
) -> None:
    async with stack(document_of, tmp_path) as s, s.client() as client:

        async def read_it() -> None:
            stream = await client.chat.completions.create(
                model="comments", messages=MESSAGES, stream=True
            )
            async for _ in stream:
                pass

        with pytest.raises(openai.APIStatusError) as refused:
            await asyncio.wait_for(read_it(), READ_TIMEOUT_S + 20)
        assert refused.value.status_code == 504
        assert "only comments" in error_of(refused)["message"]
