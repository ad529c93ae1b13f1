"""Where each stored response of the Responses API lives, and its own routes (docs/edge.md,
"The Responses API").

`ResponseHolders` joins this Edge's record (`pool.ResponseHomes`: the provider that answered
each response that passed through) with the shared store's (`openai.limit_store`, where every
replica records its own), and turns what it finds into where a continuation, a retrieve, a
delete or a cancel must run, or into the error that names the response: unknown (400 or 404),
its holder gone from the config (410), out of dispatch or unreachable (503), or not serving the
request's model (400). `StoredResponseRoutes` serves `GET`/`DELETE /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` on the provider that holds the response.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from iop.wire import RunChunk, RunDone, RunFailed, RunKind, RunRequest
from iop.wire import statuses as wire_statuses

from ..authenticating import Authenticator, Principal
from ..errors import (
    BadRequest,
    EdgeError,
    MethodNotAllowed,
    ResponseHolderUnavailable,
    ResponseNotFound,
    RouteNotFound,
)
from ..hub import NodeRuns
from ..limits import Limiter
from ..pool import (
    CANDIDATE,
    STABLE,
    Dispatcher,
    Metrics,
    PoolModel,
    ResponseHome,
    ResponseHomes,
    Side,
)
from .exchanges import CLIENT_GONE, Disconnect, Exchange
from .responses import answer_error, ended_early, provider_failed

#: The prefix of a stored response's routes.
STORED_RESPONSES: Final = "/v1/responses/"

#: A run's failures that say its provider cannot be reached (rather than that it answered).
_UNREACHABLE: Final = frozenset(
    {
        wire_statuses.UPSTREAM_UNAVAILABLE,
        wire_statuses.NODE_UNAVAILABLE,
        wire_statuses.NODE_DISCONNECTED,
        wire_statuses.NOT_ACCEPTED,
        wire_statuses.UNKNOWN_PROVIDER,
        wire_statuses.PROVIDER_UNHEALTHY,
        wire_statuses.EDGE_STOPPING,
    }
)


def failure_of(failed: RunFailed, *, continued: str | None, provider: str) -> EdgeError:
    """The error of a failed run on `provider`; for a continuation (of the response
    `continued`) whose holder cannot be reached, one that names the response (no other server
    holds it: a retry elsewhere cannot help)."""
    if continued is None or failed.code not in _UNREACHABLE:
        return provider_failed(failed)
    return ResponseHolderUnavailable(
        f"The response '{continued}' is held by provider `{provider}`, which "
        f"cannot be reached now ({failed.message}); no other server holds it. Retry later.",
        gone=False,
        param="previous_response_id",
    )


class ResponseHolders:
    """The provider that holds each stored response, for this Edge's OpenAI app."""

    def __init__(
        self, dispatcher: Dispatcher, limiter: Limiter | None, homes: ResponseHomes
    ) -> None:
        self._dispatcher = dispatcher
        self._limiter = limiter
        #: This Edge's record (also read by the metrics and the tests).
        self.homes = homes

    def record(self, response_id: str, provider_id: str, model_id: str) -> None:
        self.homes.record(response_id, provider_id, model_id)
        if self._limiter is not None:  # the other replicas learn it through the shared store
            self._limiter.share_home(response_id, provider_id, model_id)

    async def find(self, response_id: str) -> ResponseHome | None:
        """Where a stored response lives: as this Edge recorded it, else as another replica
        did (the shared store's, when there is one)."""
        home = self.homes.find(response_id)
        if home is not None or self._limiter is None:
            return home
        shared = await self._limiter.shared_home(response_id)
        if shared is None:
            return None
        self.homes.record(response_id, *shared)
        return ResponseHome(*shared)

    async def continued(
        self, response_id: str, model: str, pool_model: PoolModel, side: Side
    ) -> tuple[str, PoolModel, Side]:
        """The provider that holds the response a request continues (`previous_response_id`),
        which must serve the request's model (the view of it and the side: while a change is
        on trial, the revision whose view has that provider, its own first); or the clear
        error why it cannot run there."""
        param = "previous_response_id"
        home = await self.find(response_id)
        if home is None:
            raise BadRequest(
                f"Previous response with id '{response_id}' not found: it was not answered "
                "through this Edge, or so long ago that the Edge no longer remembers which "
                f"server holds it (it remembers the last {self.homes.limit}). Send "
                "the conversation's whole input instead.",
                param,
                code="previous_response_not_found",
            )
        self.reachable(home, response_id, param)
        other = CANDIDATE if side == STABLE else STABLE
        views = [(pool_model, side)]
        if self._dispatcher.split is not None:
            other_view = self._dispatcher.model_view(model, other)
            if other_view is not None:
                views.append((other_view, other))
        for view, view_side in views:
            if any(c.provider.id == home.provider_id for c in view.candidates):
                return home.provider_id, view, view_side
        raise BadRequest(
            f"Previous response '{response_id}' is held by provider `{home.provider_id}`, "
            f"which does not serve model `{model}`: continue it with a model that "
            f"provider serves (it was answered as `{home.model_id}`).",
            "model",
            code="previous_response_model_mismatch",
        )

    def reachable(self, home: ResponseHome, response_id: str, param: str | None) -> None:
        """Refuse, naming the response, when the provider that holds it has left the config
        (410: it never comes back) or is out of dispatch now (503: it may)."""
        dispatcher = self._dispatcher
        provider = home.provider_id
        if provider not in dispatcher.snapshot.providers:
            raise ResponseHolderUnavailable(
                f"The response '{response_id}' is held by provider `{provider}`, which is no "
                "longer in the Edge's config: it cannot be continued, retrieved, deleted or "
                "cancelled through this Edge.",
                gone=True,
                param=param,
            )
        if provider not in dispatcher.available:
            raise ResponseHolderUnavailable(
                f"The response '{response_id}' is held by provider `{provider}`, which is not "
                "available now (its node is not connected, or the provider is unhealthy or "
                "disabled); no other server holds it. Retry later.",
                gone=False,
                param=param,
            )

    def forget(self, response_id: str) -> None:
        """The response was deleted: this Edge and the shared store forget where it was."""
        self.homes.forget(response_id)
        if self._limiter is not None:
            self._limiter.unshare_home(response_id)


class StoredResponseRoutes:
    """`GET`/`DELETE /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`, sent to the
    provider that holds the response: a lookup (no slot, no limit, no retry elsewhere)."""

    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        hub: NodeRuns,
        authenticator: Authenticator,
        metrics: Metrics,
        holders: ResponseHolders,
        run_id: Callable[[], str],
    ) -> None:
        self._dispatcher = dispatcher
        self._hub = hub
        self._authenticator = authenticator
        self._metrics = metrics
        self._holders = holders
        self._run_id = run_id

    async def __call__(self, exchange: Exchange, path: str, method: str) -> None:
        response_id, _, action = path.removeprefix(STORED_RESPONSES).partition("/")
        kind: RunKind
        if not response_id or action not in ("", "cancel"):
            answer_error(exchange, RouteNotFound(f"Invalid URL ({method} {path})"))
            return
        if action == "cancel":
            if method != "POST":
                answer_error(exchange, MethodNotAllowed(f"Use POST {path}.", "POST"))
                return
            kind = "response_cancel"
        elif method in ("GET", "HEAD"):
            kind = "response_retrieve"
        elif method == "DELETE":
            kind = "response_delete"
        else:
            answer_error(exchange, MethodNotAllowed(f"Use GET or DELETE {path}.", "GET, DELETE"))
            return
        principal: Principal | None = None
        model = ""
        provider = ""
        status = 200
        gone = Disconnect()
        try:
            principal = exchange.principal or self._authenticator.authenticate(
                exchange.header(b"authorization")
            )
            if kind == "response_retrieve" and b"stream=true" in exchange.query:
                raise BadRequest(
                    "Streaming a stored response again (`stream=true`) is not served through "
                    "the Edge: retrieve it whole.",
                    "stream",
                )
            home = await self._holders.find(response_id)
            if home is None:
                raise ResponseNotFound(
                    f"No response with id '{response_id}' is known to this Edge: it was not "
                    "answered through it, or so long ago that the Edge no longer remembers "
                    f"which server holds it (it remembers the last {self._holders.homes.limit})."
                )
            self._holders.reachable(home, response_id, None)
            provider = home.provider_id
            if home.model_id in self._dispatcher.snapshot.models:
                model = home.model_id
            gone.task = asyncio.current_task()
            exchange.on_gone(gone)
            request = RunRequest(
                run_id=self._run_id(),
                provider_id=provider,
                served_model="",
                kind=kind,
                body=b"",
                stream=False,
                max_response_bytes=self._dispatcher.snapshot.config.openai.max_response_bytes,
                response_id=response_id,
            )
            status = await self._look_up(request, exchange)
        except EdgeError as error:
            exchange.on_gone(None)
            status = answer_error(exchange, error)
        except asyncio.CancelledError:
            if not gone.cancelled_it():
                raise
            status = CLIENT_GONE
        finally:
            exchange.on_gone(None)
            self._metrics.count_request(principal, model, provider, status)

    async def _look_up(self, request: RunRequest, exchange: Exchange) -> int:
        body = b""
        async with self._hub.run(request) as run:
            async for event in run:
                if isinstance(event, RunChunk):
                    body += event.data
                elif isinstance(event, RunDone):
                    if request.kind == "response_delete":
                        self._holders.forget(request.response_id)
                    exchange.respond(200, body)
                    return 200
                elif isinstance(event, RunFailed):
                    return answer_error(exchange, provider_failed(event))
        return answer_error(exchange, ended_early())
