"""One Edge: the node hub, the provider pool and the OpenAI HTTP API, under one lifecycle.

`EdgeServer` owns every part and starts and stops them in order: the hub first, then the HTTP
server on the OpenAI listener (`http/server.py`, with the caps of `openai.*`: `http/caps.py`),
the metrics (`metrics_listen`) and the admin API (`admin_listen`: `iop edge run` passes
`edge.admin.listen`; an Edge embedded in tests or benchmarks serves none by default), which
stops first. `wait_for_nodes_s` holds its readiness until its nodes have connected, bounded
(`hub/nodewait.py`). `refresher` is the live-refresh seam (`refresh/refresher.py`). Signals are the
caller's business (`iop edge run` maps SIGTERM and SIGINT to `stop()`). docs/architecture.md,
"The Edge", says why the order is so.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from iop.aiokits import AsyncService, Resolve, bind_listener, resolve_service, split_listener
from iop.edgeconfig import EdgeConfig, UpstreamPolicy

from .authenticating import Authenticator
from .authfailures import AuthFailures
from .bodybounds import BodyBounds
from .guardmetrics import GuardCollector
from .http import AdminApp, AdminAuth, ClientGuard, HttpCaps, HttpServer, MetricsApp, OpenAIApp
from .hub import Hub, HubCaps, NodeHub, NodeWait, PeerCount, Readiness, available_providers
from .limits import Limiter
from .pool import Dispatcher, Metrics, PoolSnapshot, ResponseHomesCollector
from .refresh import Refresher, RolloutCollector

logger = logging.getLogger(__name__)

#: The limits of the operator-local listeners (admin API, metrics): few clients, small heads.
_LOCAL_CAPS = HttpCaps(max_connections=256)


class EdgeServer(AsyncService):
    """An Edge process's parts; `async with EdgeServer(config) as edge:` or start()/stop()."""

    def __init__(
        self,
        config: EdgeConfig,
        *,
        hub: Hub | None = None,
        openai_listen: str | None = None,
        hub_listen: str | None = None,
        shutdown_grace_s: float = 10.0,
        admin_listen: str | None = None,
        metrics_listen: str | None = None,
        config_path: str | Path | None = None,
        ack_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        peers_service: str | None = None,
        resolve: Resolve = resolve_service,
        upstream_policy: UpstreamPolicy | None = None,
        wait_for_nodes_s: float = 0.0,
    ) -> None:
        self.dispatcher = Dispatcher(PoolSnapshot.build(config))
        self.hub: Hub = (
            hub if hub is not None else NodeHub(config, listen=hub_listen, policy=upstream_policy)
        )
        self.metrics = Metrics(self.dispatcher, self.hub)
        #: Ready once the nodes that dial in have connected, or `wait_for_nodes_s` after the hub
        #: started (0: at once). Node ids need a restart, so the set is the starting config's.
        self.node_wait = NodeWait(
            self.hub, [node.id for node in config.nodes if not node.on_edge], wait_for_nodes_s
        )
        # `openai.limits[]`; `clock` (Unix seconds) is where budget periods and buckets read the
        # time: a test moves it to see a budget reset.
        self.limiter = Limiter(self.dispatcher, config, registry=self.metrics.registry, clock=clock)
        self.refresher = Refresher(
            self.dispatcher,
            hub=self.hub,
            config_path=config_path,
            config_dir=config.edge.admin.config_dir,
            ack_timeout=ack_timeout_s,
            on_report=lambda report: self.metrics.count_refresh(report.mode, report.outcome),
            outcomes=self.metrics.outcomes,
        )
        self.metrics.registry.register(RolloutCollector(self.refresher.rollouts))
        # Checked here, before anything listens: off loopback without a token, no Edge.
        self._admin_auth = (
            AdminAuth.load(config.edge.admin, admin_listen) if admin_listen is not None else None
        )
        self._admin_listen = admin_listen
        self._admin_server: HttpServer | None = None
        self.admin_port: int | None = None
        self._metrics_listen = metrics_listen or None
        #: The Edge replicas, counted for the nodes placed on the Edge (`peering.py`).
        self._peers = (
            PeerCount(peers_service, self._replicas_changed, resolve=resolve)
            if peers_service
            else None
        )
        self._metrics_server: HttpServer | None = None
        self.metrics_port: int | None = None
        authenticator = Authenticator(config.openai)
        self.app = OpenAIApp(
            dispatcher=self.dispatcher,
            hub=self.hub,
            authenticator=authenticator,
            metrics=self.metrics,
            max_request_bytes=config.openai.max_request_bytes,
            ready=self.readiness,
            limiter=self.limiter,
            body_bounds=BodyBounds.of(config.openai),
        )
        #: The app behind its per-client bounds: what the OpenAI listener serves.
        self.guard = ClientGuard(
            self.app,
            authenticator,
            AuthFailures(
                "the OpenAI API",
                logging.getLogger("iop.edge.http.clientguard"),
                per_minute=config.openai.auth_failures_per_minute,
            ),
            max_requests_per_client=config.openai.max_requests_per_client,
        )
        # The OpenAI listener fits its connection cap to the open-file limit beside the hub's.
        hub_caps = (
            self.hub.caps
            if isinstance(self.hub, NodeHub)
            else HubCaps.of(config.edge.node_link).fitted()
        )
        self.caps = replace(HttpCaps.of(config.openai), reserved_files=hub_caps.connection_bound)
        self.metrics.registry.register(GuardCollector(self.guard, self.hub))
        self.metrics.registry.register(ResponseHomesCollector(self.app.response_homes))
        self._listen = openai_listen or config.openai.listen
        self._grace = shutdown_grace_s
        self._server: HttpServer | None = None
        self._hub_started = False
        self.host, self.port = split_listener(self._listen)
        self.hub_port: int | None = None

    @property
    def url(self) -> str:
        """Base URL of the OpenAI API (what clients use as base_url, minus the /v1)."""
        return _url(self.host, self.port)

    def ready(self) -> bool:
        """Config loaded, the hub listening, the HTTP side serving and the nodes connected (or
        waited for long enough: `NodeWait`)."""
        return self.readiness().ready

    def readiness(self) -> Readiness:
        """`ready()`, with the nodes still awaited and for how long at most (`/readyz`)."""
        nodes = self.node_wait.readiness()
        server = self._server
        if self._hub_started and server is not None and server.started:
            return nodes
        return replace(nodes, ready=False)

    @property
    def admin_url(self) -> str | None:
        """Base URL of the admin API, when it is served."""
        if self._admin_listen is None or self.admin_port is None:
            return None
        return _url(split_listener(self._admin_listen)[0], self.admin_port)

    @property
    def metrics_url(self) -> str | None:
        """Base URL of the metrics listener, when it is served."""
        if self._metrics_listen is None or self.metrics_port is None:
            return None
        return _url(split_listener(self._metrics_listen)[0], self.metrics_port)

    @property
    def http_server(self) -> HttpServer | None:
        """The OpenAI API's HTTP server (its refusals count what its limits turned away)."""
        return self._server

    async def start(self) -> None:
        await self.limiter.start()
        try:
            self.hub_port = await self.hub.start()
        except BaseException:
            await self.limiter.stop()
            raise
        self._hub_started = True
        self.node_wait.start()
        self.hub.add_listener(self._links_changed)
        self._links_changed()
        self.dispatcher.watch_loads(self.hub.provider_loads())
        try:
            if self._peers is not None:
                await self._peers.start()
            sock = bind_listener(self.host, self.port, "the OpenAI API")
            self.port = sock.getsockname()[1]
            self._server = await self._serve_http(
                self.guard,
                sock,
                self.caps,
                f"the OpenAI API on {self._listen}",
            )
            if self._metrics_listen is not None:
                host, port = split_listener(self._metrics_listen)
                sock = bind_listener(host, port, "the metrics")
                self.metrics_port = sock.getsockname()[1]
                self._metrics_server = await self._serve_http(
                    MetricsApp(self.metrics),
                    sock,
                    _LOCAL_CAPS,
                    f"the metrics on {self._metrics_listen}",
                )
            if self._admin_auth is not None and self._admin_listen is not None:
                host, port = split_listener(self._admin_listen)
                sock = bind_listener(host, port, "the admin API")
                self.admin_port = sock.getsockname()[1]
                admin = AdminApp(self.refresher, self._admin_auth, self.hub, self.limiter)
                self._admin_server = await self._serve_http(
                    admin,
                    sock,
                    _LOCAL_CAPS,
                    f"the admin API on {self._admin_listen}",
                )
        except BaseException:
            await self._stop(grace=0)
            raise
        logger.info(
            "edge serving the OpenAI API on %s (listen %s); nodes dial port %s; admin API %s; "
            "metrics %s",
            self.url,
            self._listen,
            self.hub_port,
            self.admin_url or "off",
            self.metrics_url or "off",
        )

    async def stop(self) -> None:
        """Stop the admin API, then stop taking requests and let running ones finish (up to the
        grace), then the hub."""
        await self._stop(self._grace)

    async def _stop(self, grace: float) -> None:
        """Stop each part even when one before it fails; the first failure is raised at the end."""
        servers = (self._admin_server, self._server, self._metrics_server)
        self._admin_server = self._server = self._metrics_server = None
        try:
            for server in servers:
                if server is not None:
                    try:
                        await server.stop()
                    except Exception:
                        logger.exception("an HTTP server of the Edge failed while stopping")
        finally:
            try:
                await self.refresher.rollouts.aclose()  # no rollback while the Edge stops
                if self._peers is not None:
                    await self._peers.stop()
                self.node_wait.stop()
                if self._hub_started:
                    self._hub_started = False
                    await self.hub.stop(grace)
            finally:
                self.dispatcher.close()
                await self.limiter.stop()

    async def _serve_http(
        self,
        app: Callable[..., Awaitable[None]],
        sock: socket.socket,
        caps: HttpCaps,
        what: str,
    ) -> HttpServer:
        server = HttpServer(app, sock, caps=caps, what=what, grace=self._grace)
        await server.start()
        return server

    def _replicas_changed(self, replicas: int) -> None:
        """Share the capacity of the nodes placed on the Edge among `replicas` Edges: the
        dispatcher's bounds and the local runners' at once (one turn of the loop); a change on
        trial stays on trial."""
        dispatcher = self.dispatcher
        split = dispatcher.split
        if split is not None:
            split = replace(split, stable=split.stable.with_edge_replicas(replicas))
        dispatcher.swap(dispatcher.snapshot.with_edge_replicas(replicas), split)
        if isinstance(self.hub, NodeHub):
            self.hub.set_edge_replicas(replicas)

    def _links_changed(self) -> None:
        self.dispatcher.set_available(available_providers(self.hub.connected_providers()))


def _url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    host = "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)
    return f"http://{host}:{port}"
