"""Synthetic EdgeConfigs of a given size: N realistic nodes of four providers each.

What the size limits in docs/operator.md are measured with (`bench/edgeconfig_sizes.py`) and
what the end-to-end test of the largest EdgeConfig applies: every node has an alias, a token
hash, runtime metadata and four providers (vLLM, Ollama, llama.cpp, TGI, each an OpenAI-compatible
server on its own host), with every limit set; four models map every provider of their kind.
About 1.1 KiB of YAML per node, as a hand-written config would be.
"""

from __future__ import annotations

from typing import Any, Final

#: The four providers of each node: (suffix, port, served model name, model id).
KINDS: Final = (
    ("vllm", 8000, "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("ollama", 11434, "qwen2.5:14b-instruct", "qwen-2.5-14b"),
    ("llamacpp", 8080, "mistral-7b-instruct-v0.3.Q5_K_M", "mistral-7b"),
    ("tgi", 3000, "google/gemma-2-9b-it", "gemma-2-9b"),
)


def sized_spec(nodes: int, *, admin_listen: str = "0.0.0.0:9090") -> dict[str, Any]:
    """An EdgeConfig spec (camelCase, as `kubectl apply` users write it) with `nodes` nodes."""
    # Here, not at the top: `iop fake-upstream` imports this package and not the config model.
    from iop.edgeconfig import token_sha256

    node_list: list[dict[str, Any]] = []
    models: dict[str, dict[str, str]] = {model: {} for _, _, _, model in KINDS}
    for n in range(nodes):
        providers = []
        for slot, (kind, port, served, model) in enumerate(KINDS):
            pid = f"n{n:04d}-{kind}"
            models[model][pid] = served
            providers.append(
                {
                    "id": pid,
                    "adapter": {
                        "type": "openai",
                        "baseUrl": f"http://10.{n // 250}.{n % 250}.{10 + slot}:{port}/v1",
                        "apiKeyEnv": f"{kind.upper()}_API_KEY",
                    },
                    "servedModels": [served],
                    "capacity": 8,
                    "longContextSlots": 2,
                    "priority": 10 * slot,
                    "maxQueue": 64,
                    "queueTimeoutMs": 30000,
                }
            )
        node_list.append(
            {
                "id": f"node-{n:04d}",
                "alias": f"gpu-host-{n:04d}",
                "tokenHashSha256": token_sha256(f"node-{n}"),
                "runtime": {"concurrency": 16},
                "providers": providers,
            }
        )
    return {
        "edge": {
            "id": "edge-large",
            "admin": {"listen": admin_listen, "tokenFile": "/etc/iop/admin/token"},
        },
        "openai": {"longContextThresholdTokens": 32000},
        "models": [
            {"id": model, "providers": providers, "generation": {"maxTokens": 4096}}
            for model, providers in models.items()
            if providers
        ],
        "nodes": node_list,
    }
