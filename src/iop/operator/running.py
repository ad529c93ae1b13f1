"""`iop operator run`: kopf, the workers, the webhook and the clients under one lifecycle.

kopf does what it is best at: list-and-watch (EdgeConfigs, and the Deployments and Pods
labelled `iop.dev/edgeconfig`, which wake the EdgeConfig's worker), the admission webhook
server, the liveness endpoint. The operator's own work runs in `workers.py` and
`reconciling.py`. kopf is configured so that it writes nothing on the EdgeConfig: no diff-base
annotation, no progress record, no finalizer (there are no change handlers, timers or daemons),
and no Events of its own (the operator posts its decisions itself).

One replica (the chart's Deployment uses `strategy: Recreate`): kopf's peering is off
(`standalone`), since two operators would apply the same EdgeConfig twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import kopf

from iop.aiokits import guarded_task, stop_tasks
from iop.edgeconfig import split_listener

from . import conventions
from .adminapi import EdgeAdmin
from .admitting import AdmissionServer
from .certifying import SelfSignedCertificate, patch_ca_bundle
from .discovering import FixedReplicas, PodReplicas, ReplicaFinder
from .errors import KubeApiError
from .eventing import EventPoster
from .kubeapi import KubeApi, KubeSettings
from .reconciling import PassTimings, Reconciler
from .webhooks import WEBHOOK_ID, register_webhook
from .workers import Workers

__all__ = ["OperatorOptions", "build_registry", "run_operator"]

logger = logging.getLogger(__name__)

_NAMESPACE_FILE: Final = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True, slots=True)
class OperatorOptions:
    """What `iop operator run` is told (docs/operator.md, "Running the operator")."""

    namespace: str
    kubeconfig: str | None = None
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
    #: host:port of kopf's liveness endpoint (/healthz); None: none.
    liveness_listen: str | None = "0.0.0.0:8080"
    extra_sans: Collection[str] = field(default_factory=tuple)


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
    return settings


def build_registry(workers: Workers, api: KubeApi, *, webhook: bool) -> kopf.OperatorRegistry:
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

    labelled = {conventions.EDGECONFIG_LABEL: kopf.PRESENT}
    kopf.on.event("apps", "v1", "deployments", labels=labelled, registry=registry)(dependent_event)
    kopf.on.event("", "v1", "pods", labels=labelled, registry=registry, id="pods")(dependent_event)

    if webhook:
        register_webhook(registry, workers, api)
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
    api = await KubeApi.connect(options.kubeconfig)
    tasks: list[asyncio.Task[None]] = []
    try:
        async with EdgeAdmin() as admin, EventPoster(api) as events:
            finder: ReplicaFinder = (
                FixedReplicas(options.edge_admin_urls)
                if options.edge_admin_urls
                else PodReplicas(api)
            )

            def make(namespace: str, name: str) -> Reconciler:
                return Reconciler(
                    namespace,
                    name,
                    api=api,
                    admin=admin,
                    finder=finder,
                    events=events,
                    on_pass=on_pass,
                )

            workers = Workers(make)
            server = None
            if options.webhook_listen is not None:  # a key made, files written: off the loop
                server, certificate = await asyncio.to_thread(_webhook_server, options)
                if options.webhook_configuration:
                    tasks.append(
                        guarded_task(
                            _keep_ca_bundle(api, options, certificate),
                            name="webhook-ca-bundle",
                            logger=logger,
                        )
                    )
            registry = build_registry(workers, api, webhook=server is not None)
            liveness = None
            if options.liveness_listen is not None:
                host, port = split_listener(options.liveness_listen)
                liveness = f"http://{host}:{port}/healthz"
            try:
                await kopf.operator(
                    registry=registry,
                    settings=build_settings(options, server),
                    namespaces=[options.namespace],
                    standalone=True,
                    liveness_endpoint=liveness,
                    stop_flag=stop,
                    ready_flag=ready,
                )
            finally:
                await workers.stop()
    finally:
        await stop_tasks(tasks)
        await api.stop()


def _webhook_server(
    options: OperatorOptions,
) -> tuple[AdmissionServer, SelfSignedCertificate]:
    assert options.webhook_listen is not None
    host, port = split_listener(options.webhook_listen)
    names: list[str] = []
    if options.webhook_service:
        service, namespace = options.webhook_service, options.namespace
        names += [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", service]
    names += [os.environ.get("POD_IP", ""), *options.extra_sans, "localhost", "127.0.0.1"]
    if host not in ("0.0.0.0", "::"):
        names.append(host)
    certificate = SelfSignedCertificate.create(names)
    url = options.webhook_url or f"https://{host}:{port}"
    server = AdmissionServer(options.webhook_listen, certificate, f"{url.rstrip('/')}/{WEBHOOK_ID}")
    return server, certificate


async def _keep_ca_bundle(
    api: KubeApi, options: OperatorOptions, certificate: SelfSignedCertificate
) -> None:
    """Point the webhook configuration at this operator's certificate; retried until it works
    (the chart may create the configuration a moment after the operator starts)."""
    assert options.webhook_configuration is not None
    delay = 1.0
    while True:
        try:
            await patch_ca_bundle(
                api,
                options.webhook_configuration,
                certificate.cert_pem,
                url=f"{options.webhook_url.rstrip('/')}/{WEBHOOK_ID}"
                if options.webhook_url
                else None,
            )
            return
        except KubeApiError as error:
            logger.warning("cannot configure the webhook yet (retrying in %.0fs): %s", delay, error)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 60.0)
