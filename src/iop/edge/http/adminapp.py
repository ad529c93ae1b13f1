"""The admin HTTP API: live refresh and the config in use, an operator-local surface.

Served on `edge.admin.listen` (loopback by default) by a second HTTP server of the Edge
process (`http/server.py`), an app like the OpenAI API: `POST /refresh` (the `Refresher`'s report),
`GET /config` (secrets redacted), `GET /status` (each node, its providers' health and load,
dispatch, limits), `GET /refresh/last` and `GET /healthz`; errors in OpenAI's shape with the
admin API's own `code` (`responses.py`). `AdminAuth` checks a bearer token's SHA-256 against
`edge.admin.token_hash_sha256` or `token_file`'s, in constant time; with neither the API is open,
on loopback only. docs/refresh.md, "The admin API", documents every route and answer.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Self, TypeVar
from urllib.parse import parse_qs

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from iop.edgeconfig import (
    AdminSection,
    EdgeConfig,
    is_loopback_listener,
    is_secret_field,
    token_sha256,
)

from ..errors import (
    BadRequest,
    Conflict,
    EdgeError,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
    Unauthorized,
)
from ..hub import Hub, NodeStatus, ProviderLink, provider_health
from ..limits import Limiter
from ..pool import Dispatcher
from ..refresh import ConfigFileRefused, ConfigSource, NoCandidate, Refresher
from .exchanges import ClientGone, Exchange
from .responses import answer_error, report_status

logger = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=BaseModel)
_NODE_SCOPE: Final = re.compile(r"^node:[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


#: Largest `POST /refresh` body: a config with thousands of nodes fits with room to spare.
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
_REDACTED: Final = "<redacted>"
#: Keys whose values are credentials or their hashes (`token_ref`, `token_file`, `api_key_env`
#: name things and stay).
_URL_USERINFO: Final = re.compile(r"(?<=://)[^/@\s]+@")
#: Every query value of a URL (`?api_key=...`, `&token=...`): any of them may be a credential.
_URL_QUERY_VALUE: Final = re.compile(r"(?<=[?&])([^=&#\s]*)=[^&#\s]*")
#: A fragment may carry a credential too (`#access_token=...`).
_URL_FRAGMENT: Final = re.compile(r"#\S*$")
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
            status = self._status_document()
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

    def _status_document(self) -> dict[str, Any]:
        """The refresher's status (the config in use; each node's payload: current or not) with
        each node's instances, drain and providers' health."""
        document = self._refresher.status()
        snapshot = self._refresher.current
        connected = self._hub.nodes() if self._hub is not None else {}
        links = self._hub.connected_providers() if self._hub is not None else {}
        nodes_of = {pid: limits.node_id for pid, limits in snapshot.providers.items()}
        health = provider_health(nodes_of, links)
        providers_of = {node.id: node.providers for node in snapshot.config.nodes}
        dispatcher = self._refresher.dispatcher
        for entry in document["nodes"]:
            node_id = entry["node_id"]
            providers = sorted(providers_of[node_id], key=lambda p: p.id)
            entry.update(
                _node_status(node_id, connected.get(node_id), [health[p.id] for p in providers])
            )
            for provider in entry["providers"]:
                provider["load"] = _load_status(dispatcher, provider["provider_id"])
        document["dispatch"] = _dispatch_status(dispatcher)
        document["priority_classes"] = _priority_status(dispatcher)
        return document

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


def _node_status(
    node_id: str, status: NodeStatus | None, providers: list[ProviderLink]
) -> dict[str, Any]:
    """One node of `GET /status`."""
    document: dict[str, Any] = {
        "node_id": node_id,
        "connected": status is not None,
        "ready": status is not None and status.ready,
        "instance_id": status.instance_id if status is not None else "",
        "applied_generation": status.applied_generation if status is not None else 0,
        "applied_hash": status.applied_hash if status is not None else "",
        "runs_in_flight": status.runs_in_flight if status is not None else 0,
        "draining": status is not None and status.draining,
        "shutting_down": status is not None and status.drain.shutting_down,
        "draining_runs": status.draining_runs() if status is not None else {},
        "superseded": [
            {
                "instance_id": older.instance_id,
                "runs_in_flight": older.runs_in_flight,
                "shutting_down": older.drain.shutting_down,
                "draining_runs": dict(older.drain.runs_left),
            }
            for older in (status.superseded if status is not None else ())
        ],
        "providers": [
            {
                "provider_id": link.provider_id,
                "healthy": link.healthy,
                "reason": link.reason,
                "detail": _redact(link.detail),
            }
            for link in providers
        ],
    }
    return document


def _load_status(dispatcher: Dispatcher, provider_id: str) -> dict[str, Any]:
    """One provider's load in `GET /status`: what least_load reads and where it comes from."""
    report = dispatcher.reported_load(provider_id)
    server = report.server if report is not None else None
    return {
        "load": dispatcher.load(provider_id),
        "edge_in_flight": dispatcher.in_flight(provider_id),
        "node_in_flight": report.node_in_flight if report is not None else None,
        "other_edges_in_flight": report.elsewhere if report is not None else None,
        "reported_s_ago": (
            round(time.monotonic() - report.reported_at, 3) if report is not None else None
        ),
        "server": (
            {
                "running": server.running,
                "waiting": server.waiting,
                "not_ours": server.not_ours,
                "kv_cache_usage": round(server.kv_cache_usage, 4),
                "age_s": round(server.age_s, 3),
                **(
                    {
                        "running_adapters": list(server.running_adapters),
                        "waiting_adapters": list(server.waiting_adapters),
                        "max_loras": server.max_loras,
                    }
                    if server.max_loras
                    else {}
                ),
            }
            if server is not None
            else None
        ),
        **_adapter_status(dispatcher, provider_id),
    }


def _adapter_status(dispatcher: Dispatcher, provider_id: str) -> dict[str, Any]:
    """What this Edge knows of a provider's LoRA adapters: its runs by adapter, the adapters it
    sent there lately (latest last); nothing for a provider that never ran one."""
    runs, recent = dispatcher.adapter_runs(provider_id)
    if not recent:
        return {}
    return {"edge_adapter_runs": dict(runs), "edge_recent_adapters": list(recent)}


def _dispatch_status(dispatcher: Dispatcher) -> dict[str, Any]:
    """`dispatch` in `GET /status`: each model's policy and the choices it made, by reason."""
    decisions: dict[str, dict[str, int]] = {}
    for (model_id, policy, reason), count in dispatcher.decisions().items():
        key = f"{policy}/{reason}"
        decisions.setdefault(model_id, {})[key] = count
    waiting: dict[str, dict[str, int]] = {}
    for (model_id, name), count in dispatcher.queue_depths_by_class().items():
        waiting.setdefault(model_id, {})[name] = count
    return {
        model_id: {
            "policy": pool_model.dispatch.policy,
            "load_factor": pool_model.dispatch.load_factor,
            "choices": dict(sorted(decisions.get(model_id, {}).items())),
            "prefix_points": dispatcher.prefix_homes(model_id),
            "waiting": dispatcher.queue_depth(model_id),
            "waiting_by_class": dict(sorted(waiting.get(model_id, {}).items())),
            "saturated": dispatcher.saturated(model_id),
        }
        for model_id, pool_model in dispatcher.snapshot.models.items()
    }


def _priority_status(dispatcher: Dispatcher) -> dict[str, Any]:
    """`priority_classes` in `GET /status`: each class of the config in use (and any class
    that counted requests since the Edge started) with what its requests came to."""
    tally = dispatcher.classes
    classes = dispatcher.snapshot.priorities.classes
    shed: dict[str, dict[str, int]] = {}
    for (name, reason), count in tally.shed.items():
        shed.setdefault(name, {})[reason] = count
    names = sorted({*classes, *tally.admitted, *tally.queued, *shed})
    return {
        name: {
            "priority": classes[name].level if name in classes else None,
            "max_queue_wait_ms": (
                round(wait * 1000)
                if name in classes and (wait := classes[name].max_wait_s) is not None
                else None
            ),
            "admitted": tally.admitted.get(name, 0),
            "queued": tally.queued.get(name, 0),
            "shed": dict(sorted(shed.get(name, {}).items())),
        }
        for name in names
    }


def redacted(config: EdgeConfig) -> dict[str, Any]:
    """The config as a document, with token hashes and URL credentials replaced."""
    result = _redact(config.model_dump(mode="json"))
    assert isinstance(result, dict)
    return result


def _redact(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, key) for v in value]
    if isinstance(value, str):
        if is_secret_field(key):
            return _REDACTED
        if "://" in value:
            value = _URL_USERINFO.sub(f"{_REDACTED}@", value)
            value = _URL_QUERY_VALUE.sub(rf"\1={_REDACTED}", value)
            value = _URL_FRAGMENT.sub(f"#{_REDACTED}", value)
        return value
    return value


async def _read_body(exchange: Exchange) -> bytes:
    def too_large() -> PayloadTooLarge:
        return PayloadTooLarge(f"the body is larger than {MAX_BODY_BYTES} bytes", code="too_large")

    try:
        return await exchange.read_body(MAX_BODY_BYTES, too_large)
    except ClientGone:
        raise BadRequest("the client went away", code="bad_request") from None
