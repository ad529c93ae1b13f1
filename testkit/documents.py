"""Edge config documents for tests and benchmarks: one builder instead of a hand-written copy each.

`edge_document` writes a valid EdgeConfig document (plain data, for `load_data`, a YAML file or
the admin API's /refresh) from what a caller cares about, its nodes, providers and models; the
rest is what a test or a benchmark on one machine wants: every listener on loopback port 0, the
clients of `CLIENTS`, each node's token `node_token_of(id)`. Options add TLS, placement on the
Edge, the admin and metrics listeners, limits and any other `edge` or `openai` setting.

It imports `iop` for `token_sha256` alone, which every version has: a benchmark's baseline run
(another checkout's `iop`, this checkout's benchmark: bench/benchkit.py) imports it too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from iop.edgeconfig import token_sha256

#: An EdgeConfig document: what a config file holds, as plain data.
Document = dict[str, Any]
#: Where a document's nodes run: in Node processes that dial the Edge (each with its token), or
#: on the Edge itself (`placement: edge`: no token, no Node process).
Placement = Literal["node", "edge"]

_LOOPBACK = "127.0.0.1:0"  # never a fixed port: test runs and benchmarks share the machine


class Client(NamedTuple):
    """An OpenAI API key a document knows: `openai.principal_tokens[token_ref]`, of a principal."""

    token_ref: str
    key: str
    principal_ref: str


#: The clients a built document knows unless told otherwise: two keys of principal team-search.
CLIENTS = (
    Client("search-chat", "sk-chat-secret", "team-search"),
    Client("search-batch", "sk-batch-secret", "team-search"),
)
#: The key a caller sends to be served (search-chat's).
CLIENT_TOKEN = CLIENTS[0].key


def node_token_of(node_id: str) -> str:
    """Node `node_id`'s token in a built document, unless the caller names another."""
    return f"{node_id}-token"


def provider(
    pid: str,
    adapter: Mapping[str, Any] | None = None,
    *,
    served: str = "served",
    capacity: int = 8,
    **settings: Any,
) -> dict[str, Any]:
    """A provider entry: `adapter` (default: the built-in `fake` one) serving the model `served`;
    `settings` adds or overrides its other fields (priority, max_queue, health, ...)."""
    return {
        "id": pid,
        "adapter": dict(adapter) if adapter is not None else {"type": "fake"},
        "served_models": [served],
        "capacity": capacity,
        **settings,
    }


def edge_document(
    nodes: Mapping[str, Sequence[Mapping[str, Any]]],
    models: Mapping[str, Sequence[str]] | None = None,
    *,
    model_settings: Mapping[str, Mapping[str, Any]] | None = None,
    node_tokens: Mapping[str, str] | None = None,
    placement: Placement = "node",
    edge_id: str = "edge-test",
    listeners: bool = True,
    tls: Mapping[str, Any] | None = None,
    admin: bool = False,
    metrics: bool = False,
    clients: Sequence[Client] = CLIENTS,
    limits: Sequence[Mapping[str, Any]] = (),
    edge: Mapping[str, Any] | None = None,
    openai: Mapping[str, Any] | None = None,
) -> Document:
    """A valid config document of `nodes` (node id -> its providers, each with `id`, `adapter`
    and `served_models`: see `provider`).

    `models` maps a model id to the ids of its providers, each serving its first served model
    (default: one model `m` over every provider); `model_settings` adds fields to a model's
    entry by model id (generation, dispatch, fallbacks, first_byte_timeout_ms, ...).
    Each node dials with `node_tokens[id]`, else `node_token_of(id)`; `placement="edge"` places
    every node on the Edge instead. The Edge's, the OpenAI API's and the admin API's listeners
    are on loopback port 0, so that no two Edges of a parallel run take one port (the admin
    API's default is 9090); `listeners=False` leaves them at their defaults, as a deployed
    config has them. `admin` puts the admin API on loopback then too, and `metrics` adds the
    metrics listener on loopback; `tls` is `edge.tls` (the Node link). `clients` are the keys the
    OpenAI API knows and `limits` its `openai.limits`. `edge` and `openai` add to (or override)
    those sections last.
    """
    everyone = [p for providers in nodes.values() for p in providers]
    served = {p["id"]: p["served_models"][0] for p in everyone}
    if models is None:
        models = {"m": [p["id"] for p in everyone]}
    tokens = {node_id: node_token_of(node_id) for node_id in nodes} | dict(node_tokens or {})
    listen = {"listen": _LOOPBACK} if listeners else {}
    edge_section: dict[str, Any] = {"id": edge_id, **listen}
    if admin or listeners:
        edge_section["admin"] = {"listen": _LOOPBACK}
    if metrics:
        edge_section["metrics"] = {"listen": _LOOPBACK}
    if tls is not None:
        edge_section["tls"] = dict(tls)
    openai_section: dict[str, Any] = dict(listen)
    if clients:
        openai_section["principal_tokens"] = [
            {
                "token_ref": client.token_ref,
                "token_hash_sha256": token_sha256(client.key),
                "principal_ref": client.principal_ref,
            }
            for client in clients
        ]
    if limits:
        openai_section["limits"] = [dict(limit) for limit in limits]
    openai_section.update(openai or {})
    document: Document = {"edge": {**edge_section, **(edge or {})}}
    if openai_section:
        document["openai"] = openai_section
    document["models"] = [
        {
            "id": model_id,
            "providers": {pid: served[pid] for pid in pids},
            **(model_settings or {}).get(model_id, {}),
        }
        for model_id, pids in models.items()
    ]
    document["nodes"] = [
        {
            "id": node_id,
            **(
                {"placement": "edge"}
                if placement == "edge"
                else {"token_hash_sha256": token_sha256(tokens[node_id])}
            ),
            "providers": list(providers),
        }
        for node_id, providers in nodes.items()
    ]
    return document


def find_provider(document: Mapping[str, Any], provider_id: str) -> dict[str, Any]:
    """The entry of provider `provider_id` in a config document or an EdgeConfig's spec, to read
    or to change in place."""
    for node in document["nodes"]:
        for entry in node["providers"]:
            if entry["id"] == provider_id:
                return entry  # type: ignore[no-any-return]
    raise KeyError(provider_id)
