"""The EdgeConfig model: one pydantic schema for edge.yaml, the CRD spec and `kubectl explain`.

Every section of the model; what they are made of (the apply markers, the value types and the
base `Spec`) is in `fields`. The checks that relate values to each other live in
`validating.py`.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Final, Literal, Self

from pydantic import Field, field_validator, model_validator

from .fields import (
    REDIS_URL_PATTERN,
    TIME_OF_DAY_PATTERN,
    URL_PATH_PATTERN,
    EnvName,
    Listener,
    ModelId,
    Name,
    OptionalListener,
    SecretKeyRef,
    Sha256Hex,
    Spec,
    Url,
    live,
    one_token_source,
    restart_edge,
    restart_node,
)

#: The principal_ref of requests without a bearer token (`openai.allow_unauthenticated`).
ANONYMOUS_PRINCIPAL: Final = "anonymous"
#: The priority class of every request of a config that names none (`openai.priority`).
DEFAULT_PRIORITY_CLASS: Final = "default"


# -- the Edge itself -----------------------------------------------------------------------------


class AdminSection(Spec):
    """The Edge's admin HTTP API (refresh, config): an operator-local surface."""

    listen: Annotated[
        Listener,
        restart_edge(
            "host:port of the admin API. Off loopback it requires token_hash_sha256 or token_file."
        ),
    ] = "127.0.0.1:9090"
    token_hash_sha256: Annotated[
        Sha256Hex | None,
        restart_edge("SHA-256 (64 lowercase hex) of the bearer token the admin API accepts."),
    ] = None
    token_file: Annotated[
        str | None,
        restart_edge(
            "Path of a file holding the admin bearer token (for example a mounted Secret); "
            "the Edge hashes it at start and never logs it."
        ),
    ] = None
    token_secret: Annotated[
        SecretKeyRef | None,
        live(
            "In an EdgeConfig: the Secret the operator reads the admin token from to call the "
            "Edge (the Edge reads token_file, where that Secret is mounted). Null: Secret "
            "NAME-edge-admin, key token, created with a random token when missing. It is not "
            "part of the Edge's config."
        ),
    ] = None
    config_dir: Annotated[
        str | None,
        restart_edge(
            "A directory whose config files POST /refresh may name in `path`, besides the file "
            "the Edge was started from; null means only that file.",
            min_length=1,
        ),
    ] = None


class MetricsSection(Spec):
    """The Prometheus metrics listener, apart from the OpenAI API: the metrics name every
    principal and token ref, which the public listener must not tell anyone who asks."""

    listen: Annotated[
        OptionalListener,
        restart_edge(
            "host:port where GET /metrics is served; empty means no metrics listener. Keep it "
            "off the public interface (scrape it from inside the cluster)."
        ),
    ] = ""


class NodeLinkSection(Spec):
    """Liveness of the Node links: heartbeats in both directions and their deadlines."""

    heartbeat_interval_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds between heartbeats, sent both ways on every Node link with a run in "
            "flight, or on every link when quiet links are off (idle_heartbeat_interval_ms; "
            "Nodes get the value on welcome).",
            ge=50,
        ),
    ] = 500
    heartbeat_timeout_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds of silence (no message of any kind) after which either side counts "
            "the other as dead: the Edge fails or retries that Node's runs and stops "
            "dispatching to it, the Node cancels them and redials. Above the interval.",
            ge=100,
        ),
    ] = 2000
    idle_heartbeat_interval_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds between a Node's heartbeats on a quiet link: one with no run of this "
            "Edge in flight, whose Node keeps such links quiet (a Node sends sooner when its "
            "in-flight counts or its servers' load changed). The Edge sends none of its own on "
            "a quiet link, but to a Node that predates that, as often. Heartbeats are most of "
            "what an idle fleet costs the Edge; the price of a longer interval is a later "
            "verdict on a Node that freezes while idle (idle_heartbeat_timeout_ms, or its next "
            "run's first-event deadline). 0, or not above heartbeat_interval_ms: every link "
            "beats every heartbeat_interval_ms.",
            ge=0,
        ),
    ] = 10_000
    idle_heartbeat_timeout_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds of silence after which the Edge counts a Node as dead on a quiet link "
            "(a frozen Node with no run in flight is found by then, or at its next run by "
            "heartbeat_timeout_ms); a Node that predates one-way quiet links judges the Edge so "
            "too, the others by the transport's keepalive there. Above "
            "idle_heartbeat_interval_ms; never less than heartbeat_timeout_ms. The default "
            "leaves four intervals, as on a busy link.",
            ge=100,
        ),
    ] = 40_000
    first_event_timeout_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds a Node has to accept (or refuse) a run sent to it; a run with no "
            "answer by then fails as retryable and is tried elsewhere.",
            ge=100,
        ),
    ] = 3000
    hello_timeout_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds a new connection to the node hub has to finish its TLS and HTTP/2 "
            "handshake, and again to send its hello; then it is closed. A connection with no "
            "call open is closed after as long.",
            ge=100,
            le=120_000,
        ),
    ] = 5000
    max_connections: Annotated[
        int,
        restart_edge(
            "Most Nodes connected to the node hub at once (each Node keeps one connection per "
            "Edge replica): must be at least the number of nodes that dial in (placement edge "
            "does not count). One more is refused after its hello (RESOURCE_EXHAUSTED), "
            "counted in iop_edge_hub_connections_refused_total and logged. grpc closes "
            "connections beyond it plus max_unauthenticated_connections at once. The Edge "
            "lowers it to fit the process's open-file limit, beside the OpenAI listener's "
            "connections, and warns when it then admits fewer than the config's nodes.",
            ge=1,
        ),
    ] = 1024
    max_unauthenticated_connections: Annotated[
        int,
        restart_edge(
            "Most connections to the node hub whose hello has not been checked yet; one beyond "
            "it is refused (RESOURCE_EXHAUSTED) without a byte of it read, and its Node "
            "retries: a reconnect storm of more Nodes is admitted in turns.",
            ge=1,
        ),
    ] = 64
    max_unauthenticated_per_client: Annotated[
        int,
        restart_edge(
            "Most of those from one address (an IPv6 address counts by its /64).",
            ge=1,
        ),
    ] = 8

    @model_validator(mode="after")
    def _timeout_above_interval(self) -> Self:
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ValueError(
                f"heartbeat_timeout_ms ({self.heartbeat_timeout_ms}) must be above "
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms})"
            )
        idle, idle_timeout = self.quiet_link_ms()
        if idle and idle_timeout <= idle:
            raise ValueError(
                f"idle_heartbeat_timeout_ms ({idle_timeout}) must be above "
                f"idle_heartbeat_interval_ms ({idle})"
            )
        return self

    def quiet_link_ms(self) -> tuple[int, int]:
        """(interval, timeout) of a quiet link's heartbeats in effect: (0, 0) when quiet links
        are off (an idle interval of 0 or not above the heartbeat interval); the timeout is
        never below the heartbeat timeout."""
        idle = self.idle_heartbeat_interval_ms
        if idle <= self.heartbeat_interval_ms:
            return 0, 0
        return idle, max(self.idle_heartbeat_timeout_ms, self.heartbeat_timeout_ms)


class TlsSection(Spec):
    """TLS on the gRPC listener Nodes dial (files, such as a mounted Kubernetes Secret)."""

    cert_file: Annotated[
        str,
        restart_edge("PEM certificate chain the Edge presents to Nodes.", min_length=1),
    ]
    key_file: Annotated[str, restart_edge("PEM private key of that certificate.", min_length=1)]
    client_ca_file: Annotated[
        str | None,
        restart_edge(
            "PEM CA bundle; when set, every Node must present a client certificate it signed "
            "(mutual TLS). Null means server-side TLS only.",
            min_length=1,
        ),
    ] = None


class BootstrapSection(Spec):
    """Where the Edge keeps the artifacts it hands to Nodes when they first join."""

    artifact_path: Annotated[str, restart_edge("Directory of the bootstrap artifacts.")] = (
        "/var/lib/iop/bootstrap"
    )


class EdgeSection(Spec):
    """The Edge's identity and its listeners."""

    id: Annotated[Name, restart_edge("This Edge's identity, reported to Nodes and in metrics.")]
    listen: Annotated[Listener, restart_edge("host:port of the gRPC listener that Nodes dial.")] = (
        "0.0.0.0:7443"
    )
    admin: Annotated[AdminSection, restart_edge("The admin API (refresh, config).")] = (
        AdminSection()
    )
    bootstrap: Annotated[
        BootstrapSection, restart_edge("Bootstrap artifacts for joining Nodes.")
    ] = BootstrapSection()
    tls: Annotated[
        TlsSection | None,
        restart_edge("TLS on the listener Nodes dial; null means plaintext (trusted networks)."),
    ] = None
    node_link: Annotated[
        NodeLinkSection, restart_edge("Heartbeats and deadlines of the Node links.")
    ] = NodeLinkSection()
    metrics: Annotated[MetricsSection, restart_edge("The Prometheus metrics listener.")] = (
        MetricsSection()
    )


class ControlPlaneSection(Spec):
    """An optional remote control plane the Edge reports to."""

    url: Annotated[Url, restart_edge("Base URL of the control plane; empty means none.")] = ""


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


#: `principal_ref` of a limit that applies to every principal, each on its own counters.
EVERY_PRINCIPAL: Final = "*"


class TokenBudget(Spec):
    """Tokens a principal may spend per day or per month; the count starts again at the reset."""

    tokens: Annotated[
        int,
        live(
            "Tokens (prompt + completion, as the upstream reports them) allowed per period; a "
            "request that would pass it is refused with 429 until the reset.",
            ge=1,
        ),
    ]
    period: Annotated[
        Literal["day", "month"],
        live("How often the count starts again: every day, or on the first day of each month."),
    ]
    reset_at: Annotated[
        str,
        live(
            "Time of day (HH:MM, UTC) at which the period starts: every day, or on the first "
            "day of the month. A change keeps what was spent in the period it moves.",
            pattern=TIME_OF_DAY_PATTERN,
        ),
    ] = "00:00"


class PrincipalLimit(Spec):
    """Bounds on what one principal (or one of its tokens, or its use of one model) may use.

    A request is held to every entry that selects it; each entry counts on its own.
    """

    principal_ref: Annotated[
        str,
        live(
            "The principal this entry bounds (a principal_ref of principal_tokens, or "
            "'anonymous'); '*' bounds every principal, each with counters of its own.",
            min_length=1,
        ),
    ]
    token_ref: Annotated[
        Name | None,
        live(
            "Only the requests of this token of the principal (its token_ref); null counts "
            "every token of the principal together."
        ),
    ] = None
    model: Annotated[
        ModelId | None,
        live(
            "Only the requests for this model id of the catalog (the model asked for); null "
            "counts every model together."
        ),
    ] = None
    requests_per_minute: Annotated[
        int | None,
        live(
            "Requests admitted per minute: a bucket of this many that refills continuously "
            "(this many per minute), so a burst may take the whole minute's worth at once.",
            ge=1,
        ),
    ] = None
    tokens_per_minute: Annotated[
        int | None,
        live(
            "Tokens (prompt + completion) per minute, refilled continuously: at admission the "
            "request's estimated prompt tokens are taken, and corrected to the usage the "
            "upstream reports when the answer ends.",
            ge=1,
        ),
    ] = None
    max_concurrent: Annotated[
        int | None,
        live(
            "Requests in progress at once (waiting for a slot or running), across the fleet "
            "when a limit_store is configured.",
            ge=1,
        ),
    ] = None
    budget: Annotated[
        TokenBudget | None,
        live("Tokens allowed per day or month, with its reset time; null means no budget."),
    ] = None

    @model_validator(mode="after")
    def _bounds_something(self) -> Self:
        if (
            self.requests_per_minute is None
            and self.tokens_per_minute is None
            and self.max_concurrent is None
            and self.budget is None
        ):
            raise ValueError(
                "sets no limit: give requests_per_minute, tokens_per_minute, max_concurrent "
                "or budget"
            )
        return self

    @property
    def list_key(self) -> str:
        """The entry's key in paths and hashes: principal|token_ref|model ('*' for none)."""
        return f"{self.principal_ref}|{self.token_ref or '*'}|{self.model or '*'}"


class LimitStoreSection(Spec):
    """Where the limits of `openai.limits` count: in each Edge process, or in a Redis every
    replica shares (docs/edge.md, "Limits per principal")."""

    url: Annotated[
        str,
        restart_edge(
            "redis://host:port/db (rediss:// for TLS) of a Redis the Edge replicas share, so "
            "every limit holds fleet-wide, budgets survive restarts and every replica finds "
            "the server that holds a stored response of the Responses API; empty means each "
            "Edge counts on its own (and knows only the responses answered through it). No "
            "credentials in it: see password_env.",
            pattern=REDIS_URL_PATTERN,
        ),
    ] = ""
    password_env: Annotated[
        EnvName | None,
        restart_edge("Environment variable that holds the Redis password (AUTH); null: none."),
    ] = None
    username: Annotated[
        str | None,
        restart_edge("Redis ACL user name (AUTH username password); null: the default user."),
    ] = None
    key_prefix: Annotated[
        str,
        restart_edge(
            "Prefix of every key the Edge writes, so several Edge fleets can share one Redis.",
            pattern=r"^[A-Za-z0-9._:-]{1,64}$",
        ),
    ] = "iop"
    timeout_ms: Annotated[
        int,
        restart_edge(
            "Milliseconds an admission waits for Redis; past it, or while Redis is "
            "unreachable, the Edge counts in its own process (each replica then holds the "
            "limits on its own) and says so in its log, metrics and GET /status.",
            ge=1,
            le=10_000,
        ),
    ] = 250


class PriorityClass(Spec):
    """A priority class: the order its requests wait in, whether they may be shed, and how long
    they may wait (docs/edge.md, "Priority classes")."""

    name: Annotated[
        Name,
        live(
            "The class's name, as openai.priority.principals[], models[].priority_class and "
            "a request's x-iop-priority-class header name it."
        ),
    ]
    priority: Annotated[
        int,
        live(
            "Higher is served first: a waiting request of a higher priority always takes a "
            "freed slot before one of a lower priority, whenever each arrived; within one "
            "priority, principals share by their principal_weights. Below 0 the class is "
            "sheddable: at a saturated model its requests get 429 model_saturated at once "
            "instead of a place in the queue, and a full queue gives their places to higher "
            "priorities.",
            ge=-1000,
            le=1000,
        ),
    ]
    max_queue_wait_ms: Annotated[
        int,
        live(
            "Longest a request of this class waits in a model's queue; past it the request "
            "leaves the queue with 504 queue_wait_exceeded, before it reaches a server. The "
            "providers' queue_timeout_ms still ends the wait (503 queue_timeout) when it is "
            "shorter.",
            ge=1,
            le=3_600_000,
        ),
    ] = 30_000

    @property
    def list_key(self) -> str:
        return self.name


class PrincipalPriority(Spec):
    """The priority class of one principal's requests."""

    principal_ref: Annotated[
        str,
        live("The principal (a principal_ref of principal_tokens, or 'anonymous').", min_length=1),
    ]
    priority_class: Annotated[
        Name, live("The class of the principal's requests (a name of openai.priority.classes).")
    ]
    lower_per_request: Annotated[
        bool,
        live(
            "The principal may put one request in a class of a lower priority with the "
            "x-iop-priority-class header (never a higher one: that gets 403 "
            "priority_class_not_allowed). false: any such header gets 403."
        ),
    ] = True

    @property
    def list_key(self) -> str:
        return self.principal_ref


class SaturationSettings(Spec):
    """When a model counts as saturated: a sheddable request that arrives then is refused with
    429 model_saturated instead of queued. A model is saturated when either bound is reached."""

    queue_depth: Annotated[
        int,
        live(
            "Requests (of any class) waiting for the model at this Edge from which it is "
            "saturated: a backlog, demand beyond what its providers serve now. Below it a "
            "sheddable request may wait (behind every higher class), so that a busy fleet "
            "stays full between arrivals.",
            ge=1,
        ),
    ] = 8
    server_waiting: Annotated[
        int | None,
        live(
            "Requests waiting in a model server's own queue (vLLM's num_requests_waiting, read "
            "by its Node) from which its provider is full for a sheddable request even with a "
            "free slot at the Edge; the model is saturated when every available candidate is "
            "so. null: the servers' queues do not count.",
            ge=1,
        ),
    ] = 1


class PrioritySection(Spec):
    """Priority classes: who goes first when a model's providers are all busy, who is shed, and
    how long each may wait (docs/edge.md, "Priority classes"). A config that names no class
    runs every request in the built-in class `default` (priority 0, no wait bound of its own)."""

    classes: Annotated[
        list[PriorityClass],
        live("The classes, keyed by name; 'default' may be redefined."),
    ] = Field(default_factory=list)
    default_class: Annotated[
        Name | None,
        live(
            "The class of a request whose principal has no entry in principals and whose model "
            "names no priority_class. null: the built-in class 'default' (priority 0, waits "
            "only as long as its providers' queue_timeout_ms), or the class named 'default' "
            "when classes defines one."
        ),
    ] = None
    principals: Annotated[
        list[PrincipalPriority],
        live(
            "principal_ref -> its class (and whether it may lower a request's class); a "
            "principal with no entry takes its model's priority_class, then default_class."
        ),
    ] = Field(default_factory=list)
    saturation: Annotated[
        SaturationSettings, live("When a model counts as saturated for a sheddable request.")
    ] = SaturationSettings()


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


class A2ASection(Spec):
    """The agent-to-agent listener (reserved)."""

    listen: Annotated[
        OptionalListener, restart_edge("host:port of the A2A listener; empty means off.")
    ] = ""


# -- models --------------------------------------------------------------------------------------


class GenerationPolicy(Spec):
    """Defaults and caps applied to every request for a model."""

    max_tokens: Annotated[
        int | None,
        live(
            "Cap on completion tokens; a request asking for more is capped, a request naming "
            "none gets this many. Null means no cap.",
            ge=1,
        ),
    ] = None
    temperature: Annotated[
        float | None,
        live("Sampling temperature used when a request names none.", ge=0, le=2),
    ] = None
    top_p: Annotated[
        float | None, live("Nucleus sampling used when a request names none.", gt=0, le=1)
    ] = None


#: How a model picks among its best free providers (docs/edge.md, "Choosing among equals").
DispatchPolicyName = Literal["round_robin", "least_load", "prefix_affinity"]
#: Where a node's providers run: in a Node agent (`node`) or inside every Edge replica (`edge`).
NodePlacement = Literal["node", "edge"]
#: The placement of a node whose providers every Edge replica runs itself.
EDGE_PLACEMENT: Final = "edge"


class DispatchSettings(Spec):
    """How a model chooses among its best candidates: the providers of the lowest priority that
    have a free slot. Filtering, priority, capacity and long slots are the same under every
    policy; only the choice among those equals changes."""

    policy: Annotated[
        DispatchPolicyName,
        live(
            "round_robin: equals take turns (the least recently chosen goes next). least_load: "
            "the one with the lowest load for its capacity (this Edge's runs on it, plus its "
            "Node's runs from other Edges, plus the model server's requests from other clients "
            "when its /metrics tells them; KV-cache use breaks ties). prefix_affinity: a "
            "conversation "
            "goes back to the provider that holds its prompt's prefix (a hash of the prompt's "
            "leading blocks, the same on every Edge replica) while that provider's load stays "
            "within load_factor of its share and the prompt bytes waiting for prefill there "
            "(this Edge's runs before their first event), with the request's own new ones, are "
            "no more than the whole prompt on another free provider; otherwise the free "
            "provider with the least prefill waiting, then the least loaded, takes the request "
            "and becomes the prefix's new home."
        ),
    ] = "round_robin"
    load_factor: Annotated[
        float,
        live(
            "prefix_affinity's bound: a prefix's home keeps it while its load with the request "
            "stays at most this factor times its fair share (by capacity) of the load of the "
            "model's best candidates, rounded up (consistent hashing with bounded loads). "
            "Lower spreads load sooner, higher keeps more prefix-cache hits.",
            ge=1,
            le=10,
        ),
    ] = 1.25


class ModelSpec(Spec):
    """A model clients can ask for, and the providers that serve it."""

    id: Annotated[
        ModelId, live("The OpenAI `model` key clients send; also the provider pool's group key.")
    ]
    providers: Annotated[
        dict[Name, Annotated[str, Field(min_length=1)]],
        live(
            "Provider id -> the model name that provider actually serves; it must be one of "
            "that provider's served_models.",
            min_length=1,
        ),
    ]
    generation: Annotated[
        GenerationPolicy, live("Generation defaults and caps for this model.")
    ] = GenerationPolicy()
    fallbacks: Annotated[
        list[ModelId],
        live(
            "Models of this catalog that answer instead, in this order, when every provider of "
            "this model is unavailable or has failed before the first byte (each with its own "
            "fallbacks after it); retries after failures count against the retry budget. Ids "
            "must exist; no model may fall back to itself, directly or through others.",
            ordered=True,
        ),
    ] = Field(default_factory=list)
    first_byte_timeout_ms: Annotated[
        int | None,
        live(
            "Milliseconds a try of this model may take to the first byte for the client (a "
            "stream's first chunk, the whole answer of a request that does not stream), counted "
            "from when the run starts on its Node (not the queue wait). Past it the Edge cancels "
            "the run on its Node and, within `openai.retries`, tries another provider or a "
            "fallback; otherwise the client gets 504 `upstream_timeout`. Null: no limit but the "
            "adapter's request timeout (`request_timeout_s`, 600 s by default: the wait for "
            "the next byte, or a stream's next event with data).",
            ge=1,
        ),
    ] = None
    priority_class: Annotated[
        Name | None,
        live(
            "The priority class of this model's requests whose principal has no entry in "
            "openai.priority.principals (a name of openai.priority.classes); null: "
            "openai.priority.default_class."
        ),
    ] = None
    dispatch: Annotated[
        DispatchSettings,
        live(
            "How this model chooses among its best free providers: round_robin (the "
            "specification's rule), least_load or prefix_affinity (docs/edge.md)."
        ),
    ] = DispatchSettings()
    adapters: Annotated[
        list[ModelId],
        live(
            "LoRA adapters of this model that clients ask for by name: a request whose model is "
            "one of these runs on this model's providers, with the adapter's name as its model "
            "(the name the server serves it under: vLLM's --lora-modules NAME=PATH), on a "
            "server that has it loaded when one is free, else on one with room to load it, "
            "before one that must swap another adapter out; the capacity and priority rules "
            "stay the same (docs/edge.md, LoRA adapters). Each name is unique among the "
            "catalog's model ids and adapters; /v1/models lists an adapter with this model as "
            "its parent. Its requests take this model's generation policy, dispatch policy and "
            "priority class, and no fallbacks."
        ),
    ] = Field(default_factory=list)


# -- nodes and their providers -------------------------------------------------------------------


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


class RolloutSection(Spec):
    """How a live change is watched once applied (docs/rollout.md): each change becomes a
    revision; one that touches what is served (models, providers) is judged on the requests of
    the models it touches, against the figures of the last good revision, and put back to that
    revision by the Edge itself when it hurts."""

    mode: Annotated[
        Literal["canary", "watch", "off"],
        live(
            "canary: a change to what serves a model (its providers, served names, policy, "
            "fallbacks) first serves a share of that model's requests, in `steps`, judged "
            "against the stable revision at each step; a change of limits only (capacity, "
            "priority, queues) applies to all at once and is watched. watch: every change "
            "applies to all at once and is watched. Both roll a change back automatically when "
            "it fails a check; off: apply and keep, as before revisions."
        ),
    ] = "canary"
    steps: Annotated[
        list[int],
        live(
            "The canary's shares, in percent of the changed models' requests, each served for "
            "step_ms and judged before the next; the change is promoted after the last.",
            min_length=1,
            max_length=10,
        ),
    ] = Field(default_factory=lambda: [5, 25, 100])
    step_ms: Annotated[
        int,
        live(
            "Milliseconds each canary step serves before the next (it waits longer while the "
            "change has fewer than min_requests judged, up to max_wait_ms in all).",
            ge=100,
            le=3_600_000,
        ),
    ] = 10_000
    bake_ms: Annotated[
        int,
        live(
            "Milliseconds a watched change serves before it can be promoted (with at least "
            "min_requests judged).",
            ge=0,
            le=3_600_000,
        ),
    ] = 15_000
    max_wait_ms: Annotated[
        int,
        live(
            "Longest a change is watched: with fewer than min_requests by then it is promoted "
            "unjudged (too little traffic to judge), and its revision says so.",
            ge=1000,
            le=3_600_000,
        ),
    ] = 60_000
    min_requests: Annotated[
        int,
        live(
            "Requests of the touched models a verdict needs, on the change (and, for the first "
            "token check, on the last good revision too).",
            ge=1,
            le=1_000_000,
        ),
    ] = 20
    max_error_rate_increase: Annotated[
        float,
        live(
            "Fails the change when its share of requests that failed (a 5xx answer) or needed "
            "a retry exceeds the last good revision's by more than this (0.05: five points).",
            ge=0,
            le=1,
        ),
    ] = 0.05
    max_first_token_ratio: Annotated[
        float,
        live(
            "Fails the change when its p95 time to first token exceeds this many times the last "
            "good revision's (plus 100 ms, so a fast pool's jitter is no failure).",
            ge=1,
            le=100,
        ),
    ] = 2.0
    max_duration_ratio: Annotated[
        float,
        live(
            "Fails the change when its p95 request duration exceeds this many times the last "
            "good revision's (plus 500 ms).",
            ge=1,
            le=100,
        ),
    ] = 2.0

    @field_validator("steps")
    @classmethod
    def _steps_rise(cls, steps: list[int]) -> list[int]:
        if any(not 1 <= step <= 100 for step in steps):
            raise ValueError("each step is a share in percent, from 1 to 100")
        if any(later <= earlier for earlier, later in itertools.pairwise(steps)):
            raise ValueError(f"the steps must rise: {steps}")
        return steps


class EdgeConfig(Spec):
    """The whole configuration of one Edge: its listeners, models, nodes and providers."""

    edge: Annotated[EdgeSection, restart_edge("The Edge's identity and listeners.")]
    control_plane: Annotated[ControlPlaneSection, restart_edge("Remote control plane.")] = (
        ControlPlaneSection()
    )
    openai: Annotated[OpenAISection, restart_edge("The OpenAI-compatible API.")] = OpenAISection()
    a2a: Annotated[A2ASection, restart_edge("The A2A listener.")] = A2ASection()
    rollout: Annotated[
        RolloutSection, live("How a live change is watched and rolled back (docs/rollout.md).")
    ] = RolloutSection()
    models: Annotated[list[ModelSpec], live("The model catalog clients see at /v1/models.")] = (
        Field(default_factory=list)
    )
    nodes: Annotated[
        list[NodeSpec],
        restart_edge(
            "The Node agents and their providers. This rule is for adding or removing a node; "
            "each field below carries its own (the nearest rule wins), and most of them, a "
            "provider's capacity or priority among them, are live."
        ),
    ] = Field(default_factory=list)
