"""`iop operator run`: kopf, the workers, the webhook, leadership and metrics under one lifecycle.

kopf does what it is best at: list-and-watch (EdgeConfigs, and the Deployments and Pods
labelled `iop.dev/edgeconfig`, which wake the EdgeConfig's worker), the admission webhook
server, the liveness endpoint; the operator's own work runs in `workers.py` and
`reconciling.py`. kopf is configured to write nothing on the EdgeConfig. With `--edgeconfig
NAME` every watch asks for that EdgeConfig's objects only; among several replicas the holder of
the Lease reconciles (`leading.py`). docs/operator.md ("One operator per EdgeConfig", "Several
replicas, one active", "Running the operator") says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import signal
import socket
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import kopf

from iop.aiokits import guarded_task, split_listener, stop_tasks
from iop.edgeconfig import UpstreamPolicy

from . import conventions
from .adminapi import EdgeAdmin
from .discovering import FixedReplicas, PodReplicas, ReplicaFinder
from .errors import KubeApiError, KubeNotFound, OperatorError
from .hubcertificates import ensure_hub_certificates, hub_names
from .kubeapi import FIELD_MANAGER, KubeApi, KubeSettings, resource_path
from .leading import LeaderElection
from .metrics import MetricsServer, OperatorMetrics
from .reconciling import PassTimings, Reconciler
from .status import EventPoster
from .watching import NamedObject, NamedWatches
from .webhook import (
    WEBHOOK_ID,
    AdmissionServer,
    SelfSignedCertificate,
    ca_bundle_current,
    owner_reference,
    patch_ca_bundle,
    register_webhook,
    shared_certificate,
)
from .workers import Workers

#: The oldest Kubernetes the operator runs on (major, minor): its webhook's matchConditions
#: (GA in 1.30) keep each release's webhook to its own EdgeConfig.
MINIMUM_KUBERNETES: Final = (1, 30)

logger = logging.getLogger(__name__)

_NAMESPACE_FILE: Final = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True, slots=True)
class OperatorOptions:
    """What `iop operator run` is told (docs/operator.md, "Running the operator")."""

    namespace: str
    kubeconfig: str | None = None
    #: The one EdgeConfig to serve (a release's); None: every EdgeConfig of the namespace.
    edgeconfig: str | None = None
    #: Admin URLs of Edge replicas outside the cluster; empty: the pods of the Edge workload.
    edge_admin_urls: Sequence[str] = ()
    #: host:port the webhook listens on; None: no webhook.
    webhook_listen: str | None = "0.0.0.0:9443"
    #: The ValidatingWebhookConfiguration whose caBundle the operator keeps current.
    webhook_configuration: str | None = None
    #: The Service the API server calls the webhook through (its DNS names go in the cert).
    webhook_service: str | None = None
    #: Instead of the Service: the URL the API server calls (an operator outside the cluster).
    webhook_url: str | None = None
    #: The Secret holding the webhook certificate all replicas share; None: one per start.
    webhook_secret: str | None = None
    #: host:port of kopf's liveness endpoint (/healthz); None: none.
    liveness_listen: str | None = "0.0.0.0:8080"
    #: host:port of GET /metrics and /readyz; None: none (`iop operator run` serves them on
    #: 0.0.0.0:8081 unless told otherwise).
    metrics_listen: str | None = None
    #: The Lease replicas elect a leader with; None: this process acts alone.
    leader_election: str | None = None
    extra_sans: Collection[str] = field(default_factory=tuple)
    #: What a config's providers may reach and which keys they may name (the webhook and every
    #: pass refuse one that breaks it); None: anything.
    upstream_policy: UpstreamPolicy | None = None
    #: The Secret of the hub's TLS certificates to make when missing (`hubcertificates`);
    #: None: the hub's TLS is someone else's.
    hub_tls_secret: str | None = None
    #: The hub's Service: its names go into the Edge's certificate, and it owns the Secret.
    hub_tls_service: str | None = None
    #: More names for the Edge's certificate (the chart's `tls.serverName`).
    hub_tls_sans: Collection[str] = field(default_factory=tuple)


def default_namespace() -> str:
    """The operator's namespace: $POD_NAMESPACE, the ServiceAccount's, else `default`."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(_NAMESPACE_FILE, encoding="utf-8") as stream:
            return stream.read().strip() or "default"
    except OSError:
        return "default"


class _NoDiffBase(kopf.DiffBaseStorage):
    """No change handlers, so no diff base: nothing stored, and no copy of a body (up to a
    megabyte) made for every event."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class _NoProgress(kopf.ProgressStorage):
    """No change handlers, so no handler progress to keep on the object."""

    def fetch(self, *, key: kopf.HandlerId, body: kopf.Body) -> kopf.ProgressRecord | None:
        return None

    def store(
        self,
        *,
        key: kopf.HandlerId,
        record: kopf.ProgressRecord,
        body: kopf.Body,
        patch: kopf.Patch,
    ) -> None:
        return None

    def purge(self, *, key: kopf.HandlerId, body: kopf.Body, patch: kopf.Patch) -> None:
        return None

    def touch(self, *, body: kopf.Body, patch: kopf.Patch, value: str | None) -> None:
        return None

    def clear(self, *, essence: kopf.BodyEssence) -> kopf.BodyEssence:
        return essence


def build_settings(options: OperatorOptions, server: Any | None) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.diffbase_storage = _NoDiffBase()
    settings.persistence.progress_storage = _NoProgress()
    settings.posting.enabled = False
    # The namespace is fixed and the CRD installed first (by the chart): no cluster-wide watch
    # of CRDs and namespaces, which a namespaced Role does not allow.
    settings.scanning.disabled = True
    settings.admission.server = server
    if options.edgeconfig:  # the API server filters: other releases' objects never arrive
        name = options.edgeconfig
        settings.watching.field_selectors[conventions.GROUP, conventions.PLURAL] = (
            f"metadata.name={name}"
        )
        labelled = f"{conventions.EDGECONFIG_LABEL}={name}"
        settings.watching.label_selectors["apps", "deployments"] = labelled
        settings.watching.label_selectors["", "pods"] = labelled
    return settings


def build_registry(
    workers: Workers,
    api: KubeApi,
    *,
    webhook: bool,
    metrics: OperatorMetrics | None = None,
    edgeconfig: str | None = None,
    policy: UpstreamPolicy | None = None,
    reserved_secrets: Collection[str] = (),
) -> kopf.OperatorRegistry:
    """The handlers: feed the workers, authenticate, and (optionally) the webhook."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await asyncio.to_thread(_connection_info, api.settings)

    @kopf.on.event(conventions.GROUP, conventions.VERSION, conventions.PLURAL, registry=registry)
    async def edgeconfig_event(event: kopf.RawEvent, **_: Any) -> None:
        body = event["object"]
        if event["type"] == "DELETED":
            metadata = body["metadata"]
            await workers.forget(metadata["namespace"], metadata["name"])
        else:
            workers.notify(body)

    async def dependent_event(event: kopf.RawEvent, **_: Any) -> None:
        metadata = event["object"]["metadata"]
        owner = (metadata.get("labels") or {}).get(conventions.EDGECONFIG_LABEL)
        if owner:
            workers.poke(metadata["namespace"], owner)

    labelled = {conventions.EDGECONFIG_LABEL: edgeconfig or kopf.PRESENT}
    kopf.on.event("apps", "v1", "deployments", labels=labelled, registry=registry)(dependent_event)
    kopf.on.event("", "v1", "pods", labels=labelled, registry=registry, id="pods")(dependent_event)

    if webhook:
        register_webhook(
            registry,
            workers,
            api,
            metrics,
            policy,
            edgeconfig=edgeconfig,
            reserved_secrets=reserved_secrets,
        )
    return registry


def _connection_info(settings: KubeSettings) -> kopf.ConnectionInfo:
    configuration = settings.configuration
    authorization = settings.authorization()
    scheme, _, token = (authorization or "").partition(" ")
    return kopf.ConnectionInfo(
        server=settings.server,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


async def run_operator(
    options: OperatorOptions,
    *,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    on_pass: Callable[[PassTimings], None] | None = None,
) -> None:
    """Run until `stop` is set; `ready` is set once kopf watches."""
    manager = f"{FIELD_MANAGER}/{options.edgeconfig}" if options.edgeconfig else FIELD_MANAGER
    api = await KubeApi.connect(options.kubeconfig, field_manager=manager)
    tasks: list[asyncio.Task[None]] = []
    async with contextlib.AsyncExitStack() as stack:
        # Undone last to first: the stack's background tasks, then the API client, go last.
        stack.push_async_callback(api.stop)
        stack.push_async_callback(stop_tasks, tasks)
        await require_server_version(api)
        if options.hub_tls_secret:
            await _make_hub_certificates(api, options)
        election = _elect(options, api, stop, tasks)
        leading = election.leading if election is not None else None
        admin = await stack.enter_async_context(EdgeAdmin())
        events = await stack.enter_async_context(EventPoster(api))
        workers: Workers
        metrics = OperatorMetrics(
            queue_depth=lambda: workers.pending,
            leading=lambda: leading is None or leading.is_set(),
            health=lambda: workers.health(),
        )
        finder: ReplicaFinder = (
            FixedReplicas(options.edge_admin_urls) if options.edge_admin_urls else PodReplicas(api)
        )

        # The certificates the operator makes are no tokens: a spec naming their Secrets is refused.
        reserved = tuple(s for s in (options.webhook_secret, options.hub_tls_secret) if s)

        def make(namespace: str, name: str) -> Reconciler:
            return Reconciler(
                namespace,
                name,
                api=api,
                admin=admin,
                finder=finder,
                events=events,
                metrics=metrics,
                on_pass=on_pass,
                policy=options.upstream_policy,
                reserved_secrets=reserved,
            )

        workers = Workers(make, leading)
        watching = asyncio.Event()
        webhook = _Webhook(api, options)
        server = await webhook.server() if options.webhook_listen is not None else None
        if server is not None and options.webhook_configuration:
            tasks.append(webhook.keep_ca_bundle())
        registry = build_registry(
            workers,
            api,
            webhook=server is not None,
            metrics=metrics,
            edgeconfig=options.edgeconfig,
            policy=options.upstream_policy,
            reserved_secrets=reserved,
        )
        metrics_server = await _metrics_server(options, metrics, watching, webhook)
        # On the way out, first: the Lease given up, the workers, the webhook, the metrics.
        if metrics_server is not None:
            stack.push_async_callback(metrics_server.stop)
        stack.push_async_callback(webhook.stop)
        stack.push_async_callback(workers.stop)
        if election is not None:
            stack.push_async_callback(election.release)
        tasks.append(guarded_task(_flag(watching, ready), name="ready", logger=logger))
        tasks.append(guarded_task(_signals_stop(watching, stop), name="signals", logger=logger))
        tasks.append(guarded_task(_stop_on(stop, workers), name="workers-stop", logger=logger))
        await kopf.operator(
            registry=registry,
            settings=build_settings(options, server),
            namespaces=[options.namespace],
            standalone=True,
            liveness_endpoint=_liveness_endpoint(options),
            stop_flag=stop,
            ready_flag=watching,
        )


async def _make_hub_certificates(api: KubeApi, options: OperatorOptions) -> None:
    """The hub's TLS Secret, made before anything else: the Edge and Node pods wait for it
    (a volume they mount), and every replica makes sure of it, leader or not."""
    assert options.hub_tls_secret is not None
    owner: dict[str, Any] | None = None
    names = list(options.hub_tls_sans)
    if options.hub_tls_service:
        names = hub_names(options.hub_tls_service, options.namespace, names)
        path = resource_path("v1", "services", options.namespace, options.hub_tls_service)
        try:
            service = await api.get(path, what=f"read the hub's Service {options.hub_tls_service}")
            owner = owner_reference(service)
        except KubeNotFound:
            logger.warning(
                "the hub's Service %s is not there: its TLS Secret has no owner",
                options.hub_tls_service,
            )
    await ensure_hub_certificates(api, options.namespace, options.hub_tls_secret, names, owner)


def _elect(
    options: OperatorOptions, api: KubeApi, stop: asyncio.Event, tasks: list[asyncio.Task[None]]
) -> LeaderElection | None:
    """With leader election: the election, its tasks added to `tasks`; else None."""
    if not options.leader_election:
        return None
    election = LeaderElection(api, options.namespace, options.leader_election, _identity())
    tasks.append(guarded_task(election.run(), name="leader-election", logger=logger))
    tasks.append(guarded_task(_release_on(stop, election), name="lease-release", logger=logger))
    return election


def _liveness_endpoint(options: OperatorOptions) -> str | None:
    """kopf's liveness endpoint on `--liveness-listen`, when given."""
    if options.liveness_listen is None:
        return None
    host, port = split_listener(options.liveness_listen)
    return f"http://{host}:{port}/healthz"


async def _metrics_server(
    options: OperatorOptions,
    metrics: OperatorMetrics,
    watching: asyncio.Event,
    webhook: _Webhook,
) -> MetricsServer | None:
    """`/metrics` and readiness on `--metrics-listen`, started, when given."""
    if options.metrics_listen is None:
        return None
    server = MetricsServer(
        options.metrics_listen,
        metrics,
        lambda: {"watching": watching.is_set(), "webhook": webhook.serving},
    )
    await server.start()
    return server


async def _release_on(stop: asyncio.Event, election: LeaderElection) -> None:
    """Give the Lease up the moment the operator is told to stop (SIGTERM), before kopf's own
    shutdown (seconds): the standby takes over at its next try."""
    await stop.wait()
    await election.release()


async def _stop_on(stop: asyncio.Event, workers: Workers) -> None:
    """Stop the workers (and their watches) the moment the operator is told to stop: kopf gives
    every task made after it started 5 s to end by itself before it cancels it, so an operator
    whose workers still ran took 5.4 s from SIGTERM to its exit (measured in the e2e suite,
    and more than 15 s once under load)."""
    await stop.wait()
    await workers.stop()


async def _signals_stop(watching: asyncio.Event, stop: asyncio.Event) -> None:
    """Once kopf runs, SIGTERM and SIGINT set `stop` again: kopf puts in its own handlers, which
    stop kopf alone, and the Lease would only be released after kopf's shutdown (5 s measured),
    keeping the standby from leading meanwhile. Through `stop`, kopf stops all the same."""
    await watching.wait()
    if threading.current_thread() is not threading.main_thread():
        return  # no signal handlers outside the main thread (kopf installs none either)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)


async def _flag(watching: asyncio.Event, ready: asyncio.Event | None) -> None:
    await watching.wait()
    if ready is not None:
        ready.set()


def _identity() -> str:
    """Who this process is in the Lease: its pod's name (the chart's downward API), else the
    host, and a random suffix, as client-go does: a container the kubelet restarts in the same
    pod is a new candidate, not the holder it replaced (which may have been frozen, not dead)."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(4)}"


async def require_server_version(api: KubeApi) -> None:
    """Refuse to start on an API server older than the operator needs, saying what it needs."""
    version = await api.get("/version", what="read the API server's version")
    major = int(re.sub(r"\D", "", str(version.get("major") or "0")) or 0)
    minor = int(re.sub(r"\D", "", str(version.get("minor") or "0")) or 0)
    if (major, minor) < MINIMUM_KUBERNETES:
        raise OperatorError(
            f"the API server runs Kubernetes {version.get('gitVersion', f'{major}.{minor}')}; "
            f"the operator needs {MINIMUM_KUBERNETES[0]}.{MINIMUM_KUBERNETES[1]} or later "
            "(its webhook's matchConditions and the CRD's validation rules)"
        )


class _Webhook:
    """The admission webhook's server and certificate, and the caBundle kept current.

    The certificate: with `--webhook-secret` the one every replica shares (made in the cluster
    by the first, `webhook.shared_certificate`), else a fresh one per start. The caBundle is
    re-asserted whenever the ValidatingWebhookConfiguration changes (watched by name): a
    configuration that was recreated (a `helm upgrade` that replaced it, someone's `kubectl
    apply`) would otherwise silently stop validating, its failurePolicy being Ignore.
    """

    def __init__(self, api: KubeApi, options: OperatorOptions) -> None:
        self._api = api
        self._options = options
        self._certificate: SelfSignedCertificate | None = None
        self._stale = asyncio.Event()
        self._watches: NamedWatches | None = None
        self.serving = options.webhook_listen is None or not options.webhook_configuration

    async def server(self) -> AdmissionServer:
        options = self._options
        assert options.webhook_listen is not None
        host, port = split_listener(options.webhook_listen)
        names: list[str] = []
        if options.webhook_service:
            service, namespace = options.webhook_service, options.namespace
            names += [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]
            names.append(service)
        if options.webhook_secret:
            self._certificate = await shared_certificate(
                self._api,
                options.namespace,
                options.webhook_secret,
                names,
                await self._service_owner(),
            )
        else:
            names += [os.environ.get("POD_IP", ""), *options.extra_sans, "localhost", "127.0.0.1"]
            if host not in ("0.0.0.0", "::"):
                names.append(host)
            self._certificate = await asyncio.to_thread(SelfSignedCertificate.create, names)
        url = options.webhook_url or f"https://{host}:{port}"
        return AdmissionServer(
            options.webhook_listen, self._certificate, f"{url.rstrip('/')}/{WEBHOOK_ID}"
        )

    async def _service_owner(self) -> dict[str, Any] | None:
        """The webhook's Service as the owner of the certificate's Secret (it goes with the
        release); None without one, or if it is not there (yet)."""
        service = self._options.webhook_service
        if not service:
            return None
        path = resource_path("v1", "services", self._options.namespace, service)
        try:
            found = await self._api.get(path, what=f"read the webhook's Service {service}")
        except KubeNotFound:
            logger.warning(
                "the webhook's Service %s is not there: its Secret has no owner", service
            )
            return None
        return owner_reference(found)

    def keep_ca_bundle(self) -> asyncio.Task[None]:
        """Watch the configuration and patch its caBundle whenever it does not trust us."""
        configuration = self._options.webhook_configuration
        assert configuration is not None
        target = NamedObject(
            "admissionregistration.k8s.io/v1",
            "validatingwebhookconfigurations",
            None,
            configuration,
        )
        self._watches = NamedWatches(self._api, lambda _: self._heard)
        self._watches.keep([target])
        self._stale.set()
        return guarded_task(self._patch_when_stale(), name="webhook-ca-bundle", logger=logger)

    def _heard(self, kind: str, obj: Mapping[str, Any] | None) -> None:
        assert self._certificate is not None
        url = self._url()
        if (
            obj is None
            or kind == "DELETED"
            or not ca_bundle_current(dict(obj), self._certificate.cert_pem, url)
        ):
            self._stale.set()

    def _url(self) -> str | None:
        base = self._options.webhook_url
        return f"{base.rstrip('/')}/{WEBHOOK_ID}" if base else None

    async def _patch_when_stale(self) -> None:
        assert self._certificate is not None and self._options.webhook_configuration
        delay = 1.0
        while True:
            await self._stale.wait()
            self._stale.clear()
            try:
                await patch_ca_bundle(
                    self._api,
                    self._options.webhook_configuration,
                    self._certificate.cert_pem,
                    url=self._url(),
                )
                self.serving, delay = True, 1.0
            except KubeApiError as error:
                logger.warning(
                    "cannot configure the webhook yet (retrying in %.0fs): %s", delay, error
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)
                self._stale.set()

    async def stop(self) -> None:
        if self._watches is not None:
            await self._watches.stop()
