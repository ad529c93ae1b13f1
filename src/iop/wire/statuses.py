"""Every error code of the wire and how it maps to HTTP statuses and gRPC status codes.

One module, so the meaning of a code is decided once: the Node maps upstream failures to a
`RunFailed` here, the Edge maps a `RunFailed` to the HTTP status its client sees here, and both
sides agree here on the gRPC statuses that end a connection.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import grpc
import orjson

from .runs import RunFailed

# -- run error codes (RunFailed.code) -----------------------------------------------------------

#: The provider is at capacity on its Node (counted across every Edge), or its Node is draining
#: before it exits. Retryable: the Edge tries another candidate or waits; the request never fails
#: because of it.
PROVIDER_BUSY: Final = "provider_busy"
#: The Node has no such provider (its config lags the Edge's). Retryable.
UNKNOWN_PROVIDER: Final = "unknown_provider"
#: The provider's adapter could not start (for example its API key variable is not set).
PROVIDER_UNHEALTHY: Final = "provider_unhealthy"
#: The provider's node is not connected to this Edge. Retryable.
NODE_UNAVAILABLE: Final = "node_unavailable"
#: The node went away (or fell silent past its heartbeat deadline) while the run was in flight.
#: Retryable until the first chunk arrived.
NODE_DISCONNECTED: Final = "node_disconnected"
#: The node neither accepted nor answered the run within the first-event deadline (a node that
#: is alive but never got to it). Retryable: nothing reached the client, and the run is
#: cancelled on the node.
NOT_ACCEPTED: Final = "run_not_accepted"
#: The Edge is shutting down and takes no new runs. Retryable (on another replica).
EDGE_STOPPING: Final = "edge_stopping"
#: The upstream could not be reached (connection refused, DNS): nothing was sent. Retryable.
UPSTREAM_UNAVAILABLE: Final = "upstream_unavailable"
#: The upstream failed: a 5xx, a malformed response, a dropped connection.
UPSTREAM_ERROR: Final = "upstream_error"
#: The upstream sent nothing for too long, or the run's deadline passed.
UPSTREAM_TIMEOUT: Final = "upstream_timeout"
#: The upstream refused for rate (429). Retryable.
UPSTREAM_RATE_LIMITED: Final = "upstream_rate_limited"
#: The upstream refused the Node's credentials (401/403): a configuration problem.
UPSTREAM_AUTH: Final = "upstream_auth"
#: The upstream refused the request itself (400, 404, 422): the client's problem.
BAD_REQUEST: Final = "bad_request"
#: The run was cancelled (its client went away).
CANCELLED: Final = "cancelled"
#: A bug or an unexpected condition; the message says what.
INTERNAL_ERROR: Final = "internal_error"
#: The upstream's answer (a non-streamed body, or one event of a stream) is larger than the
#: run's `max_response_bytes`: the Node stopped reading it. Not retryable: another provider
#: would answer as much.
RESPONSE_TOO_LARGE: Final = "response_too_large"
#: The client of a stream took nothing of it for `openai.stream_stall_timeout_ms`: its run was
#: cancelled to free its provider; the client gets what the Edge held for it, then this error.
STREAM_STALLED: Final = "stream_stalled"

_RETRYABLE: Final = frozenset(
    {
        PROVIDER_BUSY,
        UNKNOWN_PROVIDER,
        PROVIDER_UNHEALTHY,
        NODE_UNAVAILABLE,
        NOT_ACCEPTED,
        EDGE_STOPPING,
        UPSTREAM_UNAVAILABLE,
        UPSTREAM_RATE_LIMITED,
    }
)

_HTTP_STATUS: Final = {
    PROVIDER_BUSY: 503,
    UNKNOWN_PROVIDER: 503,
    PROVIDER_UNHEALTHY: 503,
    NODE_UNAVAILABLE: 503,
    NODE_DISCONNECTED: 502,
    NOT_ACCEPTED: 504,
    EDGE_STOPPING: 503,
    UPSTREAM_UNAVAILABLE: 502,
    UPSTREAM_ERROR: 502,
    UPSTREAM_TIMEOUT: 504,
    UPSTREAM_RATE_LIMITED: 429,
    UPSTREAM_AUTH: 502,
    CANCELLED: 499,
    INTERNAL_ERROR: 500,
    RESPONSE_TOO_LARGE: 502,
    STREAM_STALLED: 408,
}


def failure(code: str, message: str, *, status: int | None = None) -> RunFailed:
    """A `RunFailed` with the code's usual retryability."""
    return RunFailed(code=code, message=message, retryable=code in _RETRYABLE, status=status)


def http_status(failed: RunFailed) -> int:
    """The HTTP status an Edge client should see for `failed`.

    A refused request (`bad_request`) keeps the upstream's own 4xx; upstream server errors become
    502 Bad Gateway (the gateway's upstream failed, not the gateway), timeouts 504.
    """
    if failed.code == BAD_REQUEST:
        status = failed.status
        return status if status is not None and 400 <= status < 500 else 400
    return _HTTP_STATUS.get(failed.code, 502)


#: Most characters of an upstream's error message passed to the client.
_ERROR_MESSAGE_CHARS: Final = 500
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]+")


def upstream_http_failure(status: int, body: bytes) -> RunFailed:
    """Map an upstream's error response (status >= 400) to a `RunFailed`.

    The message is the upstream's own when it sent one the OpenAI way (`_error_message`); no
    other part of its body reaches the client.
    """
    detail = _error_message(body)
    message = f"upstream answered HTTP {status}" + (f": {detail}" if detail else "")
    if status == 429:
        code = UPSTREAM_RATE_LIMITED
    elif status in (401, 403):
        code = UPSTREAM_AUTH
    elif status in (408, 504):
        code = UPSTREAM_TIMEOUT
    elif 400 <= status < 500:
        code = BAD_REQUEST
    else:
        code = UPSTREAM_ERROR
    return failure(code, message, status=status)


def _error_message(body: bytes) -> str:
    """`error.message` of an OpenAI error body (`{"error": {"message": ...}}`, also what vLLM,
    llama.cpp and Ollama send), or `message` of vLLM's older `{"object": "error", ...}`; at most
    `_ERROR_MESSAGE_CHARS` of it, control characters as spaces. Nothing of any other body: text,
    HTML or JSON of another shape is what a server that is not a model server answers (an API
    server, a metadata service), and is not for the client (docs/operator.md, "Who may do what").
    """
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    if not isinstance(document, dict):
        return ""
    error = document.get("error")
    if isinstance(error, dict):
        message = error.get("message")
    elif document.get("object") == "error":
        message = document.get("message")
    else:
        return ""
    if not isinstance(message, str):
        return ""
    shown = _CONTROL.sub(" ", message[:_ERROR_MESSAGE_CHARS]).strip()
    return shown + ("…" if len(message) > _ERROR_MESSAGE_CHARS else "")


# -- gRPC statuses that end a Node's connection -------------------------------------------------

#: Unknown node id or wrong token (one answer for both, so a caller learns nothing of the ids).
REFUSED_CREDENTIALS: Final = grpc.StatusCode.UNAUTHENTICATED
#: What the Edge tells a node that fails authentication, whichever way it failed.
REFUSED_CREDENTIALS_DETAILS: Final = "unknown node id or wrong token"
#: The node speaks a protocol version the Edge does not.
REFUSED_VERSION: Final = grpc.StatusCode.FAILED_PRECONDITION
#: The first message carried no hello.
REFUSED_NO_HELLO: Final = grpc.StatusCode.INVALID_ARGUMENT
#: The Edge is shutting down.
REFUSED_STOPPING: Final = grpc.StatusCode.UNAVAILABLE
#: Another connection of the same node process replaced this one.
REPLACED: Final = grpc.StatusCode.ABORTED
#: A newer process with the same node id is connected (a rolling update): the older one finished
#: its runs on this connection, or is refused while the newer one is connected.
SUPERSEDED: Final = grpc.StatusCode.ALREADY_EXISTS
#: The peer sent nothing (not even a heartbeat) within the heartbeat deadline.
SILENT: Final = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True, slots=True)
class ConnectionRefusal:
    """Why a connection to an Edge ended, as the Node tells its operator."""

    description: str
    #: True when retrying cannot help until someone changes a config or a token (the Node keeps
    #: retrying at its slowest pace, and logs an error instead of a warning).
    permanent: bool
    #: Retry at the slowest pace (permanent refusals, and a newer instance of this node holding
    #: the Edge: dialing again quickly would only be refused again).
    slowest: bool = False


def describe_connection_error(code: grpc.StatusCode, details: str | None) -> ConnectionRefusal:
    """How the Node should read a gRPC status that ended its connection."""
    text = details or code.name
    if code in (REFUSED_CREDENTIALS, grpc.StatusCode.PERMISSION_DENIED):
        return ConnectionRefusal(f"refused by the Edge: {text}", permanent=True, slowest=True)
    if code == REFUSED_VERSION:
        return ConnectionRefusal(f"protocol mismatch: {text}", permanent=True, slowest=True)
    if code == REFUSED_NO_HELLO:
        return ConnectionRefusal(
            f"the Edge refused the handshake: {text}", permanent=True, slowest=True
        )
    if code == SUPERSEDED:
        return ConnectionRefusal(f"superseded: {text}", permanent=False, slowest=True)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionRefusal(f"Edge unavailable: {text}", permanent=False)
    if code == REPLACED:
        return ConnectionRefusal(f"connection replaced: {text}", permanent=False)
    return ConnectionRefusal(f"{code.name}: {text}", permanent=False)
