"""Failed authentications per source: counted by reason, throttled, and logged at a bounded rate.

Each source address (an IPv6 address by its /64) has a budget of failures, a token bucket of
`per_minute` that refills over a minute. A source that has spent it is throttled: whatever it
sends next is turned away before any token is checked, until the bucket refills enough for one
more try (the caller says when: `Retry-After`). The log names the source, the reason and the
first 8 hex digits of the token's SHA-256, at most once per `log_interval` (with a count); the
table of sources is bounded (`max_sources`). The OpenAI listener and the node hub each have one.
docs/reliability.md, "Hostile peers" ("Guessing credentials"), says why.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from typing import Final

from iop.aiokits import LogThrottle
from iop.edgeconfig import token_sha256

#: Sources remembered at most (each a few dozen bytes).
_MAX_SOURCES: Final = 10_000


def source_of(address: str) -> str:
    """The key of a client address: the address itself, or an IPv6 address's /64 prefix."""
    if ":" not in address:
        return address  # IPv4 (or a name): as the kernel gave it, no parsing on every request
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return address


def token_hint(token: bytes | str) -> str:
    """The first 8 hex digits of the token's SHA-256: what the log may say about a token."""
    return token_sha256(token)[:8]


class _Bucket:
    __slots__ = ("tokens", "updated")

    def __init__(self, tokens: float, updated: float) -> None:
        self.tokens = tokens
        self.updated = updated


class AuthFailures:
    """Failed authentications on one listener (`what`: "the OpenAI API", "the node hub")."""

    def __init__(
        self,
        what: str,
        logger: logging.Logger,
        *,
        per_minute: int,
        log_interval: float = 10.0,
        max_sources: int = _MAX_SOURCES,
    ) -> None:
        if per_minute < 1:
            raise ValueError(f"per_minute must be at least 1, got {per_minute}")
        self.what = what
        self.per_minute = per_minute
        self._rate = per_minute / 60.0
        self._max_sources = max_sources
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._failures_log = LogThrottle(logger, interval=log_interval)
        self._throttle_log = LogThrottle(logger, interval=log_interval)
        #: Failures so far, by reason.
        self.failures: dict[str, int] = {}
        #: Attempts turned away because their source was throttled.
        self.throttled = 0

    def retry_after(self, source: str) -> float | None:
        """Seconds until `source` may try again when it is throttled now, else None; counts a
        throttled attempt."""
        bucket = self._buckets.get(source)
        if bucket is None:
            return None
        tokens = self._refill(bucket, time.monotonic())
        if tokens >= 1.0:
            return None
        self.throttled += 1
        return (1.0 - tokens) / self._rate

    def failed(self, source: str, reason: str, detail: str = "") -> None:
        """Count a failed authentication of `source` for `reason` (a code: a metric label);
        `detail` is what the log says besides (never a token: `token_hint()` of it)."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
        now = time.monotonic()
        bucket = self._buckets.get(source)
        if bucket is None:
            bucket = self._buckets[source] = _Bucket(float(self.per_minute), now)
            if len(self._buckets) > self._max_sources:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(source)
        # Failures that were already on their way when the budget ran out push it below zero,
        # so a source that keeps at it waits longer; by at most another minute's budget.
        before = self._refill(bucket, now)
        tokens = max(before - 1.0, -float(self.per_minute))
        bucket.tokens = tokens
        self._failures_log.warning(
            "%s: failed authentication from %s (%s%s)",
            self.what,
            source,
            reason,
            f": {detail}" if detail else "",
        )
        if tokens < 1.0 <= before:  # this failure spent the last of the budget
            self._throttle_log.warning(
                "%s: throttling %s: %d failed authentications within a minute; it may try "
                "again at %d a minute",
                self.what,
                source,
                self.per_minute,
                self.per_minute,
            )

    @property
    def sources(self) -> int:
        """Sources remembered now."""
        return len(self._buckets)

    def _refill(self, bucket: _Bucket, now: float) -> float:
        tokens = min(float(self.per_minute), bucket.tokens + (now - bucket.updated) * self._rate)
        bucket.tokens, bucket.updated = tokens, now
        return tokens
