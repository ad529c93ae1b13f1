"""What the fake upstream saw (`GET /fake/stats`): a test counts a gateway's tries, disconnects,
connections, the most requests at once, which keys and which trace contexts reached it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Final

#: Most distinct bearer tokens `bearer_sha256` keeps.
_MAX_BEARERS: Final = 64
#: Most traceparent headers `UpstreamStats.traceparents` keeps.
_MAX_TRACEPARENTS: Final = 64


@dataclass(slots=True)
class UpstreamStats:
    """What the fake saw; `completions` counts the completion requests it received, however they
    were answered (so a test can count the tries of a gateway's retries), `completed` the
    completions answered, `embeddings` the embeddings requests received, `lookups` the GETs
    answered (the model list, `/health`, `/metrics`: what a Node's health probe asks),
    `disconnects` clients that left before their response ended, `connections` the connections
    it accepted (so a test can see a client's keep-alive pool), `peak_in_flight` the most
    completions it served at once (so a test can check a capacity), `bearer_sha256` the SHA-256
    of each bearer token it was sent, with how often (so a test can tell which key reached it, and
    never holds one), `traceparents` the trace context of the latest requests."""

    requests: int = 0
    completions: int = 0
    completed: int = 0
    embeddings: int = 0
    lookups: int = 0
    failures_injected: int = 0
    disconnects: int = 0
    in_flight: int = 0
    connections: int = 0
    peak_in_flight: int = 0
    bearer_sha256: dict[str, int] = field(default_factory=dict)
    #: The `traceparent` headers of the latest requests that had one (at most
    #: `_MAX_TRACEPARENTS`, oldest first), so a test can see a trace reach the model server.
    traceparents: list[str] = field(default_factory=list)

    def saw_authorization(self, authorization: bytes) -> None:
        """Count a bearer token by its digest (the first `_MAX_BEARERS` distinct ones)."""
        if authorization[:7].lower() == b"bearer ":
            digest = hashlib.sha256(authorization[7:].strip()).hexdigest()
            seen = self.bearer_sha256
            if digest in seen or len(seen) < _MAX_BEARERS:
                seen[digest] = seen.get(digest, 0) + 1

    def saw_traceparent(self, traceparent: bytes) -> None:
        seen = self.traceparents
        seen.append(traceparent.decode("latin-1"))
        del seen[:-_MAX_TRACEPARENTS]
