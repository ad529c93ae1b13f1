"""`iop up`: the local stack from the sample config, as a user runs it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import yaml

from iop.cli.up_commands import LOCAL_TOKEN_REF, local_config
from iop.edgeconfig import OpenAIAdapterSettings, load_data, load_file, token_sha256
from iop.processes import iop_command, terminate
from testkit.otlp import OtlpReceiver, ReceivedSpan

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "configs" / "edge.yaml"


@contextlib.asynccontextmanager
async def iop_up(
    *args: str, env: dict[str, str] | None = None, **options: Any
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`iop up --json ARGS` in a session of its own (`env`: variables on top of the tests'):
    however the test ends (a timeout kills `iop up` before it stopped its children), nothing it
    started outlives the test."""
    process = await asyncio.create_subprocess_exec(
        *iop_command(),
        "up",
        "--json",
        *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
        **options,
    )
    try:
        yield process
    finally:
        await terminate(process)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


async def up_line(process: asyncio.subprocess.Process) -> dict[str, Any]:
    """The JSON line `iop up --json` prints once serving."""
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 60)
    assert line, f"iop up exited with {await process.wait()}"
    up: dict[str, Any] = orjson.loads(line)
    return up


def client_of(up: dict[str, Any]) -> openai.AsyncOpenAI:
    """The official client, for the stack `iop up` printed."""
    return openai.AsyncOpenAI(
        base_url=up["base_url"], api_key=up["api_key"], max_retries=0, timeout=30
    )


def test_the_local_config_keeps_the_pool_and_swaps_what_is_not_local() -> None:
    original = load_file(SAMPLE)
    local = local_config(original, "http://127.0.0.1:9999/v1", port=8123)
    config = local.config
    assert config.models == original.models
    assert config.openai.listen == "127.0.0.1:8123"
    assert config.edge.listen == "127.0.0.1:0"
    for node, before in zip(config.nodes, original.nodes, strict=True):
        token = local.node_tokens[node.id]
        assert node.token_hash_sha256 == token_sha256(token)
        for provider, old in zip(node.providers, before.providers, strict=True):
            assert (provider.capacity, provider.priority, provider.max_queue) == (
                old.capacity,
                old.priority,
                old.max_queue,
            )
            if isinstance(old.adapter, OpenAIAdapterSettings):
                assert provider.adapter == OpenAIAdapterSettings(
                    base_url="http://127.0.0.1:9999/v1"
                )
            else:
                assert provider.adapter == old.adapter
    refs = [t.token_ref for t in config.openai.principal_tokens]
    assert refs == [*(t.token_ref for t in original.openai.principal_tokens), LOCAL_TOKEN_REF]
    assert config.openai.principal_tokens[-1].token_hash_sha256 == (token_sha256(local.api_key))


def test_a_node_placed_on_the_edge_gets_no_token_and_no_node() -> None:
    document = load_file(SAMPLE).model_dump(mode="json", exclude_none=True)
    placed = document["nodes"][0]
    placed.pop("token_hash_sha256", None)
    placed["placement"] = "edge"
    local = local_config(load_data(document), "http://127.0.0.1:9999/v1", port=8123)
    assert placed["id"] not in local.node_tokens
    assert set(local.node_tokens) == {n["id"] for n in document["nodes"][1:]}
    assert local.config.nodes[0].on_edge and local.config.nodes[0].token_hash_sha256 is None


async def test_iop_up_serves_the_sample_config_until_interrupted() -> None:
    async with iop_up("--config", str(SAMPLE)) as process:
        up = await up_line(process)
        async with client_of(up) as client:
            assert [m.id for m in (await client.models.list()).data] == up["models"]
            for model in ("demo-echo", "llama-3.1-8b"):  # the fake adapter; the fake upstream
                reply = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hello!"}]
                )
                assert reply.choices[0].message.content
                # The Responses API, and a continuation on the server that holds the first.
                first = await client.responses.create(model=model, input="Hello!")
                second = await client.responses.create(
                    model=model, input="And then?", previous_response_id=first.id
                )
                assert second.previous_response_id == first.id and second.output_text
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        for pid in up["pids"].values():  # every process it started has ended
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            raise AssertionError(f"process {pid} outlived iop up")


async def test_iop_up_applies_the_edited_config_on_sighup(tmp_path: Path) -> None:
    config = tmp_path / "edge.yaml"
    config.write_text(SAMPLE.read_text())
    async with iop_up("--config", str(config), stderr=asyncio.subprocess.PIPE) as process:
        assert process.stderr is not None
        up = await up_line(process)
        async with httpx.AsyncClient(base_url=up["admin_url"]) as admin:
            before = (await admin.get("/config")).json()
            edited = yaml.safe_load(config.read_text())
            edited["models"][0]["generation"]["max_tokens"] = 3
            config.write_text(yaml.safe_dump(edited))
            process.send_signal(signal.SIGHUP)
            said = b""
            while b"iop up: reload" not in said:  # the children log to the same stderr
                said = await asyncio.wait_for(process.stderr.readline(), 30)
                assert said, "iop up closed its stderr"
            assert b"applied generation 2" in said, said
            after = (await admin.get("/config")).json()
        assert after["generation"] == before["generation"] + 1
        assert after["config"]["models"][0]["generation"]["max_tokens"] == 3
        assert after["config"]["nodes"] == before["config"]["nodes"]  # same tokens, same nodes
        process.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(process.wait(), 30) == 0


async def test_iop_up_traces_when_an_otlp_endpoint_is_set() -> None:
    """The standard variables reach every process `iop up` starts: a request's trace has the
    Edge's spans and the Node's, in one trace."""
    async with OtlpReceiver() as receiver:
        async with iop_up("--config", str(SAMPLE), env=receiver.environment()) as process:
            async with client_of(await up_line(process)) as client:
                await client.chat.completions.create(
                    model="llama-3.1-8b", messages=[{"role": "user", "content": "Hello!"}]
                )

            def traced(spans: list[ReceivedSpan]) -> bool:
                """The request's span has arrived, and a Node's span of its trace."""
                ids = {s.trace_id for s in spans if s.name == "chat llama-3.1-8b"}
                return any(s.service == "iop-node" and s.trace_id in ids for s in spans)

            spans = await receiver.wait_until(traced)
    request = next(s for s in spans if s.name == "chat llama-3.1-8b")
    trace = [s for s in spans if s.trace_id == request.trace_id]
    assert {s.service for s in trace} == {"iop-edge", "iop-node"}
    run = next(s for s in trace if s.name == "iop.run")
    (node,) = [s for s in trace if s.parent_span_id == run.span_id]
    assert node.service == "iop-node" and node.kind == "client"


async def test_iop_up_serves_a_lora_adapter_of_its_config(tmp_path: Path) -> None:
    config = tmp_path / "edge.yaml"
    document = yaml.safe_load(SAMPLE.read_text())
    llama = next(m for m in document["models"] if m["id"] == "llama-3.1-8b")
    llama["adapters"] = ["sql-lora"]
    config.write_text(yaml.safe_dump(document))
    async with iop_up("--config", str(config)) as process:
        async with client_of(await up_line(process)) as client:
            listed = {m.id: m for m in (await client.models.list()).data}
            assert (listed["sql-lora"].model_extra or {})["parent"] == "llama-3.1-8b"
            reply = await client.chat.completions.create(
                model="sql-lora", messages=[{"role": "user", "content": "Hello!"}]
            )
            assert reply.model == "sql-lora" and reply.choices[0].message.content
