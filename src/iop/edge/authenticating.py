"""Client auth: a bearer token is known only by its SHA-256, and maps to whom usage bills.

The config holds `openai.principal_tokens[]` (token_ref, token_hash_sha256, principal_ref), never
a raw token. A request's token is hashed and looked up by its hash; the final comparison is
`hmac.compare_digest`. The lookup itself keys on the hash, so its timing can only say something
about the SHA-256 of a guess, which reveals nothing about a valid token. The raw token is never
stored, logged or put in a metric label; only `token_ref` and `principal_ref` are.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Final

from iop.edgeconfig import ANONYMOUS_PRINCIPAL, OpenAISection, token_sha256

from .errors import Unauthorized


@dataclass(frozen=True, slots=True)
class Principal:
    """Whom a request's usage counts for."""

    principal_ref: str
    token_ref: str


#: The principal of requests without a token, when `openai.allow_unauthenticated` is on.
ANONYMOUS: Final = Principal(ANONYMOUS_PRINCIPAL, ANONYMOUS_PRINCIPAL)

_BEARER: Final = b"bearer "


class Authenticator:
    """Maps an `Authorization` header to a `Principal`, or raises `Unauthorized`."""

    def __init__(self, section: OpenAISection) -> None:
        self._allow_unauthenticated = section.allow_unauthenticated
        self._by_hash: dict[str, tuple[bytes, Principal]] = {
            entry.token_hash_sha256: (
                entry.token_hash_sha256.encode(),
                Principal(entry.principal_ref, entry.token_ref),
            )
            for entry in section.principal_tokens
            if entry.token_hash_sha256 is not None  # a config the Edge runs has every hash
        }

    def authenticate(self, authorization: bytes | None) -> Principal:
        """The principal of a request, from its raw `Authorization` header value (or None)."""
        if not authorization:
            if self._allow_unauthenticated:
                return ANONYMOUS
            raise Unauthorized(
                "You didn't provide an API key. Send it in the Authorization header as "
                "'Authorization: Bearer YOUR_KEY'.",
                missing=True,
            )
        if authorization[:7].lower() != _BEARER:
            raise Unauthorized("The Authorization header must be 'Bearer YOUR_KEY'.", missing=False)
        token = authorization[7:].strip()
        digest = token_sha256(token)
        found = self._by_hash.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest.encode()):
            raise Unauthorized("Incorrect API key provided.", missing=False)
        return found[1]
