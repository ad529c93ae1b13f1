"""What the Edge and the Node share about a run: values, codes, the wire's conversion and writer.

The dispatch layer of the Edge sees only this package's values:

- `RunRequest(run_id, provider_id, served_model, kind, body, stream, deadline, long_context)`
- events, yielded in order, exactly one terminal event (`RunDone` or `RunFailed`) per run:
  `RunChunk(data, usage_only)`, `RunUsage(prompt_tokens, completion_tokens, total_tokens)`,
  `RunDone(finish_reason)`, `RunFailed(code, message, retryable, status)`
- `ProviderHealth(provider_id, healthy, detail, reason)`, its reason codes, a Node's
  `DrainProgress` and its `ConfigAck` (its answer to a config push) in `iop.wire.nodestates`
- the error codes and their HTTP statuses in `iop.wire.statuses`.

The protobuf messages (`runtime_pb2` and the gRPC stubs `runtime_pb2_grpc`, generated here by
`scripts/gen-proto`) are known to `converting.py` and to the two ends of the stream alone, which
build and read the messages whole: the Edge's `nodehub` and `nodesessions`, the Node's
`connecting`. The request path, the refresh and the `Hub` protocol see only these values.
`CoalescingWriter` is the one writer per stream direction both sides use; `liveness.py` holds
the heartbeat deadline both sides judge a peer by, and `tls.py` the credentials of the link.
"""

from typing import Final

from . import nodestates, statuses
from .converting import (
    ack_from_proto,
    chunk_to_pieces,
    drain_from_proto,
    drain_to_proto,
    event_from_proto,
    event_to_proto,
    health_from_proto,
    health_to_proto,
    liveness_from_proto,
    liveness_to_proto,
    payload_from_proto,
    payload_to_proto,
    request_from_proto,
    request_to_proto,
    server_load_from_proto,
    server_load_to_proto,
)
from .liveness import DEFAULT_LIVENESS, Liveness, Ticker
from .nodestates import (
    ADAPTER_ERROR,
    DRAINING,
    NODE_DISCONNECTED,
    NOT_PROBED,
    NOT_REPORTED,
    PROBE_FAILED,
    REQUEST_FAILURES,
    UNSPECIFIED,
    ConfigAck,
    DrainProgress,
    ServerLoad,
)
from .pumping import StreamPump
from .runs import (
    DEFAULT_MAX_RESPONSE_BYTES,
    TERMINAL_EVENTS,
    ProviderHealth,
    RunChunk,
    RunDone,
    RunEvent,
    RunFailed,
    RunKind,
    RunRequest,
    RunUsage,
)
from .texts import MAX_ID_CHARS, bounded
from .tls import ClientTls, ServerTls, TlsError
from .writing import CoalescingWriter

__all__ = [
    "ADAPTER_ERROR",
    "DEFAULT_LIVENESS",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DRAINING",
    "MAX_ID_CHARS",
    "NODE_DISCONNECTED",
    "NOT_PROBED",
    "NOT_REPORTED",
    "PROBE_FAILED",
    "PROTOCOL_VERSION",
    "REQUEST_FAILURES",
    "TERMINAL_EVENTS",
    "UNSPECIFIED",
    "ClientTls",
    "CoalescingWriter",
    "ConfigAck",
    "DrainProgress",
    "Liveness",
    "ProviderHealth",
    "RunChunk",
    "RunDone",
    "RunEvent",
    "RunFailed",
    "RunKind",
    "RunRequest",
    "RunUsage",
    "ServerLoad",
    "ServerTls",
    "StreamPump",
    "Ticker",
    "TlsError",
    "ack_from_proto",
    "bounded",
    "chunk_to_pieces",
    "drain_from_proto",
    "drain_to_proto",
    "event_from_proto",
    "event_to_proto",
    "grpc_options",
    "health_from_proto",
    "health_to_proto",
    "liveness_from_proto",
    "liveness_to_proto",
    "nodestates",
    "payload_from_proto",
    "payload_to_proto",
    "request_from_proto",
    "request_to_proto",
    "server_load_from_proto",
    "server_load_to_proto",
    "statuses",
]


#: The version of runtime.proto's semantics; an Edge refuses a Node that speaks another.
#: 2: heartbeats both ways with a deadline, accepted runs, per-run pause, instance precedence.
PROTOCOL_VERSION: Final = 2

#: Largest message a Node accepts from its Edge (runs' bodies, config payloads), and either side
#: sends.
MAX_MESSAGE_BYTES: Final = 256 * 1024 * 1024


def grpc_options(*, max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel and server options both sides use: message sizes, and HTTP/2 keepalive.

    The Edge's node hub receives at most `max_receive_bytes` (far less than a Node does: see
    `iop.edge.hub.caps`); a Node takes whatever its Edge sends.

    Keepalive is the transport's backstop behind the application's heartbeats (`liveness.py`):
    it closes a link whose peer stops acknowledging pings, so a half-dead connection does not
    linger once the heartbeat deadline has ended its stream. A ping goes out after
    `keepalive_time_ms` without reads; the transport closes when its ack has not come within the
    *ping* timeout: grpc-core (1.85) times a keepalive ping with `http2.ping_timeout_ms`
    (default 60 s) and `keepalive_timeout_ms` alone never closed a link whose peer was frozen,
    so both are set. Each side accepts the other's pings as often as every second
    (`min_ping_interval_without_data_ms`); a stricter receiver would answer them with GOAWAY
    ("too many pings") and end a healthy link.
    """
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 5_000),
        ("grpc.keepalive_timeout_ms", 3_000),
        ("grpc.http2.ping_timeout_ms", 3_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ]
