"""`nodes`: the Node agents (or nodes placed on the Edge) and their providers: how each provider
is reached (its adapter), how much work it takes, and how its health is judged."""

from __future__ import annotations

from typing import Annotated, Final, Literal, Self

from pydantic import Field, field_validator, model_validator

from .fields import (
    URL_PATH_PATTERN,
    EnvName,
    Name,
    SecretKeyRef,
    Sha256Hex,
    Spec,
    Url,
    live,
    one_token_source,
    restart_edge,
    restart_node,
)

#: Where a node's providers run: in a Node agent (`node`) or inside every Edge replica (`edge`).
NodePlacement = Literal["node", "edge"]
#: The placement of a node whose providers every Edge replica runs itself.
EDGE_PLACEMENT: Final = "edge"


class OpenAIAdapterSettings(Spec):
    """Any OpenAI-compatible HTTP server: vLLM, Ollama, llama.cpp server, TGI, OpenAI."""

    type: Literal["openai"] = "openai"
    base_url: Annotated[
        Url,
        restart_node(
            "Base URL of the server's OpenAI API, e.g. http://127.0.0.1:8000/v1. Under an "
            "upstream policy (the chart's `upstreams`) its host must be one the policy allows."
        ),
    ]
    api_key_env: Annotated[
        EnvName | None,
        restart_node(
            "Name of the environment variable on the Node that holds the API key; the key "
            "itself never goes in the config. Under an upstream policy (the chart's) the "
            "variable must be bound to this provider's host (and id): a key is never read for "
            "any other."
        ),
    ] = None
    connect_timeout_s: Annotated[
        float, restart_node("Seconds to wait for a connection to the server.", gt=0)
    ] = 5.0
    request_timeout_s: Annotated[
        float,
        restart_node(
            "Seconds a request may wait for the next byte from the server; in a stream, for "
            "the next event with data (comments and empty events do not count, so a stream of "
            "nothing else ends with 504 `upstream_timeout`).",
            gt=0,
        ),
    ] = 600.0
    max_connections: Annotated[
        int, restart_node("Size of the Node's connection pool to this server.", ge=1)
    ] = 256


class FakeAdapterSettings(Spec):
    """A deterministic built-in generator for demos, tests and benchmarks."""

    type: Literal["fake"] = "fake"
    latency_ms: Annotated[float, restart_node("Milliseconds before the first token.", ge=0)] = 0.0
    tokens_per_second: Annotated[
        float | None,
        restart_node(
            "Generation speed after the first token; null means as fast as possible.", gt=0
        ),
    ] = None
    completion_tokens: Annotated[
        int,
        restart_node("Tokens generated when the request sets no max_tokens.", ge=1),
    ] = 16


#: A provider's adapter settings, told apart by their `type`.
AdapterSettings = Annotated[
    OpenAIAdapterSettings | FakeAdapterSettings, Field(discriminator="type")
]


class HealthPolicy(Spec):
    """How a Node judges one provider's health: probes of its upstream, and its failing requests.

    The Node probes every provider whose adapter has an upstream (the `fake` adapter has none)
    and reports the verdict to every Edge, which takes an unhealthy provider out of dispatch.
    """

    path: Annotated[
        str | None,
        live(
            "Path the Node probes with GET on the upstream's host (for example /health); null "
            "means the adapter's base_url + /models (GET /v1/models). 2xx and 3xx answers pass.",
            pattern=URL_PATH_PATTERN,
        ),
    ] = None
    interval_ms: Annotated[
        int,
        live(
            "Milliseconds from one probe's start to the next one's (a probe slower than that "
            "delays the next). 0 turns probing off, and request_failure_threshold with it: "
            "the provider then counts as healthy unless its adapter cannot start.",
            ge=0,
        ),
    ] = 5000
    timeout_ms: Annotated[
        int,
        live(
            "Milliseconds a probe may take (connect and answer); a slower one counts as failed.",
            ge=1,
        ),
    ] = 2000
    failure_threshold: Annotated[
        int,
        live(
            "Consecutive failed probes (no connection, a timeout, an HTTP status >= 400) that "
            "take a healthy provider out of dispatch.",
            ge=1,
        ),
    ] = 3
    success_threshold: Annotated[
        int,
        live(
            "Consecutive passing probes that bring an unhealthy provider back. A provider "
            "starts unhealthy (not probed yet) and its first passing probe brings it in.",
            ge=1,
        ),
    ] = 1
    request_failure_threshold: Annotated[
        int,
        live(
            "Consecutive requests that failed on the upstream (5xx, connection refused or "
            "reset, a timeout) that take the provider out of dispatch at once (outlier "
            "detection); it comes back through success_threshold passing probes. 0 turns "
            "this off.",
            ge=0,
        ),
    ] = 5

    @field_validator("interval_ms")
    @classmethod
    def _interval_off_or_sane(cls, value: int) -> int:
        if 0 < value < 100:
            raise ValueError("must be 0 (no probing) or at least 100")
        return value

    @property
    def probing(self) -> bool:
        return self.interval_ms > 0


class ProviderSpec(Spec):
    """A model server under a Node: how to reach it and how much work it takes."""

    id: Annotated[
        Name,
        restart_node(
            "Provider id, unique across the whole config. Adding or removing a provider "
            "changes the node's adapters."
        ),
    ]
    adapter: Annotated[AdapterSettings, restart_node("How the Node talks to this provider.")]
    served_models: Annotated[
        list[Annotated[str, Field(min_length=1)]],
        live("Model names this provider serves.", min_length=1),
    ]
    enabled: Annotated[
        bool,
        live(
            "False takes the provider out of dispatch; its adapter keeps running (no process "
            "is started or stopped)."
        ),
    ] = True
    capacity: Annotated[
        int, live("Most requests this provider runs at once, across all Edges.", ge=1)
    ] = 1
    long_context_slots: Annotated[
        int | None,
        live(
            "Most long-context requests at once (each also holds a capacity slot); null means "
            "no separate limit, 0 means it takes none. At most capacity.",
            ge=0,
        ),
    ] = None
    priority: Annotated[
        int, live("Dispatch preference: the lowest priority wins; equal ones take turns.", ge=0)
    ] = 0
    max_queue: Annotated[
        int,
        live(
            "Requests that may wait for this provider when no candidate is free; a model's "
            "queue holds the sum over its providers.",
            ge=0,
        ),
    ] = 64
    queue_timeout_ms: Annotated[
        int, live("Milliseconds a request may wait for this provider before a 503.", gt=0)
    ] = 30_000
    engine_priority: Annotated[
        bool,
        live(
            "Send each request's priority class to this server as the body's `priority`, "
            "vLLM's (lower is served first: the class's priority negated, so `interactive` at "
            "10 goes as -10), in place of any the client sent. For a vLLM server run with "
            "`--scheduling-policy priority`, which then orders its queue and prefill by class "
            "and preempts a lower class's running request for a higher one's; a server that "
            "schedules first come first served refuses a nonzero priority (400)."
        ),
    ] = False
    health: Annotated[
        HealthPolicy,
        live(
            "How the Node checks this provider's health: probes of its upstream and its "
            "failing requests (docs/edge.md, Health)."
        ),
    ] = HealthPolicy()


class NodeRuntime(Spec):
    """Runtime metadata of a Node."""

    concurrency: Annotated[
        int | None,
        live(
            "Legacy metadata only; it is not a node-wide admission limit (capacity is "
            "per provider).",
            ge=1,
        ),
    ] = None


class NodeSpec(Spec):
    """A Node agent: a worker that dials the Edge and runs requests on its providers."""

    id: Annotated[
        Name,
        restart_edge("Node id; adding or removing a node restarts the Edge's node store."),
    ]
    alias: Annotated[
        str | None, restart_edge("A human-readable name for the node, shown in status.")
    ] = None
    placement: Annotated[
        NodePlacement,
        restart_edge(
            "Where this node's providers run. node: in a Node agent that dials the Edges (a "
            "GPU host, a cluster the Edge cannot reach, behind NAT). edge: inside every Edge "
            "replica, with no Node process and no gRPC hop (the upstream must be reachable "
            "from the Edge pods); each replica takes an equal share of each provider's "
            "capacity (docs/edge.md, Nodes placed on the Edge). An edge node has no token."
        ),
    ] = "node"
    token_hash_sha256: Annotated[
        Sha256Hex | None,
        restart_edge(
            "SHA-256 (64 lowercase hex) of the token this node authenticates with; never the "
            "token itself. Exactly one of token_hash_sha256 and token_secret (none for "
            "placement edge)."
        ),
    ] = None
    token_secret: Annotated[
        SecretKeyRef | None,
        live(
            "In an EdgeConfig: the Secret that holds this node's token (the one its agent "
            "presents). The operator writes its SHA-256 into the Edge's config as "
            "token_hash_sha256, where a different token rolls the Edge; the reference itself "
            "is not part of the Edge's config."
        ),
    ] = None
    runtime: Annotated[NodeRuntime, live("Runtime metadata.")] = NodeRuntime()
    providers: Annotated[
        list[ProviderSpec],
        restart_node("The providers (model servers) under this node."),
    ] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if self.placement == EDGE_PLACEMENT:
            if self.token_hash_sha256 is not None or self.token_secret is not None:
                raise ValueError(
                    "a node with placement edge runs inside the Edge and dials nothing: "
                    "remove its token_hash_sha256 / token_secret"
                )
        else:
            one_token_source("a node", self.token_hash_sha256, self.token_secret)
        return self

    @property
    def on_edge(self) -> bool:
        """Its providers run inside the Edge (`placement: edge`)."""
        return self.placement == EDGE_PLACEMENT
