"""What counts as a secret in a config: one definition, for refusing, redacting and logging.

Raw secrets never belong in a config (clients and nodes are known by the SHA-256 of their
tokens, API keys by the name of the variable that holds them), so loading refuses keys named
like a raw secret and values shaped like one. Fields that hold secret material legitimately
(hashes) or are named like it are never echoed: not in a problem, not in `GET /config`.
"""

from __future__ import annotations

import re
from typing import Final

#: Keys that would hold a raw secret (compared after `normalized_key`): refused at load.
RAW_SECRET_KEYS: Final = frozenset(
    {"token", "apikey", "password", "secret", "bearertoken", "rawtoken"}
)

#: Values shaped like a raw API key or bearer token: refused at load.
RAW_SECRET_VALUE: Final = re.compile(r"^(sk-[A-Za-z0-9_-]{8,}|Bearer\s+\S+)")

# A field whose value is never shown: named like a token, secret, password or key, or a hash.
_SECRET_FIELD: Final = re.compile(r"(token|secret|password|key)$|sha256", re.IGNORECASE)


def normalized_key(key: str) -> str:
    """`api_key`, `apiKey` and `api-key` all become `apikey`."""
    return key.replace("_", "").replace("-", "").lower()


def is_secret_field(name: str) -> bool:
    """True when the value of field `name` must never be echoed (problems, logs, GET /config)."""
    return _SECRET_FIELD.search(name) is not None
