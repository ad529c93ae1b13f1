"""What can go wrong in the `openai` adapter's exchange with an upstream, as a `RunFailed`.

The HTTP client's errors (`upstreams.py`) and the adapter's own (`Malformed`, `NoEvents`,
`TooLarge`, raised by `openai_http.py` and `streamdecoding.py`) are translated here, once
(`failure`): each gets a code and a message that names what happened (the address, the timeout
that passed, the setting to change).
"""

from __future__ import annotations

import os
import socket

from iop.edgeconfig import OpenAIAdapterSettings as OpenAISettings
from iop.wire import RunFailed, statuses

from .upstreams import (
    BadResponse,
    ConnectFailed,
    ConnectTimeout,
    DeadlinePassed,
    Disconnected,
    NotAllowed,
    PoolTimeout,
    ReadTimeout,
)


class Malformed(Exception):
    """The upstream answered something that is not OpenAI's response format."""


class NoEvents(Exception):
    """The upstream's stream went on without an event for the client for the read timeout."""


class TooLarge(Exception):
    """The upstream's answer (or one event of its stream) is larger than the run allows."""


def too_large(limit: int) -> RunFailed:
    """How a run ends whose answer, or one event of its stream, passed `limit` bytes."""
    return statuses.failure(
        statuses.RESPONSE_TOO_LARGE,
        f"the upstream's answer is larger than {limit} bytes (openai.max_response_bytes); "
        "ask for a stream",
    )


def failure(error: Exception, settings: OpenAISettings, limit: int) -> RunFailed:
    """The one translation of what a run's exchange with the upstream raised into a
    `RunFailed`."""
    if isinstance(error, PoolTimeout):
        message = f"all {settings.max_connections} connections to the upstream are busy"
        return statuses.failure(statuses.PROVIDER_BUSY, message)
    if isinstance(error, ConnectTimeout):
        return statuses.failure(
            statuses.UPSTREAM_UNAVAILABLE,
            f"no connection to {settings.base_url} within {settings.connect_timeout_s:g}s",
        )
    if isinstance(error, ConnectFailed):
        return statuses.failure(
            statuses.UPSTREAM_UNAVAILABLE,
            f"cannot connect to {settings.base_url}: {_reason(error.os_error)}",
        )
    if isinstance(error, NotAllowed):
        return statuses.failure(
            statuses.UPSTREAM_UNAVAILABLE, f"cannot connect to {settings.base_url}: {error}"
        )
    if isinstance(error, ReadTimeout):
        return statuses.failure(
            statuses.UPSTREAM_TIMEOUT,
            f"the upstream sent nothing for {settings.request_timeout_s:g}s",
        )
    if isinstance(error, NoEvents):
        return statuses.failure(
            statuses.UPSTREAM_TIMEOUT,
            f"the upstream's stream sent no event for {settings.request_timeout_s:g}s, only "
            "comments or empty events (request_timeout_s)",
        )
    if isinstance(error, DeadlinePassed):
        return statuses.failure(statuses.UPSTREAM_TIMEOUT, "the run's deadline passed")
    if isinstance(error, Disconnected):
        when = "mid-response" if error.answered else "before it answered"
        return statuses.failure(
            statuses.UPSTREAM_ERROR, f"the upstream dropped the connection {when} ({error})"
        )
    if isinstance(error, BadResponse | Malformed):
        return statuses.failure(statuses.UPSTREAM_ERROR, str(error))
    if isinstance(error, TooLarge):
        return too_large(limit)
    return statuses.failure(statuses.UPSTREAM_ERROR, f"upstream request failed: {error!r}")


def _reason(error: OSError) -> str:
    """`Connection refused` rather than `Connect call failed ('10.0.0.1', 8000)`."""
    if isinstance(error, socket.gaierror) or not error.errno or error.errno < 0:
        return error.strerror or str(error)
    return os.strerror(error.errno)
