from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

HASH_A = "a" * 64
HASH_B = "b" * 64
HASH_C = "c" * 64

BASE: dict[str, Any] = {
    "edge": {"id": "edge-a", "listen": "0.0.0.0:7443", "admin": {"listen": "127.0.0.1:9090"}},
    "openai": {
        "listen": "0.0.0.0:8080",
        "long_context_threshold_tokens": 1000,
        "principal_tokens": [
            {"token_ref": "app-1", "token_hash_sha256": HASH_A, "principal_ref": "team-a"},
            {"token_ref": "app-2", "token_hash_sha256": HASH_B, "principal_ref": "team-a"},
        ],
    },
    "models": [
        {
            "id": "llama",
            "providers": {"vllm-a": "meta/llama", "ollama-b": "llama3"},
            "generation": {"max_tokens": 512, "temperature": 0.7},
        },
        {"id": "echo", "providers": {"fake-c": "echo"}},
    ],
    "nodes": [
        {
            "id": "node-1",
            "alias": "gpu-1",
            "token_hash_sha256": HASH_C,
            "providers": [
                {
                    "id": "vllm-a",
                    "adapter": {"type": "openai", "base_url": "http://127.0.0.1:8000/v1"},
                    "served_models": ["meta/llama"],
                    "capacity": 4,
                    "long_context_slots": 1,
                    "priority": 10,
                },
                {
                    "id": "ollama-b",
                    "adapter": {"type": "openai", "base_url": "http://127.0.0.1:11434/v1"},
                    "served_models": ["llama3", "mistral"],
                    "capacity": 2,
                    "long_context_slots": 0,
                    "priority": 20,
                },
            ],
        },
        {
            "id": "node-2",
            "token_hash_sha256": "d" * 64,
            "providers": [
                {
                    "id": "fake-c",
                    "adapter": {"type": "fake"},
                    "served_models": ["echo"],
                    "capacity": 8,
                }
            ],
        },
    ],
}


def make_config(mutate: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:
    """A fresh copy of a small valid config document, optionally changed by `mutate`."""
    data = copy.deepcopy(BASE)
    if mutate is not None:
        mutate(data)
    return data


@pytest.fixture
def config_data() -> dict[str, Any]:
    return make_config()


@pytest.fixture
def build() -> Callable[..., dict[str, Any]]:
    """`build(mutate)`: a fresh valid document changed by `mutate`."""
    return make_config
