"""Tokens a config names by a Kubernetes Secret (`token_secret`) instead of by their SHA-256.

An EdgeConfig may say where a token lives (`nodes[].token_secret`, `openai.principal_tokens[]
.token_secret`, `edge.admin.token_secret`) so that nothing that renders it (a Helm chart, a
GitOps tool) has to draw a token or carry its hash. The operator reads those Secrets and writes
the Edge's config with every hash filled in and no `token_secret` left (`with_token_hashes`):
the Edge never reads a Secret, and refuses a config that still names one
(`require_token_hashes`). `token_sha256` is how a token becomes the hash a config holds,
for everyone who makes or checks one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from .configs import EdgeConfig
from .edgesections import AdminSection
from .errors import ConfigError, Problem
from .fields import SecretKeyRef
from .nodespecs import NodeSpec
from .openaisections import PrincipalToken


def token_sha256(token: str | bytes) -> str:
    """The SHA-256 of `token` (text as UTF-8), in lowercase hex: what `token_hash_sha256` holds."""
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()


#: Whose token a Secret holds.
TokenOwner = Literal["node", "principal", "admin"]


@dataclass(frozen=True, slots=True)
class TokenRef:
    """One `token_secret` of a config, and where it is."""

    owner: TokenOwner
    #: The node id, the principal token's token_ref, or "admin".
    owner_id: str
    #: Its path in the config (`nodes[0].token_secret`), for messages.
    path: str
    secret: SecretKeyRef

    @property
    def key(self) -> tuple[str, str]:
        """(Secret name, key): tokens are looked up by this."""
        return (self.secret.name, self.secret.key)


def token_refs(config: EdgeConfig) -> list[TokenRef]:
    """Every `token_secret` of `config`, in document order."""
    refs: list[TokenRef] = []
    admin = config.edge.admin.token_secret
    if admin is not None:
        refs.append(TokenRef("admin", "admin", "edge.admin.token_secret", admin))
    for index, entry in enumerate(config.openai.principal_tokens):
        if entry.token_secret is not None:
            path = f"openai.principal_tokens[{index}].token_secret"
            refs.append(TokenRef("principal", entry.token_ref, path, entry.token_secret))
    for index, node in enumerate(config.nodes):
        if node.token_secret is not None:
            refs.append(
                TokenRef("node", node.id, f"nodes[{index}].token_secret", node.token_secret)
            )
    return refs


def with_token_hashes(config: EdgeConfig, hashes: Mapping[tuple[str, str], str]) -> EdgeConfig:
    """`config` as the Edge runs it: each node's and principal token's `token_secret` replaced
    by the SHA-256 in `hashes` ((Secret name, key) -> hex digest), the admin API's dropped (the
    Edge reads its token from `token_file`). Raises KeyError for a Secret `hashes` lacks."""
    update: dict[str, object] = {}
    if config.edge.admin.token_secret is not None:
        admin = _without_secret(config.edge.admin, None)
        update["edge"] = config.edge.model_copy(update={"admin": admin})
    tokens = config.openai.principal_tokens
    if any(entry.token_secret is not None for entry in tokens):
        resolved_tokens = [
            _without_secret(entry, hashes[_key(entry.token_secret)])
            if entry.token_secret is not None
            else entry
            for entry in tokens
        ]
        update["openai"] = config.openai.model_copy(update={"principal_tokens": resolved_tokens})
    if any(node.token_secret is not None for node in config.nodes):
        update["nodes"] = [
            _without_secret(node, hashes[_key(node.token_secret)])
            if node.token_secret is not None
            else node
            for node in config.nodes
        ]
    return config.model_copy(update=update) if update else config


_Holder = TypeVar("_Holder", AdminSection, PrincipalToken, NodeSpec)


def _without_secret(model: _Holder, digest: str | None) -> _Holder:
    """`model` without its `token_secret`, and with `digest` as its token hash when given; built
    from what was set, so a dump with `exclude_unset` (the Edge's ConfigMap) names no Secret."""
    data = model.model_dump(exclude_unset=True)
    data.pop("token_secret", None)
    if digest is not None:
        data["token_hash_sha256"] = digest
    return type(model).model_validate(data)


def require_token_hashes(config: EdgeConfig) -> None:
    """Raise `ConfigError` naming each `token_secret` left in a config the Edge is to run."""
    problems = [
        Problem(
            ref.path,
            "names a Kubernetes Secret, which only the operator reads: the Edge needs "
            "token_hash_sha256 (the SHA-256 of the token) here instead",
        )
        for ref in token_refs(config)
        if ref.owner != "admin"
    ]
    if problems:
        raise ConfigError(problems)


def _key(ref: SecretKeyRef) -> tuple[str, str]:
    return (ref.name, ref.key)
