"""The tokens an EdgeConfig names by Secret: read, created when the spec says to, and hashed.

A spec may name a node's, a client's or the admin API's token by a Secret (`token_secret: {name,
key, generate}`) instead of by its SHA-256, so renders stay pure. The operator reads each named
Secret, creates the ones marked `generate` that are missing (a random token, owned by the
EdgeConfig, never changed again: deleting it rotates the token), and puts the hashes into the
Edge's config (`iop.edgeconfig.with_token_hashes`); raw tokens stay in memory only and are never
logged. A token read is checked before it is used (one line of printable ASCII, not empty,
bounded), and a bad one is reported by its Secret and key, never by its content. Secrets are
read by name and cached until their watch (`watching.py`) says they changed. docs/operator.md,
"Tokens in Secrets: renders stay pure", says why.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from iop.edgeconfig import (
    EdgeConfig,
    Problem,
    SecretKeyRef,
    TokenRef,
    camel_path,
    token_refs,
    token_sha256,
)

from . import conventions
from .documents import Owner
from .errors import KubeConflict
from .kubeapi import KubeApi, resource_path

#: Bytes of randomness in a generated token (URL-safe base64: 43 characters).
_TOKEN_BYTES: Final = 32
#: Longest token accepted from a Secret (a bearer token, sent in an HTTP or gRPC header).
MAX_TOKEN_CHARS: Final = 4096
_PRINTABLE: Final = frozenset(range(0x21, 0x7F))


def token_problem(raw: bytes) -> str | None:
    """What makes the bytes of a Secret's key unusable as a token (after the white space around
    it, which is dropped), or None. The answer never shows the content: a bad token may be a
    key or a certificate named by mistake."""
    value = raw.strip()
    if not value:
        return "is empty"
    if b"\n" in value or b"\r" in value:
        return "holds a line break"
    if len(value) > MAX_TOKEN_CHARS:
        return f"is longer than {MAX_TOKEN_CHARS} characters"
    if not set(value) <= _PRINTABLE:
        return "holds a character that is not printable ASCII (a space, a control character)"
    return None


def reserved_refs(config: EdgeConfig, reserved: Collection[str]) -> list[Problem]:
    """The token references of `config` that name a Secret no token may come from (the
    certificates the operator makes: a key is no token, and naming it must not send it
    anywhere), each with its path as the user wrote it."""
    return [
        Problem(
            camel_path(f"{ref.path}.name"),
            f"Secret {ref.secret.name} holds a certificate the operator made (the webhook's or "
            "the Node hub's), not a token; name a Secret of your own",
        )
        for ref in token_refs(config)
        if ref.secret.name in reserved
    ]


def admin_token_ref(config: EdgeConfig, edgeconfig_name: str) -> SecretKeyRef | None:
    """Where the operator reads the admin token: `edge.admin.token_secret`, else the Secret
    NAME-edge-admin (key `token`, generated when missing: the chart's Edge mounts that name);
    None when the admin API takes no token."""
    admin = config.edge.admin
    if admin.token_secret is not None:
        return admin.token_secret
    if not admin.token_hash_sha256 and not admin.token_file:
        return None
    return SecretKeyRef(
        name=conventions.admin_secret_name(edgeconfig_name),
        key=conventions.ADMIN_TOKEN_KEY,
        generate=True,
    )


@dataclass(frozen=True, slots=True)
class TokenRead:
    """What reading a config's token Secrets found."""

    #: (Secret name, key) -> SHA-256 hex of the token.
    hashes: Mapping[tuple[str, str], str]
    #: The admin token itself (in memory only), or None when there is none to send.
    admin_token: str | None
    #: What is missing and not to be generated, each naming the Secret and who needs it (a
    #: token to generate that `generate=False` left alone is simply absent from `hashes`).
    missing: Sequence[str]
    #: Tokens that cannot be one (`token_problem`), each naming the Secret, key and who needs
    #: it, never the content; absent from `hashes` (and not the `admin_token`).
    invalid: Sequence[str]
    #: Secrets (and keys) created this time, for the Events.
    created: Sequence[str]
    #: Every Secret read, to watch.
    names: frozenset[str]


@dataclass(slots=True)
class SecretCache:
    """Secrets as last read: name -> data (base64 values), or None for one that does not exist.
    An entry is dropped when the Secret's watch reports a change."""

    entries: dict[str, Mapping[str, str] | None] = field(default_factory=dict)

    def forget(self, name: str) -> None:
        self.entries.pop(name, None)


async def read_tokens(
    api: KubeApi,
    owner: Owner,
    config: EdgeConfig,
    cache: SecretCache,
    *,
    generate: bool = True,
) -> TokenRead:
    """Read (and, with `generate`, create) every token Secret of `config`, and the admin one."""
    refs = token_refs(config)
    admin = admin_token_ref(config, owner.name)
    described = _described(refs, admin, config)
    by_name: dict[str, list[SecretKeyRef]] = {}
    for ref in described:
        by_name.setdefault(ref.secret.name, []).append(ref.secret)
    created: list[str] = []
    for name, keys in by_name.items():
        if name not in cache.entries:
            cache.entries[name] = await _read(api, owner.namespace, name)
        absent = sorted(
            {k.key for k in keys if k.generate and k.key not in (cache.entries[name] or {})}
        )
        if absent and generate:
            cache.entries[name] = await _generate(api, owner, name, absent, cache.entries[name])
            created.append(f"Secret {name} ({', '.join(absent)})")
    values: dict[tuple[str, str], str] = {}
    missing: list[str] = []
    invalid: list[str] = []
    for ref in described:
        data = cache.entries.get(ref.secret.name)
        encoded = (data or {}).get(ref.secret.key)
        if encoded is None:
            if not ref.secret.generate:  # (one to generate is made by the reconcile, not here)
                what = "does not exist" if data is None else f"has no key {ref.secret.key}"
                missing.append(f"Secret {ref.secret.name} (named by {ref.path}) {what}")
            continue
        raw = base64.b64decode(encoded)
        problem = token_problem(raw)
        if problem is not None:
            invalid.append(
                f"Secret {ref.secret.name} key {ref.secret.key} (named by {camel_path(ref.path)}) "
                f"{problem}: a token is one line of printable ASCII"
            )
            continue
        values[(ref.secret.name, ref.secret.key)] = raw.strip().decode("ascii")
    admin_token = values.get((admin.name, admin.key)) if admin is not None else None
    return TokenRead(
        hashes={key: token_sha256(value) for key, value in values.items()},
        admin_token=admin_token,
        missing=missing,
        invalid=invalid,
        created=created,
        names=frozenset(by_name),
    )


def _described(
    refs: Iterable[TokenRef], admin: SecretKeyRef | None, config: EdgeConfig
) -> list[TokenRef]:
    found = list(refs)
    if admin is not None and config.edge.admin.token_secret is None:
        found.append(TokenRef("admin", "admin", "the admin API (Secret NAME-edge-admin)", admin))
    return found


async def _read(api: KubeApi, namespace: str, name: str) -> Mapping[str, str] | None:
    secret = await api.find(
        resource_path("v1", "secrets", namespace, name), what=f"read the token Secret {name}"
    )
    if secret is None:
        return None
    data: Mapping[str, str] = secret.get("data") or {}
    return data


async def _generate(
    api: KubeApi,
    owner: Owner,
    name: str,
    keys: Sequence[str],
    existing: Mapping[str, str] | None,
) -> Mapping[str, str]:
    """Create Secret `name` with a random token under each of `keys`, or add them to it; the
    data as it now is. Another writer racing us (a second operator replica) wins: its tokens
    are read back instead."""
    fresh = {key: _encode(secrets.token_urlsafe(_TOKEN_BYTES)) for key in keys}
    path = resource_path("v1", "secrets", owner.namespace)
    if existing is None:
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": owner.namespace,
                "labels": owner.labels(),
                "annotations": {
                    "iop.dev/generated": "tokens made by the operator; delete to rotate"
                },
                "ownerReferences": [owner.reference()],
            },
            "type": "Opaque",
            "data": fresh,
        }
        try:
            made = await api.create(path, body, what=f"create the token Secret {name}")
        except KubeConflict:
            return await _read(api, owner.namespace, name) or {}
        data: Mapping[str, str] = made.get("data") or {}
        return data
    # Add only the missing keys; a JSON merge patch leaves the others alone.
    patched = await api.merge_patch(
        resource_path("v1", "secrets", owner.namespace, name),
        {"data": fresh},
        what=f"add token keys to the Secret {name}",
    )
    data = patched.get("data") or {}
    return data


def _encode(token: str) -> str:
    return base64.b64encode(token.encode()).decode()
