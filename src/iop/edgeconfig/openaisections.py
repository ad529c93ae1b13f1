"""The `openai` section: the OpenAI-compatible API clients call, its listener and the bounds of
one request, the principal tokens, retries, and where its limits and priority classes sit."""

from __future__ import annotations

from typing import Annotated, Final, Self

from pydantic import Field, model_validator

from .fields import (
    Listener,
    Name,
    SecretKeyRef,
    Sha256Hex,
    Spec,
    live,
    one_token_source,
    restart_edge,
)
from .limitsections import LimitStoreSection, PrincipalLimit
from .prioritysections import PrioritySection

#: The principal_ref of requests without a bearer token (`openai.allow_unauthenticated`).
ANONYMOUS_PRINCIPAL: Final = "anonymous"


class PrincipalToken(Spec):
    """Maps the SHA-256 of a client's bearer token to the principal its usage is billed to."""

    token_ref: Annotated[
        Name,
        restart_edge(
            "Name of this token (per app, integration or purpose); the usage breakdown key."
        ),
    ]
    token_hash_sha256: Annotated[
        Sha256Hex | None,
        restart_edge(
            "SHA-256 (64 lowercase hex) of the bearer token; never the token itself. Exactly one "
            "of token_hash_sha256 and token_secret."
        ),
    ] = None
    token_secret: Annotated[
        SecretKeyRef | None,
        live(
            "In an EdgeConfig: the Secret that holds the bearer token. The operator writes its "
            "SHA-256 into the Edge's config as token_hash_sha256, where a different token rolls "
            "the Edge; the reference itself is not part of the Edge's config."
        ),
    ] = None
    principal_ref: Annotated[
        str,
        restart_edge("The principal (team, tenant) this token's usage counts for.", min_length=1),
    ]
    alias: Annotated[str | None, restart_edge("An optional human-readable name for the token.")] = (
        None
    )

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        one_token_source("a principal token", self.token_hash_sha256, self.token_secret)
        return self


class RetrySection(Spec):
    """Retries of requests that failed before any byte reached their client, and the budget
    that bounds them: a share of recent requests, as in Envoy's and Finagle's retry budgets, so
    a failing pool gets at most that much more traffic, never each request twice over."""

    max_per_request: Annotated[
        int,
        live(
            "Most retries of one request after failures before its first byte (upstream "
            "unreachable, connection reset, 5xx, timeout, node lost), each on a provider it has "
            "not tried while one is available, then on the model's fallbacks. provider_busy "
            "refusals are retried until the queue deadline and not counted. 0 turns retries off.",
            ge=0,
            le=10,
        ),
    ] = 2
    budget_percent: Annotated[
        float,
        live(
            "Retries of a model's requests (per Edge) over the window stay below this percent "
            "of its requests in the window, or below budget_min_per_second times the window "
            "when that is more; a retry beyond the budget is not made and the failure is the "
            "answer.",
            ge=0,
            le=100,
        ),
    ] = 20.0
    budget_min_per_second: Annotated[
        float,
        live(
            "Retries per second of the window a model may make whatever its traffic, so one "
            "with few requests can still retry.",
            ge=0,
            le=10_000,
        ),
    ] = 3.0
    budget_window_ms: Annotated[
        int,
        live(
            "Milliseconds of the sliding window over which the budget counts requests and "
            "retries; changing it starts the count afresh.",
            ge=1000,
            le=600_000,
        ),
    ] = 10_000


class OpenAISection(Spec):
    """The OpenAI-compatible HTTP API that clients call."""

    listen: Annotated[Listener, restart_edge("host:port of the OpenAI-compatible HTTP API.")] = (
        "0.0.0.0:8080"
    )
    long_context_threshold_tokens: Annotated[
        int,
        live(
            "Requests whose estimated input tokens reach this many are long-context "
            "(context_class=long) and need a long slot where a provider limits them.",
            gt=0,
        ),
    ] = 100_000
    allow_unauthenticated: Annotated[
        bool,
        restart_edge(
            "Accept requests without a bearer token (their usage counts for principal "
            "'anonymous'). Requests with an unknown token are refused either way."
        ),
    ] = False
    max_request_bytes: Annotated[
        int, restart_edge("Largest request body accepted, in bytes; larger gets 413.", ge=1024)
    ] = 8 * 1024 * 1024
    max_body_containers: Annotated[
        int,
        restart_edge(
            "Most JSON objects and arrays in one request body (counted outside strings); more "
            "gets 400 before the body is parsed. Bounds the CPU one body costs the Edge's event "
            "loop within max_request_bytes.",
            ge=1_000,
        ),
    ] = 50_000
    max_body_items: Annotated[
        int,
        restart_edge(
            "Most array elements and object members in one request body (about: its commas and "
            "containers outside strings); more gets 400 before the body is parsed.",
            ge=10_000,
        ),
    ] = 500_000
    max_body_depth: Annotated[
        int,
        restart_edge(
            "Deepest nesting of objects and arrays in a request body; deeper gets 400 naming "
            "the path.",
            ge=8,
            le=255,
        ),
    ] = 64
    max_messages: Annotated[
        int,
        restart_edge("Most messages in one chat completion request; more gets 400.", ge=1),
    ] = 10_000
    max_content_parts: Annotated[
        int,
        restart_edge("Most content parts in one chat message; more gets 400.", ge=1),
    ] = 1_000
    max_inputs: Annotated[
        int,
        restart_edge(
            "Most items in an embeddings request's input or a completion's prompt array (a "
            "flat array of token ids is one prompt); more gets 400.",
            ge=1,
        ),
    ] = 2_048
    max_header_bytes: Annotated[
        int,
        restart_edge(
            "Largest request head (request line and every header), in bytes; larger gets 431 "
            "and the connection is closed.",
            ge=1024,
        ),
    ] = 64 * 1024
    max_header_field_bytes: Annotated[
        int,
        restart_edge("Largest single header (name and value), in bytes; larger gets 431.", ge=256),
    ] = 16 * 1024
    max_headers: Annotated[
        int, restart_edge("Most headers in one request; more gets 431.", ge=8)
    ] = 100
    header_timeout_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds a client may take to send a request's head; then it gets 408 and "
            "the connection is closed (a new connection that sent nothing is just closed).",
            gt=0,
        ),
    ] = 10_000
    max_connections: Annotated[
        int,
        restart_edge(
            "Most client connections at once; a connection beyond it gets 503 and is closed. "
            "The Edge lowers it to fit the process's open-file limit.",
            ge=1,
        ),
    ] = 4096
    max_connections_per_client: Annotated[
        int,
        restart_edge(
            "Most connections from one client address (an IPv6 address counts by its /64); "
            "one beyond it gets 503 and is closed. Behind a proxy that is the proxy's address: "
            "raise it to the proxy's share.",
            ge=1,
        ),
    ] = 1024
    max_requests_per_client: Annotated[
        int,
        restart_edge(
            "Most completion requests in flight (waiting or running) from one client address, "
            "and apart from that from one principal_ref (anonymous requests count only by "
            "address); one beyond it gets 429 too_many_requests_in_flight.",
            ge=1,
        ),
    ] = 256
    auth_failures_per_minute: Annotated[
        int,
        restart_edge(
            "Failed authentications (no, malformed or unknown API key) one client address may "
            "make a minute; past them, its requests get 429 too_many_auth_failures, whatever "
            "their key, until that budget refills. Each failure is logged, throttled, with the "
            "address and the first 8 hex digits of the key's SHA-256.",
            ge=1,
        ),
    ] = 60
    send_timeout_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds a client may read nothing of its answer while the Edge has more to "
            "send; then the connection is cut and its run cancelled.",
            gt=0,
        ),
    ] = 30_000
    stream_stall_timeout_ms: Annotated[
        int,
        live(
            "Milliseconds a streaming client may fall behind by a whole stream_buffer_bytes "
            "and read too little to catch up (its run paused all along); then the run is "
            "cancelled on its Node, which frees its provider's slot, and the client gets what "
            "the Edge holds for it, then a stream_stalled error event. Keep it well under "
            "send_timeout_ms.",
            ge=100,
        ),
    ] = 5000
    stream_buffer_bytes: Annotated[
        int,
        restart_edge(
            "Bytes of one streamed answer the Edge holds for a client that reads slower than "
            "the provider writes; past it the run pauses, back to the provider, until the "
            "client catches up.",
            ge=4096,
        ),
    ] = 256 * 1024
    max_response_bytes: Annotated[
        int,
        live(
            "Largest answer taken from a provider: a non-streamed body, or one event of a "
            "stream. The Node stops reading past it and the client gets 502 "
            "response_too_large; ask for a stream to get more.",
            ge=64 * 1024,
        ),
    ] = 32 * 1024 * 1024
    principal_tokens: Annotated[
        list[PrincipalToken],
        restart_edge(
            "Client bearer tokens, by SHA-256 only, and the principal each one bills to. "
            "Several tokens may share a principal_ref."
        ),
    ] = Field(default_factory=list)
    principal_weights: Annotated[
        dict[Annotated[str, Field(min_length=1)], Annotated[int, Field(ge=1, le=1000)]],
        live(
            "Fair share of a model's queue: when requests of several principals wait for one "
            "model, each principal_ref is admitted in proportion to its weight (1 to 1000; a "
            "principal not named here weighs 1), and each principal's own requests in arrival "
            "order. Has no effect while nothing waits."
        ),
    ] = Field(default_factory=dict)
    retries: Annotated[
        RetrySection,
        live(
            "Retries before the first byte and their budget (docs/edge.md, Retries and fallbacks)."
        ),
    ] = RetrySection()
    limits: Annotated[
        list[PrincipalLimit],
        live(
            "Limits per principal (and per token_ref or model): requests and tokens per minute, "
            "requests at once, a token budget per day or month. A request over one is refused "
            "before it takes a slot or a queue place, with 429 rate_limit_exceeded naming the "
            "limit (docs/edge.md, 'Limits per principal')."
        ),
    ] = Field(default_factory=list)
    priority: Annotated[
        PrioritySection,
        live(
            "Priority classes: strict order between priorities in a model's queue, sheddable "
            "classes refused at saturation, a wait bound per class (docs/edge.md)."
        ),
    ] = PrioritySection()
    limit_store: Annotated[
        LimitStoreSection,
        restart_edge(
            "Where the limits count (and where the replicas share which server holds each "
            "stored response): per Edge process, or in a shared Redis."
        ),
    ] = LimitStoreSection()
