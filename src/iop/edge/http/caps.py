"""What the Edge's HTTP listeners refuse before a request reaches an app, and how they say it.

Anyone who can open a TCP connection to the OpenAI listener can send bytes before any auth.
`HttpCaps` bounds the request head (bytes, one header, the count: 431), the time to send it
(408), the connections (overall, fitted to the open-file limit beside the node hub's, and per
client address: 503) and a client that reads nothing (`send_timeout`); `Refusals` words each
refusal in OpenAI's error shape (`http/responses.py`) and logs each kind at most once a minute.
The Edge's HTTP protocol (`http/connections.py`) enforces them as it parses.
docs/reliability.md, "The HTTP listeners", says what each bound does and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from iop.aiokits import LogThrottle, open_file_limit, open_file_room
from iop.edgeconfig import OpenAISection

from ..errors import HeadersTooLarge, HeaderTimeout, MalformedRequest, TooManyConnections
from .responses import raw_response

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HttpCaps:
    """The limits of one HTTP listener; `HttpCaps.of(config.openai)` for the OpenAI API."""

    max_header_bytes: int = 64 * 1024
    max_header_field_bytes: int = 16 * 1024
    max_headers: int = 100
    header_timeout: float = 10.0
    max_connections: int = 4096
    send_timeout: float = 30.0
    #: Most connections from one client address (0: no bound of its own).
    max_connections_per_client: int = 0
    #: Open files this listener leaves for another one's connections (the node hub's) when it
    #: fits `max_connections` to the open-file limit.
    reserved_files: int = 0

    @classmethod
    def of(cls, section: OpenAISection) -> HttpCaps:
        return cls(
            max_header_bytes=section.max_header_bytes,
            max_header_field_bytes=section.max_header_field_bytes,
            max_headers=section.max_headers,
            header_timeout=section.header_timeout_ms / 1000,
            max_connections=section.max_connections,
            send_timeout=section.send_timeout_ms / 1000,
            max_connections_per_client=section.max_connections_per_client,
        )

    def fitted(self, open_files: int | None = None) -> HttpCaps:
        """These limits with `max_connections` lowered to leave `FD_RESERVE` and
        `reserved_files` open files free under the soft open-file limit (`open_files`, read from
        the process by default)."""
        open_files = open_file_limit() if open_files is None else open_files
        room = max(1, open_file_room(open_files) - self.reserved_files)
        if self.max_connections <= room:
            return self
        logger.warning(
            "max_connections %d does not fit the open-file limit %d: using %d (raise the limit, "
            "ulimit -n, to allow more)",
            self.max_connections,
            open_files,
            room,
        )
        return replace(self, max_connections=room)


class Refusals:
    """The answers a listener sends before an app sees a request, and their throttled log."""

    def __init__(self, listener: str, caps: HttpCaps) -> None:
        self.listener = listener
        self.caps = caps
        self._logs = {
            kind: LogThrottle(logger)
            for kind in ("too_large", "timeout", "connections", "malformed", "send_timeout")
        }
        #: How many of each kind this listener refused (for tests and status).
        self.counts = dict.fromkeys(self._logs, 0)

    def _count(self, kind: str, message: str, *args: object) -> None:
        self.counts[kind] += 1
        self._logs[kind].warning("%s: " + message, self.listener, *args)

    def too_large(self, what: str) -> bytes:
        self._count("too_large", "refused a request head: %s", what)
        return raw_response(HeadersTooLarge(f"The request's headers are too large: {what}."))

    def header_timeout(self) -> bytes:
        seconds = self.caps.header_timeout
        self._count("timeout", "closed a connection that sent no complete head in %gs", seconds)
        return raw_response(
            HeaderTimeout(f"The request's headers did not arrive within {seconds:g} seconds.")
        )

    def idle_closed(self) -> None:
        self._count(
            "timeout", "closed a connection that sent nothing for %gs", self.caps.header_timeout
        )

    def too_many_connections(self, open_now: int) -> bytes:
        self._count("connections", "refused a connection: %d open, the limit", open_now)
        return raw_response(
            TooManyConnections(
                f"The server has {open_now} connections open, its limit; try again shortly."
            )
        )

    def too_many_client_connections(self, client: str, open_now: int) -> bytes:
        self._count(
            "connections",
            "refused a connection from %s: it has %d open, the limit",
            client,
            open_now,
        )
        return raw_response(
            TooManyConnections(
                f"Your address has {open_now} connections open to this server, the most one "
                "client may hold; reuse them, or try again once some have closed."
            )
        )

    def malformed(self, reason: str) -> bytes:
        self._count("malformed", "refused malformed HTTP: %s", reason)
        return raw_response(MalformedRequest(f"The request is not valid HTTP/1.1: {reason}."))

    def unsupported(self, what: str) -> bytes:
        """Valid HTTP the Edge does not serve (a transfer coding it cannot decode)."""
        self._count("malformed", "refused a request: %s", what)
        return raw_response(MalformedRequest(f"The request cannot be read: {what}."))

    def send_timeout(self) -> None:
        self._count(
            "send_timeout",
            "cut a client that read nothing of its answer for %gs",
            self.caps.send_timeout,
        )
