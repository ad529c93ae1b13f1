"""What one client may do on the OpenAI listener, bounded around the app (which it wraps).

A client is its address (an IPv6 address by its /64) and, once its key is known, its
principal_ref. `ClientGuard` answers 429 `too_many_auth_failures` to an address that spent
`openai.auth_failures_per_minute` failed keys (before its key is looked at: `authfailures.py`),
and 429 `too_many_requests_in_flight` past `openai.max_requests_per_client` completion requests
in flight per address or per principal (anonymous ones by address only). Connections per
address are bounded by the HTTP server itself (`http/caps.py`). docs/reliability.md, "Hostile
peers" ("Guessing credentials", "Capacity held by clients that read nothing"), says why.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from iop.edgeconfig import ANONYMOUS_PRINCIPAL

from ..authenticating import Authenticator
from ..authfailures import AuthFailures, source_of, token_hint
from ..errors import EdgeError, TooManyRequests, Unauthorized
from .exchanges import Exchange
from .responses import answer_error

_PROBES: Final = frozenset({"/healthz", "/readyz"})
_BEARER: Final = b"bearer "


class ClientGuard:
    """`app` behind per-client bounds; see the module docstring."""

    def __init__(
        self,
        app: Callable[[Exchange], Awaitable[None]],
        authenticator: Authenticator,
        auth_failures: AuthFailures,
        *,
        max_requests_per_client: int,
    ) -> None:
        self._app = app
        self._authenticator = authenticator
        self.auth_failures = auth_failures
        self._max_requests = max_requests_per_client
        self._by_source: dict[str, int] = {}
        self._by_principal: dict[str, int] = {}
        #: Requests refused for holding too many in flight, by what held them (address,
        #: principal).
        self.refused: dict[str, int] = {"address": 0, "principal": 0}

    async def __call__(self, exchange: Exchange) -> None:
        path = exchange.path
        if path in _PROBES:
            await self._app(exchange)
            return
        client = exchange.client
        source = source_of(client[0]) if client else ""
        wait = self.auth_failures.retry_after(source)
        if wait is not None:
            answer_error(
                exchange,
                TooManyRequests(
                    "Too many failed authentications from your address; try again later.",
                    "too_many_auth_failures",
                    wait,
                ),
            )
            return
        if not path.startswith("/v1/"):
            await self._app(exchange)  # no API route: the app says 404
            return
        principal = self._principal(exchange, source)
        if exchange.method != "POST":
            await self._app(exchange)
            return
        refusal = self._hold(source, principal)
        if refusal is not None:
            answer_error(exchange, refusal)
            return
        try:
            await self._app(exchange)
        finally:
            self._release(source, principal)

    def _principal(self, exchange: Exchange, source: str) -> str | None:
        """The request's principal_ref when its key is known (anonymous: None); a key the
        Authenticator refuses counts as a failure of `source` (the app answers it 401)."""
        authorization = exchange.header(b"authorization")
        try:
            principal = exchange.principal = self._authenticator.authenticate(authorization)
        except Unauthorized:
            self.auth_failures.failed(source, *_failure(authorization))
            return None
        ref = principal.principal_ref
        return None if ref == ANONYMOUS_PRINCIPAL else ref

    def _hold(self, source: str, principal: str | None) -> EdgeError | None:
        limit = self._max_requests
        if self._by_source.get(source, 0) >= limit:
            self.refused["address"] += 1
            return _too_many(f"Your address has {limit} requests in flight")
        if principal is not None and self._by_principal.get(principal, 0) >= limit:
            self.refused["principal"] += 1
            return _too_many(f"Your principal has {limit} requests in flight")
        self._by_source[source] = self._by_source.get(source, 0) + 1
        if principal is not None:
            self._by_principal[principal] = self._by_principal.get(principal, 0) + 1
        return None

    def _release(self, source: str, principal: str | None) -> None:
        _decrement(self._by_source, source)
        if principal is not None:
            _decrement(self._by_principal, principal)


def _too_many(what: str) -> TooManyRequests:
    return TooManyRequests(
        f"{what}, the most one client may hold (openai.max_requests_per_client); wait for "
        "some to finish.",
        "too_many_requests_in_flight",
        1.0,
    )


def _failure(authorization: bytes | None) -> tuple[str, str]:
    """Why a request's key failed (a metric label), and what the log may say of the key."""
    if not authorization:
        return "missing", ""
    if authorization[:7].lower() != _BEARER:
        return "malformed", f"token sha256 {token_hint(authorization)}..."
    return "invalid", f"token sha256 {token_hint(authorization[7:].strip())}..."


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
