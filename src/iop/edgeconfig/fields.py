"""What every section of the EdgeConfig model is made of: apply markers, value types, the base.

YAML keeps the spec's snake_case; the same model accepts camelCase (the Kubernetes spelling)
through aliases. Every field says what it controls and how a change to it is applied; the
`x-iop-apply` marker on a field is what the change classifier reads, so the description and the
classification can never disagree. A marker holds for everything beneath the field unless a
nested field carries its own.

The model checks each value on its own (types, bounds, formats). Checks that relate values to
each other (unique ids, references, the long-context budget) live in `validating.py`.
"""

from __future__ import annotations

import ipaddress
import re
from functools import cache
from typing import Annotated, Any, Final

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from iop.aiokits import split_listener

#: The JSON-schema key each field's apply marker (live / restart:edge / restart:node) sits under.
APPLY_KEY: Final = "x-iop-apply"
#: The JSON-schema key marking a list whose order means something (`models[].fallbacks`): hashing
#: and classification keep its order, where other lists of names are compared as sets.
ORDERED_KEY: Final = "x-iop-ordered"

LIVE: Final = "live"
RESTART_EDGE: Final = "restart:edge"
RESTART_NODE: Final = "restart:node"

_SUFFIX = {
    LIVE: "Live: a change applies without a restart.",
    RESTART_EDGE: "Restart-required: a change rolls the Edge.",
    RESTART_NODE: "Restart-required: a change rolls this node's workload.",
}


def _field(apply: str, description: str, *, ordered: bool = False, **constraints: Any) -> FieldInfo:
    extra: dict[str, Any] = {APPLY_KEY: apply}
    if ordered:
        extra[ORDERED_KEY] = True
    info: FieldInfo = Field(
        description=f"{description} {_SUFFIX[apply]}", json_schema_extra=extra, **constraints
    )
    return info


def is_ordered(field: FieldInfo) -> bool:
    """True for a list field whose order means something (see `ORDERED_KEY`)."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get(ORDERED_KEY) is True


def live(description: str, **constraints: Any) -> FieldInfo:
    """A field whose changes apply live."""
    return _field(LIVE, description, **constraints)


def restart_edge(description: str, **constraints: Any) -> FieldInfo:
    """A field whose changes need the Edge to restart."""
    return _field(RESTART_EDGE, description, **constraints)


def restart_node(description: str, **constraints: Any) -> FieldInfo:
    """A field whose changes need the owning node's workload to restart."""
    return _field(RESTART_NODE, description, **constraints)


# -- value types ---------------------------------------------------------------------------------

_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
_MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}$"
_SHA256_PATTERN = r"^[0-9a-f]{64}$"
_ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
URL_PATH_PATTERN = r"^/[^\s?#]*$"
_SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
_SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]{1,253}$"
TIME_OF_DAY_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
REDIS_URL_PATTERN = r"^(|rediss?://[^\s@/]+(/[0-9]{1,2})?)$"

#: Patterns whose mismatch gets a sentence of its own instead of pydantic's regex dump.
PATTERN_MESSAGES: Final = {
    _NAME_PATTERN: "must be a DNS label: lowercase letters, digits and '-', at most 63 characters",
    _MODEL_ID_PATTERN: "must start with a letter or digit and use only letters, digits and ._:/@+-",
    _SHA256_PATTERN: "must be 64 lowercase hex characters: the SHA-256 of the token, never the "
    'token itself (printf %s "$TOKEN" | sha256sum)',
    _ENV_NAME_PATTERN: "must be an environment variable name (letters, digits, '_')",
    URL_PATH_PATTERN: "must be a URL path starting with '/', without spaces, query or fragment",
    _SECRET_NAME_PATTERN: "must be a Kubernetes object name: lowercase letters, digits, '-', '.'",
    _SECRET_KEY_PATTERN: "must be a Secret key: letters, digits, '-', '_' and '.'",
    TIME_OF_DAY_PATTERN: "must be a time of day as HH:MM (24-hour, UTC), for example 00:00",
    REDIS_URL_PATTERN: "must be redis://host:port or rediss://host:port (TLS), optionally "
    "with /db, and no credentials (the password goes in password_env)",
}

Name = Annotated[str, Field(pattern=_NAME_PATTERN)]
ModelId = Annotated[str, Field(pattern=_MODEL_ID_PATTERN)]
Sha256Hex = Annotated[str, Field(pattern=_SHA256_PATTERN)]
EnvName = Annotated[str, Field(pattern=_ENV_NAME_PATTERN)]


def _check_listener(value: str) -> str:
    split_listener(value)
    return value


def _check_optional_listener(value: str) -> str:
    return _check_listener(value) if value else value


def _check_url(value: str) -> str:
    if value and not re.fullmatch(r"https?://[^\s/$.?#][^\s]*", value):
        raise ValueError("must be an http:// or https:// URL")
    return value


def is_loopback_listener(listen: str) -> bool:
    """True when `listen` binds only the loopback interface."""
    host, _ = split_listener(listen)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


Listener = Annotated[str, AfterValidator(_check_listener)]
OptionalListener = Annotated[str, AfterValidator(_check_optional_listener)]
Url = Annotated[str, AfterValidator(_check_url)]


@cache
def camel_name(name: str) -> str:
    """The camelCase spelling of a field (the CRD's): `long_context_slots` -> `longContextSlots`.

    Only underscores start a new word, so `a2a` stays `a2a` (pydantic's `to_camel` would give
    `a2A`, capitalising after the digit). Cached: the cross-reference checks ask it for every
    optional field a node's provider leaves out, thousands of times per large config.
    """
    first, *rest = name.split("_")
    return first + "".join(word[:1].upper() + word[1:] for word in rest)


def camel_path(path: str) -> str:
    """A config path in the CRD's spelling: `nodes[node-1].providers[a].adapter.latency_ms` ->
    `nodes[node-1].providers[a].adapter.latencyMs` (ids in brackets are left as they are)."""
    parts = re.split(r"(\[[^\]]*\])", path)
    return "".join(
        part if part.startswith("[") else ".".join(camel_name(name) for name in part.split("."))
        for part in parts
    )


class Spec(BaseModel):
    """Base of every config section: immutable, strict about unknown keys, snake or camel."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=camel_name,
        validate_by_name=True,
        validate_by_alias=True,
        use_attribute_docstrings=False,
    )

    def __eq__(self, other: object) -> bool:
        # A live change to a config of thousands of nodes compares tens of thousands of
        # sections (the classification, the hub's and the pool's snapshots).
        same = fields_equal(self, other)
        return super().__eq__(other) if same is None else same

    __hash__ = BaseModel.__hash__


def fields_equal(model: BaseModel, other: object) -> bool | None:
    """pydantic's comparison of two models without extra values, sped up, or None when only
    pydantic's own can tell. pydantic looks at the generic origin and the private and extra
    values first; with no private attributes and nothing cached beside its fields (no extra
    values: `extra="forbid"` or "ignore"), a model's fields are its `__dict__`."""
    if type(other) is not type(model) or model.__private_attributes__:
        return None
    mine, theirs = model.__dict__, other.__dict__
    if mine == theirs:
        return True
    if len(mine) == len(theirs) == len(type(model).__pydantic_fields__):
        return False
    return None


# -- tokens held in Kubernetes Secrets ----------------------------------------------------------


class SecretKeyRef(Spec):
    """A key of a Kubernetes Secret, in the EdgeConfig's namespace, that holds a token.

    Only the operator reads it: it hashes the token into the Edge's config (the Edge never sees a
    raw token, and never reads Secrets), so a Helm render carries no token and no hash of one.
    The reference is not part of the Edge's config, so changing it restarts nothing by itself;
    the token it leads to counts as the `token_hash_sha256` beside it, whose marker says what a
    different token restarts.
    """

    name: Annotated[
        str,
        live("Name of the Secret, in the EdgeConfig's namespace.", pattern=_SECRET_NAME_PATTERN),
    ]
    key: Annotated[
        str,
        live("The key of the Secret's data that holds the token.", pattern=_SECRET_KEY_PATTERN),
    ] = "token"
    generate: Annotated[
        bool,
        live(
            "When the Secret or its key does not exist, the operator creates it with a random "
            "token (owned by the EdgeConfig) and never changes it afterwards; delete the Secret "
            "to rotate the token. false: the Secret is the user's, and while it is missing the "
            "change waits for it."
        ),
    ] = False


def one_token_source(owner: str, digest: str | None, secret: SecretKeyRef | None) -> None:
    """Refuse a token given both ways, or neither: as its SHA-256, or as a Secret to hash."""
    if (digest is None) == (secret is None):
        raise ValueError(
            f"{owner} needs exactly one of token_hash_sha256 (the SHA-256 of its token) and "
            "token_secret (a Kubernetes Secret the operator hashes)"
        )
