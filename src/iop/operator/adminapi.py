"""The operator's client of the Edge's admin HTTP API (docs/refresh.md): apply, and read status.

The operator never imports the Edge: it talks to each replica over the same API `iop edge
reload` uses, with the replica's admin token. Answers are read into small values here, and
every failure becomes an `AdminApiError` naming the replica, so the reconcile can say who
failed and why.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final

import aiohttp
import orjson

from iop.aiokits import AsyncService
from iop.verdicts import Figures

from .errors import AdminApiError, AdminRefused, AdminUnreachable
from .values import (
    ApplyReport,
    CandidateView,
    EdgeReplica,
    EdgeRevision,
    NodePushResult,
    NodeState,
    ReplicaRevisions,
    ReplicaStatus,
    Served,
)

#: How long one replica may take to apply: its own wait for node acks is 10 s.
_APPLY_TIMEOUT_S: Final = 30.0
_STATUS_TIMEOUT_S: Final = 5.0
_CONNECT_TIMEOUT_S: Final = 3.0


def apply_body(
    document: Mapping[str, Any],
    restarting: Sequence[str],
    replacing: Mapping[str, Collection[str]] | None = None,
) -> bytes:
    """The `POST /refresh` body, encoded once and sent to every replica (`replacing`: node id
    -> the instance ids of the processes its restart replaces, where known; only those are
    held, so a new process that connected before a replica took the change still gets it)."""
    body: dict[str, Any] = {"mode": "apply", "config": document, "restarting": list(restarting)}
    if replacing:
        body["replacing"] = {node: sorted(ids) for node, ids in sorted(replacing.items())}
    return orjson.dumps(body)


def revision_body(revision: int, restarting: Sequence[str] = ()) -> bytes:
    """The `POST /refresh` body that puts a replica's own revision `revision` back in effect
    (`restarting`: the node scopes whose workloads go back to their templates meanwhile)."""
    return orjson.dumps({"mode": "apply", "revision": revision, "restarting": list(restarting)})


class EdgeAdmin(AsyncService):
    """One pooled session for every replica of every EdgeConfig."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=_APPLY_TIMEOUT_S, connect=_CONNECT_TIMEOUT_S)
        self._session = aiohttp.ClientSession(timeout=timeout)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def status(self, replica: EdgeReplica, token: str | None) -> ReplicaStatus:
        """`GET /status`: the config hash in use and each node's currency."""
        document = await self._call(replica, "GET", "/status", None, token, _STATUS_TIMEOUT_S)
        try:
            return ReplicaStatus(
                config_hash=str(document["config_hash"]),
                snapshot=int(document["generation"]),
                nodes=tuple(_node_state(n) for n in document["nodes"]),
                candidate=_candidate(document.get("revisions")),
                served=_served(document.get("served")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AdminRefused(
                replica.name, f"unexpected /status answer: {exc!r}", status=200
            ) from exc

    async def revisions(self, replica: EdgeReplica, token: str | None) -> ReplicaRevisions | None:
        """`GET /revisions`: the replica's revision log; None from an Edge that keeps none (404)."""
        try:
            document = await self._call(
                replica, "GET", "/revisions", None, token, _STATUS_TIMEOUT_S
            )
        except AdminRefused as refused:
            if refused.status == 404:
                return None
            raise
        try:
            return ReplicaRevisions(
                replica=replica,
                stable=_number(document.get("stable")),
                candidate=_number(document.get("candidate")),
                revisions=tuple(_edge_revision(r) for r in document["revisions"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AdminRefused(
                replica.name, f"unexpected /revisions answer: {exc!r}", status=200
            ) from exc

    async def apply(self, replica: EdgeReplica, body: bytes, token: str | None) -> ApplyReport:
        """`POST /refresh` apply; a refusal raises `AdminRefused` with the replica's reason."""
        report = await self._call(replica, "POST", "/refresh", body, token, _APPLY_TIMEOUT_S)
        try:
            return ApplyReport(
                config_hash=str(report["config_hash"]),
                generation=int(report["generation"]),
                changed=bool(report["changed"]),
                pushes=tuple(
                    NodePushResult(str(p["node_id"]), str(p["status"]), str(p.get("reason", "")))
                    for p in report["pushes"]
                ),
                duration_ms=float(report.get("duration_ms", 0.0)),
                message=str(report.get("message", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AdminRefused(
                replica.name, f"unexpected refresh report: {exc!r}", status=200
            ) from exc

    async def _call(
        self,
        replica: EdgeReplica,
        method: str,
        route: str,
        body: bytes | None,
        token: str | None,
        timeout: float,
    ) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("EdgeAdmin is not started")
        if not replica.admin_url:
            raise AdminUnreachable(replica.name, "it has no address yet")
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with self._session.request(
                method,
                replica.admin_url + route,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout, connect=_CONNECT_TIMEOUT_S),
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise AdminUnreachable(
                replica.name, f"admin API at {replica.admin_url} unreachable: {_describe(exc)}"
            ) from exc
        try:
            document = orjson.loads(raw)
        except orjson.JSONDecodeError:
            document = None
        if status == 200 and isinstance(document, dict):
            return document
        raise _refusal(replica, status, document)


def _refusal(replica: EdgeReplica, status: int, document: object) -> AdminApiError:
    answer = document if isinstance(document, dict) else {}
    if status == 401:
        return AdminRefused(
            replica.name,
            "the admin API refused the token (401): check the admin Secret",
            status=401,
        )
    if status == 409 and answer.get("outcome") == "rolled_back":
        return AdminRefused(
            replica.name,
            f"it rolled this config back and keeps its last good one: {answer.get('message')}",
            status=409,
            rolled_back=True,
        )
    if status == 409:
        scopes = tuple(str(s) for s in answer.get("restart_scopes") or ())
        paths = [str(p.get("path")) for p in answer.get("restart_required_paths") or ()]
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        return AdminRefused(
            replica.name,
            f"it needs a restart for {shown or 'this change'} (scopes {', '.join(scopes)})",
            status=409,
            restart_scopes=scopes,
        )
    if status == 422:
        problems = [f"{p.get('path')}: {p.get('message')}" for p in answer.get("problems") or ()]
        return AdminRefused(
            replica.name, f"it found the config invalid: {'; '.join(problems[:3])}", status=422
        )
    error = answer.get("error") if isinstance(answer.get("error"), dict) else {}
    message = error.get("message") if isinstance(error, dict) else None
    return AdminRefused(
        replica.name, f"answered {status}: {message or 'no details'}", status=status
    )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text[:200]


def _node_state(node: dict[str, Any]) -> NodeState:
    """One node of `GET /status`. `draining_runs` (provider -> runs left, over the node's process
    and the older ones a newer one superseded) is optional: an older Edge reports none; so are
    `instance_id` and the providers' health."""
    runs = sum(int(n) for n in (node.get("draining_runs") or {}).values())
    providers = [p for p in node.get("providers") or () if isinstance(p, dict)]
    return NodeState(
        str(node["node_id"]),
        bool(node["connected"]),
        bool(node["current"]),
        runs,
        instance_id=str(node.get("instance_id") or ""),
        healthy=frozenset(str(p["provider_id"]) for p in providers if p.get("healthy")),
        unhealthy=tuple(
            (str(p["provider_id"]), str(p.get("reason") or ""), str(p.get("detail") or ""))
            for p in providers
            if not p.get("healthy")
        ),
    )


def _served(served: object) -> Served | None:
    """`served` of `GET /status`; None from an Edge that does not say or says it otherwise (an
    Edge restart's gate then judges that replica by its readiness alone)."""
    if not isinstance(served, dict) or not isinstance(served.get("figures"), dict):
        return None
    try:
        return Served(float(served["since"]), Figures.of_counts(served["figures"]))
    except (KeyError, TypeError, ValueError):
        return None


def _number(value: Any) -> int | None:
    return None if value is None else int(value)


def _candidate(revisions: object) -> CandidateView | None:
    """`revisions.candidate` of `GET /status` (absent from an older Edge; `mode` and
    `share_percent` absent from an Edge without a canary)."""
    entry = revisions.get("candidate") if isinstance(revisions, dict) else None
    if not isinstance(entry, dict):
        return None
    share = entry.get("share_percent")
    mode = entry.get("mode")
    return CandidateView(
        revision=int(entry["revision"]),
        config_hash=str(entry["config_hash"]),
        mode=str(mode) if mode is not None else None,
        share_percent=int(share) if share is not None else None,
    )


def _edge_revision(entry: dict[str, Any]) -> EdgeRevision:
    judgement = entry.get("judgement") if isinstance(entry.get("judgement"), dict) else None
    return EdgeRevision(
        number=int(entry["revision"]),
        config_hash=str(entry["config_hash"]),
        outcome=str(entry["outcome"]),
        reason=str(entry.get("reason") or ""),
        check=str(judgement.get("check") or "") if judgement is not None else "",
        figures=_figures(judgement) if judgement is not None else "",
    )


def _figures(judgement: dict[str, Any]) -> str:
    """A judgement's figures in one line: the candidate's against the baseline's."""

    def side(figures: object) -> str:
        if not isinstance(figures, dict):
            return "-"
        text = (
            f"{figures.get('requests', 0)} requests, {figures.get('failed', 0)} failed, "
            # "retried": requests; an Edge from before counted tries, as "retries".
            f"{figures.get('retried', figures.get('retries', 0))} retried"
        )
        p95 = figures.get("first_token_p95_s")
        return text + (f", first token p95 {float(p95):.3f}s" if p95 is not None else "")

    return (
        f"candidate {side(judgement.get('candidate'))}; baseline {side(judgement.get('baseline'))}"
    )
