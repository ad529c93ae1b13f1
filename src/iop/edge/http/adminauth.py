"""Who may use the admin API: `AdminAuth` checks a bearer token's SHA-256 against
`edge.admin.token_hash_sha256` or `token_file`'s, in constant time; with neither the API is
open, on loopback only (docs/refresh.md, "The admin API").
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from pathlib import Path
from typing import Final

from iop.edgeconfig import AdminSection, is_loopback_listener, token_sha256

from ..errors import Unauthorized

logger = logging.getLogger(__name__)

_BEARER: Final = b"bearer "
#: A changed token file is looked for at most this often (only when a token did not match).
_TOKEN_FILE_RECHECK_S: Final = 1.0


class AdminAuthError(ValueError):
    """The admin API cannot start: open off loopback, or its token file is unusable."""


class AdminAuth:
    """The accepted token hashes (none: the API is open, loopback only), by credential name.

    A token file is read at start and again when a token does not match and the file has
    changed since (at most once a second): a Secret mounted there that someone rotates (the
    kubelet swaps the file) is accepted without a restart, and the old token stops working.
    """

    def __init__(
        self, hashes: tuple[tuple[str, bytes], ...] = (), token_file: Path | None = None
    ) -> None:
        self.hashes = hashes
        self._token_file = token_file
        self._stamp = _file_stamp(token_file) if token_file is not None else None
        self._looked_at = 0.0

    @classmethod
    def load(cls, section: AdminSection, listen: str) -> AdminAuth:
        """The auth of `section`, served on `listen`; reads and hashes the token file now."""
        hashes: list[tuple[str, bytes]] = []
        if section.token_hash_sha256:
            hashes.append(("token_hash_sha256", section.token_hash_sha256.encode()))
        token_file = Path(section.token_file) if section.token_file else None
        if token_file is not None:
            hashes.append(("token_file", _hash_file(token_file)))
        if not hashes and not is_loopback_listener(listen):
            raise AdminAuthError(
                f"the admin API would listen on {listen}, off loopback, without auth: set "
                "edge.admin.token_hash_sha256 or edge.admin.token_file"
            )
        return cls(tuple(hashes), token_file)

    @property
    def required(self) -> bool:
        return bool(self.hashes)

    async def admit(self, authorization: bytes | None) -> str:
        """`check`, after reading a changed token file again when the token did not match."""
        try:
            return self.check(authorization)
        except Unauthorized:
            if self._token_file is None or not await self._reload():
                raise
        return self.check(authorization)

    def check(self, authorization: bytes | None) -> str:
        """Which credential the request's bearer token matched; raises `Unauthorized`."""
        if not self.hashes:
            return "no auth (loopback)"
        if not authorization or authorization[:7].lower() != _BEARER:
            raise Unauthorized(
                "send 'Authorization: Bearer TOKEN'", missing=True, code="unauthorized"
            )
        digest = token_sha256(authorization[7:].strip()).encode()
        matched = ""
        for name, expected in self.hashes:  # compare with every one: the same time either way
            if hmac.compare_digest(digest, expected):
                matched = name
        if not matched:
            raise Unauthorized("wrong admin token", missing=False, code="unauthorized")
        return f"admin token ({matched})"

    async def _reload(self) -> bool:
        """Read the token file again if it changed; whether the hashes changed."""
        assert self._token_file is not None
        moment = time.monotonic()
        if moment - self._looked_at < _TOKEN_FILE_RECHECK_S:
            return False
        self._looked_at = moment
        path = self._token_file
        stamp = await asyncio.to_thread(_file_stamp, path)
        if stamp == self._stamp:
            return False
        try:
            digest = await asyncio.to_thread(_hash_file, path)
        except AdminAuthError as error:
            logger.warning("the admin token file changed but cannot be used: %s", error)
            return False
        self._stamp = stamp
        self.hashes = (*[h for h in self.hashes if h[0] != "token_file"], ("token_file", digest))
        logger.info("edge.admin.token_file %s changed: the new token is accepted", path)
        return True


def _file_stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return (info.st_ino, info.st_mtime_ns, info.st_size)


def _hash_file(path: Path) -> bytes:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminAuthError(f"cannot read edge.admin.token_file {path}: {exc}") from exc
    if not token:
        raise AdminAuthError(f"edge.admin.token_file {path} is empty")
    return token_sha256(token).encode()
