"""What the Edge and the Node share about a run: values, codes, the wire's conversion and writer.

The dispatch layer of the Edge sees only this package's values:

- `RunRequest(run_id, provider_id, served_model, kind, body, stream, deadline, long_context)`
- events, yielded in order, exactly one terminal event (`RunDone` or `RunFailed`) per run:
  `RunChunk(data, usage_only)`, `RunUsage(prompt_tokens, completion_tokens, total_tokens)`,
  `RunDone(finish_reason)`, `RunFailed(code, message, retryable, status)`
- `ProviderHealth(provider_id, healthy, detail)`
- the error codes and their HTTP statuses in `iop.wire.statuses`.

The protobuf messages (`iop.runtime_pb2`) stay behind `converting.py`; `CoalescingWriter` is the
one writer per stream direction both sides use.
"""

from typing import Final

from . import statuses
from .runs import (
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
from .writing import CoalescingWriter

__all__ = [
    "PROTOCOL_VERSION",
    "TERMINAL_EVENTS",
    "CoalescingWriter",
    "ProviderHealth",
    "RunChunk",
    "RunDone",
    "RunEvent",
    "RunFailed",
    "RunKind",
    "RunRequest",
    "RunUsage",
    "grpc_options",
    "statuses",
]

#: The version of runtime.proto's semantics; an Edge refuses a Node that speaks another.
PROTOCOL_VERSION: Final = 1

#: Largest message either side accepts: a batch of whole response bodies can be large.
MAX_MESSAGE_BYTES: Final = 256 * 1024 * 1024


def grpc_options() -> list[tuple[str, int]]:
    """Channel and server options both sides use: big messages, keepalive to spot dead peers."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ]
