"""The upstream policy, through real processes: a config cannot send a provider's key to another
host, nor reach an address the policy denies, on a Node or on the Edge (a node placed there).

The attack of issue 34: whoever edits the config adds a provider that names another provider's
key variable (`VLLM_A_KEY`) with a `base_url` of a server they control, and one that points at
an internal service. The Node (`iop node run`) and the Edge (`iop edge run`) are given the policy
as the chart gives it (`IOP_UPSTREAM_POLICY`) and the key in their environment; every server is
a fake upstream on loopback that counts the SHA-256 of each bearer token it is sent.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
import pytest_asyncio
import yaml

from iop.fakes import FakeUpstream, FakeUpstreamSettings
from testkit import CLIENT_TOKEN, node_token_of, provider
from tests.waiting import wait_until

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

KEY = "sk-vllm-a-0123456789abcdef0123456789"  # the Secret the editor cannot read
KEY_SHA256 = hashlib.sha256(KEY.encode()).hexdigest()
#: The model servers the policy allows live on 127.0.0.2; the internal service on 127.0.0.1,
#: which the built-in loopback denial covers (the tests' stand-in for an Edge's admin API).
ALLOWED_HOST = "127.0.0.2"


@dataclass
class Stack:
    url: str
    admin_url: str
    home: FakeUpstream  # vllm-a's server: the key's one host
    thief: FakeUpstream  # the editor's server
    internal: FakeUpstream  # what no provider may reach

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=CLIENT_TOKEN, max_retries=0, timeout=30
        )


def openai_provider(pid: str, base_url: str, *, key: bool, probed: bool = True) -> dict[str, Any]:
    adapter: dict[str, Any] = {"type": "openai", "base_url": base_url}
    if key:
        adapter["api_key_env"] = "VLLM_A_KEY"
    health = {} if probed else {"health": {"interval_ms": 0}}
    # A request for a provider that is out of dispatch waits for it this long, then gets 503.
    return provider(pid, adapter, served="served", capacity=4, queue_timeout_ms=1000, **health)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(
    tmp_path_factory: pytest.TempPathFactory,
    iop_processes: Any,
    document_of: Callable[..., dict[str, Any]],
) -> AsyncIterator[Stack]:
    folder = tmp_path_factory.mktemp("policy")
    settings = FakeUpstreamSettings(models=("served",))
    async with contextlib.AsyncExitStack() as stack:
        home = await stack.enter_async_context(FakeUpstream(settings, host=ALLOWED_HOST, port=0))
        thief = await stack.enter_async_context(FakeUpstream(settings, host=ALLOWED_HOST, port=0))
        internal = await stack.enter_async_context(FakeUpstream(settings, host="127.0.0.1", port=0))
        internal_by_name = f"http://localhost:{internal.port}/v1"
        on_node = [
            openai_provider("vllm-a", home.base_url, key=True),
            # The key named for another host: the key binding refuses it.
            openai_provider("stolen", thief.base_url, key=True),
            # A name the policy lists, resolving to loopback: refused when dialled (no probe,
            # so that dispatch tries it).
            openai_provider("snoop", internal_by_name, key=False, probed=False),
        ]
        on_edge = [
            openai_provider("placed-a", home.base_url, key=True),
            openai_provider("placed-stolen", thief.base_url, key=True),
        ]
        models = {
            "a": ["vllm-a"],
            "stolen": ["stolen"],
            "snoop": ["snoop"],
            "placed-a": ["placed-a"],
            "placed-stolen": ["placed-stolen"],
        }
        document = document_of(
            nodes={"node-1": on_node, "node-placed": on_edge},
            models=models,
            admin=True,
        )
        placed = document["nodes"][1]
        placed.pop("token_hash_sha256")
        placed["placement"] = "edge"
        config = folder / "edge.yaml"
        config.write_text(yaml.safe_dump(document))
        token = folder / "node.token"
        token.write_text(node_token_of("node-1"))
        policy = {
            "allow": [f"{ALLOWED_HOST}/32", "localhost"],
            "keys": [
                {
                    "env": "VLLM_A_KEY",
                    "hosts": [f"{ALLOWED_HOST}:{home.port}"],
                    "providers": ["vllm-a", "placed-a"],
                }
            ],
        }
        env = {"VLLM_A_KEY": KEY, "IOP_UPSTREAM_POLICY": orjson.dumps(policy).decode()}
        _, started = await iop_processes.edge(stack, config, env=env)
        await iop_processes.node(stack, started["hub_port"], "node-1", token, env=env)
        # Those the policy allows are up (the others never come up: the tests say why).
        async with httpx.AsyncClient(base_url=started["url"]) as http:

            async def up() -> bool:
                ready = (await http.get("/readyz")).json()
                return {"placed-a", "snoop", "vllm-a"} <= set(ready["providers_available"])

            await wait_until(up, 20, 0.05, what="the allowed providers")
        yield Stack(started["url"], started["admin_url"], home, thief, internal)


async def test_the_key_goes_to_its_own_host_only(stack: Stack) -> None:
    """Before: the Node and the Edge sent `Authorization: Bearer <KEY>` to the thief's server
    (its probes and every request), and the thief's error body came back to the client."""
    async with stack.client() as api:
        for model in ("a", "placed-a"):
            reply = await api.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
            assert reply.choices[0].message.content
        for model in ("stolen", "placed-stolen"):
            with pytest.raises(openai.APIStatusError) as caught:
                await api.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}]
                )
            assert caught.value.status_code == 503
    assert stack.home.stats.bearer_sha256.get(KEY_SHA256, 0) >= 2
    # Never dialled: not a request, not a probe, so no key either.
    assert stack.thief.stats.requests == 0
    assert stack.thief.stats.connections == 0


async def test_a_refused_provider_says_why_in_the_edge_s_status(stack: Stack) -> None:
    """The provider's health names the binding (the admin API's `GET /status`), never the key."""
    async with httpx.AsyncClient(timeout=10) as http:
        ready = (await http.get(f"{stack.url}/readyz")).json()
        status = (await http.get(f"{stack.admin_url}/status")).json()
    assert KEY not in orjson.dumps([ready, status]).decode()
    health = {p["provider_id"]: p for n in status["nodes"] for p in n["providers"]}
    for pid in ("stolen", "placed-stolen"):
        assert ready["providers"][pid] == {"healthy": False, "reason": "adapter_error"}
        assert "the key in VLLM_A_KEY may go only to hosts" in health[pid]["detail"], health[pid]


async def test_an_internal_address_is_refused_when_it_is_dialled(stack: Stack) -> None:
    """`localhost` is a name the policy lists, but it resolves to loopback, which only a CIDR
    of `allow` could let in: the connection is never made. Before: the request reached the
    internal service and its answer came back to the client."""
    async with stack.client() as api:
        with pytest.raises(openai.APIStatusError) as caught:
            await api.chat.completions.create(
                model="snoop", messages=[{"role": "user", "content": "hi"}]
            )
    assert caught.value.status_code in (502, 503)
    assert "the upstream policy denies" in caught.value.message
    assert stack.internal.stats.connections == 0
