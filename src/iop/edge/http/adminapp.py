"""The admin HTTP API: live refresh and the config in use, an operator-local surface.

Served on `edge.admin.listen` (loopback by default) by a second HTTP server of the Edge
process (`http/server.py`), an app like the OpenAI API: `POST /refresh` (the `Refresher`'s report),
`GET /config` (secrets redacted), `GET /status` (each node, its providers' health and load,
dispatch, limits), `GET /refresh/last` and `GET /healthz`; errors in OpenAI's shape with the
admin API's own `code` (`responses.py`); who may use it: `adminauth.py`; what `/status` and
`/config` answer: `statusdocument.py`. docs/refresh.md, "The admin API", documents every
route and answer.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Final, Literal, Self, TypeVar
from urllib.parse import parse_qs

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import (
    BadRequest,
    Conflict,
    EdgeError,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
)
from ..hub import Hub
from ..limits import Limiter
from ..refresh import ConfigFileRefused, ConfigSource, NoCandidate, Refresher
from .adminauth import AdminAuth
from .exchanges import ClientGone, Exchange
from .responses import answer_error, report_status
from .statusdocument import redacted, status_document

logger = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=BaseModel)
_NODE_SCOPE: Final = re.compile(r"^node:[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


#: Largest `POST /refresh` body: a config with thousands of nodes fits with room to spare.
MAX_BODY_BYTES: Final = 64 * 1024 * 1024


class RefreshBody(BaseModel):
    """The body of `POST /refresh`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["dry_run", "apply"]
    config: dict[str, Any] | None = None
    config_yaml: str | None = None
    path: str | None = None
    #: A revision this Edge keeps (`GET /revisions`): its config again.
    revision: Annotated[int, Field(ge=1)] | None = None
    #: `node:<id>` restart scopes the caller restarts itself. The Edge cannot restart itself
    #: through its own API, so scope `edge` is not accepted here.
    restarting: tuple[str, ...] = ()
    #: Node id (of a `restarting` scope) -> the instance ids of the processes its restart
    #: replaces: only those are held; another process of the node is past its restart.
    replacing: dict[str, tuple[str, ...]] = {}

    @field_validator("restarting")
    @classmethod
    def _node_scopes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for scope in value:
            if scope == "edge":
                raise ValueError(
                    "scope edge: the Edge cannot restart itself through its admin API; "
                    "restarting takes node:<id> scopes (the caller restarts those nodes)"
                )
            if not _NODE_SCOPE.match(scope):
                raise ValueError(f"{scope!r} is not a scope: use node:<id> (a node's id)")
        return value

    @field_validator("path")
    @classmethod
    def _plain_path(cls, value: str | None) -> str | None:
        if value is not None and "\x00" in value:
            raise ValueError("the path contains a NUL byte")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        sources = ("config", "config_yaml", "path", "revision")
        given = [name for name in sources if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(
                f"give at most one of config, config_yaml, path and revision, not {given}"
            )
        for node_id in self.replacing:
            if f"node:{node_id}" not in self.restarting:
                raise ValueError(
                    f"replacing names node {node_id!r}, which restarting does not "
                    f"(add node:{node_id}, or leave it out of replacing)"
                )
        return self


class RolloutBody(BaseModel):
    """The body of `POST /rollout`: end the watch of the candidate by hand."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    action: Literal["promote", "roll_back"]


class AdminApp:
    """The admin API's app (`await app(exchange)`)."""

    def __init__(
        self,
        refresher: Refresher,
        auth: AdminAuth,
        hub: Hub | None = None,
        limiter: Limiter | None = None,
    ) -> None:
        self._refresher = refresher
        self._auth = auth
        self._hub = hub
        self._limiter = limiter

    async def __call__(self, exchange: Exchange) -> None:
        try:
            await self._http(exchange)
        except EdgeError as error:
            answer_error(exchange, error)

    async def _http(self, exchange: Exchange) -> None:
        path = exchange.path
        method = exchange.method
        allowed = {
            "/refresh": "POST",
            "/config": "GET",
            "/status": "GET",
            "/refresh/last": "GET",
            "/revisions": "GET",
            "/rollout": "POST",
            "/healthz": "GET",
        }
        wanted = allowed.get(path)
        if wanted is None:
            raise RouteNotFound(f"no route {method} {path}", code="not_found")
        if method != wanted:
            raise MethodNotAllowed(f"use {wanted} {path}", wanted, code="method_not_allowed")
        if path == "/healthz":
            exchange.respond(200, b'{"status":"ok"}')
            return
        who = await self._auth.admit(exchange.header(b"authorization"))
        client = exchange.client
        peer = f"{client[0]}:{client[1]}" if client else "unknown peer"
        if path == "/refresh":
            await self._refresh(exchange, f"{peer}, {who}")
        elif path == "/config":
            snapshot = self._refresher.current
            document = {
                "config_hash": snapshot.config_hash,
                "generation": snapshot.generation,
                "config": redacted(snapshot.config),
            }
            exchange.respond(200, orjson.dumps(document))
        elif path == "/revisions":
            exchange.respond(200, orjson.dumps(self._refresher.rollouts.status()))
        elif path == "/rollout":
            await self._rollout(exchange, f"{peer}, {who}")
        elif path == "/status":
            status = status_document(self._refresher, self._hub)
            if self._limiter is not None:
                status["limits"] = await self._limiter.status()
            exchange.respond(200, orjson.dumps(status))
        else:
            query = parse_qs(exchange.query.decode("latin-1"))
            mode = query.get("mode", [""])[0]
            if mode not in ("", "apply"):
                raise BadRequest("mode may only be 'apply'", code="bad_request")
            report = self._refresher.last("apply" if mode else None)
            if report is None:
                raise RouteNotFound("no refresh has run since the Edge started", code="no_refresh")
            exchange.respond(200, orjson.dumps(report.as_dict()))

    async def _rollout(self, exchange: Exchange, who: str) -> None:
        body = _parse(RolloutBody, await _read_body(exchange), "rollout")
        rollouts = self._refresher.rollouts
        try:
            if body.action == "promote":
                revision = await rollouts.promote(who)
            else:
                revision = await rollouts.roll_back(who)
        except NoCandidate as none:
            raise Conflict(str(none), code="no_candidate") from none
        exchange.respond(200, orjson.dumps(revision.as_dict()))

    async def _refresh(self, exchange: Exchange, who: str) -> None:
        body = _parse(RefreshBody, await _read_body(exchange), "refresh")
        if body.revision is not None:
            kept = self._refresher.rollouts.log.get(body.revision)
            if kept is None or kept.config is None:
                log = self._refresher.rollouts.log
                numbers = [r.number for r in log]
                with_config = ", ".join(str(r.number) for r in log if r.config is not None)
                raise RouteNotFound(
                    f"revision {body.revision} cannot be applied again here: the Edge keeps "
                    f"revisions {numbers[0]}-{numbers[-1]}, the configs of {with_config}",
                    code="no_revision",
                )
            candidate = ConfigSource.of_data(kept.config, label=f"revision {kept.number}")
        elif body.config is not None:
            candidate = ConfigSource.of_data(body.config)
        elif body.config_yaml is not None:
            candidate = ConfigSource.of_text(body.config_yaml)
        elif body.path is not None:
            candidate = ConfigSource.of_path(body.path)
        elif self._refresher.config_path is not None:
            candidate = ConfigSource.of_path(self._refresher.config_path)
        else:
            raise BadRequest(
                "this Edge was not started from a file: send config, config_yaml or path",
                code="bad_request",
            )
        try:
            report = await self._refresher.refresh(
                body.mode,
                candidate,
                requested_by=who,
                restarting=body.restarting,
                replacing=body.replacing,
            )
        except ConfigFileRefused as refused:
            raise BadRequest(f"path refused: {refused}", code="bad_request") from refused
        exchange.respond(report_status(report), orjson.dumps(report.as_dict()))


def _parse(model: type[_Body], raw: bytes, what: str) -> _Body:
    """`raw` as a `model`, or a 400 that names each wrong field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors(include_url=False, include_input=False)
        )
        raise BadRequest(f"malformed {what} request: {problems}", code="bad_request") from exc


async def _read_body(exchange: Exchange) -> bytes:
    def too_large() -> PayloadTooLarge:
        return PayloadTooLarge(f"the body is larger than {MAX_BODY_BYTES} bytes", code="too_large")

    try:
        return await exchange.read_body(MAX_BODY_BYTES, too_large)
    except ClientGone:
        raise BadRequest("the client went away", code="bad_request") from None
