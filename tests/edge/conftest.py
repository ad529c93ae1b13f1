"""Shared fixtures of the Edge tests: small configs."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest

from iop.edgeconfig import EdgeConfig, load_data

TOKENS = {"search-chat": "sk-chat-secret", "search-batch": "sk-batch-secret"}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def provider(pid: str, **settings: Any) -> dict[str, Any]:
    return {
        "id": pid,
        "adapter": {"type": "fake"},
        "served_models": [f"{pid}-served"],
        "capacity": 4,
        "priority": 10,
        **settings,
    }


def make_config(
    providers: list[dict[str, Any]],
    models: Mapping[str, list[str]] | None = None,
    *,
    threshold: int = 1000,
    openai: Mapping[str, Any] | None = None,
    generation: Mapping[str, Mapping[str, Any]] | None = None,
) -> EdgeConfig:
    """A valid config with one node holding `providers`; `models` maps model id -> provider ids
    (default: one model "m" over every provider)."""
    models = models if models is not None else {"m": [p["id"] for p in providers]}
    served = {p["id"]: p["served_models"][0] for p in providers}
    data = {
        "edge": {"id": "edge-test", "listen": "127.0.0.1:0"},
        "openai": {
            "listen": "127.0.0.1:0",
            "long_context_threshold_tokens": threshold,
            "principal_tokens": [
                {
                    "token_ref": "search-chat",
                    "token_hash_sha256": sha(TOKENS["search-chat"]),
                    "principal_ref": "team-search",
                },
                {
                    "token_ref": "search-batch",
                    "token_hash_sha256": sha(TOKENS["search-batch"]),
                    "principal_ref": "team-search",
                },
            ],
            **(openai or {}),
        },
        "models": [
            {
                "id": model_id,
                "providers": {pid: served[pid] for pid in pids},
                "generation": dict((generation or {}).get(model_id, {})),
            }
            for model_id, pids in models.items()
        ],
        "nodes": [{"id": "node-1", "token_hash_sha256": "c" * 64, "providers": providers}],
    }
    return load_data(data)


@pytest.fixture(name="provider")
def provider_fixture() -> Callable[..., dict[str, Any]]:
    """`provider(id, **settings)`: a provider entry (fake adapter, capacity 4, priority 10)."""
    return provider


@pytest.fixture
def config_of() -> Callable[..., EdgeConfig]:
    """`config_of(providers, models, threshold=..., openai=..., generation=...)`."""
    return make_config


@pytest.fixture
def tokens() -> dict[str, str]:
    return dict(TOKENS)


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    """No asyncio task a test started may outlive it."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    leaked = [
        t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()
    ]
    assert not leaked, f"tasks leaked: {leaked}"
