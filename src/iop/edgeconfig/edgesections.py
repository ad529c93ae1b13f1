"""The Edge's own sections: its identity and listeners (`edge`), the admin API, the metrics
listener, the Node links' heartbeats, TLS, bootstrap, the control plane and A2A."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import model_validator

from .fields import (
    Listener,
    Name,
    OptionalListener,
    SecretKeyRef,
    Sha256Hex,
    Spec,
    Url,
    live,
    restart_edge,
)


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


class A2ASection(Spec):
    """The agent-to-agent listener (reserved)."""

    listen: Annotated[
        OptionalListener, restart_edge("host:port of the A2A listener; empty means off.")
    ] = ""
