"""A small asyncio client of the Kubernetes API: the calls the reconcile makes, and no more.

kopf watches the EdgeConfigs (and the workloads and pods that wake a reconcile) with its own
client; everything the operator *does* (ConfigMaps, Secrets, Deployments, Pods, the status
subresource, Events, the webhook configuration) goes through this one. Why not the `kubernetes`
package's client: it is blocking, so each call would need a thread, and it builds model objects
for bodies that can be a megabyte (a large EdgeConfig); this client sends and receives plain
JSON with orjson over one pooled aiohttp session. The `kubernetes` package still does what it is
good at: reading a kubeconfig or the in-cluster ServiceAccount (with its token rotation).

Every failure becomes one of `errors.py`'s `KubeApiError`s, here and only here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import orjson
from kubernetes import client as kube_client
from kubernetes import config as kube_config

from iop.aiokits import AsyncService

from .errors import (
    KubeApiError,
    KubeConflict,
    KubeForbidden,
    KubeNotFound,
    KubeUnavailable,
)

logger = logging.getLogger(__name__)

#: Who the operator is in `managedFields` (followed by `/NAME` when it serves one EdgeConfig, so
#: each release's writes are told apart).
FIELD_MANAGER: Final = "iop-operator"
_SERVICE_ACCOUNT_TOKEN: Final = "/var/run/secrets/kubernetes.io/serviceaccount/token"
#: A projected ServiceAccount token is rotated by the kubelet; re-read it this often.
_TOKEN_REFRESH_S: Final = 60.0
_ERRORS: Final[Mapping[int, type[KubeApiError]]] = {
    403: KubeForbidden,
    404: KubeNotFound,
    409: KubeConflict,
}


def resource_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """`/api/v1/namespaces/NS/configmaps/NAME` or `/apis/GROUP/VERSION/...` for any resource."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [root]
    if namespace is not None:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name is not None:
        parts.append(name)
    if subresource is not None:
        parts.append(subresource)
    return "/".join(parts)


@dataclass(frozen=True, slots=True)
class KubeSettings:
    """Where the API server is and how to authenticate (from a kubeconfig or in-cluster)."""

    server: str
    ssl_context: ssl.SSLContext | bool
    configuration: kube_client.Configuration

    @classmethod
    def load(cls, kubeconfig: str | None = None) -> KubeSettings:
        """In a pod (a ServiceAccount token mounted, no kubeconfig asked for): in-cluster;
        otherwise the kubeconfig (`kubeconfig`, else $KUBECONFIG, else ~/.kube/config).
        Reads files: call it off the event loop."""
        configuration = kube_client.Configuration()
        in_cluster = (
            kubeconfig is None
            and not os.environ.get("KUBECONFIG")
            and os.environ.get("KUBERNETES_SERVICE_HOST")
            and os.path.exists(_SERVICE_ACCOUNT_TOKEN)
        )
        if in_cluster:
            kube_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=configuration, persist_config=False
            )
        context: ssl.SSLContext | bool
        if not bool(getattr(configuration, "verify_ssl", True)):
            context = False
        else:
            context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
            if configuration.cert_file:
                context.load_cert_chain(configuration.cert_file, configuration.key_file)
        return cls(
            server=configuration.host.rstrip("/"), ssl_context=context, configuration=configuration
        )

    def authorization(self) -> str | None:
        """The bearer token header, refreshed from its file when the loader knows how."""
        configuration = self.configuration
        refresh = getattr(configuration, "refresh_api_key_hook", None)  # typed None, set by loaders
        if refresh is not None:
            refresh(configuration)
        token = configuration.api_key.get("authorization") or configuration.api_key.get(
            "BearerToken"
        )
        if not token:
            return None
        return token if token.lower().startswith("bearer ") else f"Bearer {token}"


class KubeApi(AsyncService):
    """JSON calls to the API server over one session; `async with KubeApi(settings) as api`."""

    def __init__(
        self, settings: KubeSettings, *, timeout: float = 30.0, field_manager: str = FIELD_MANAGER
    ) -> None:
        self.settings = settings
        self.field_manager = field_manager
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._authorization: str | None = None
        self._authorized_at = 0.0

    @classmethod
    async def connect(
        cls, kubeconfig: str | None = None, *, field_manager: str = FIELD_MANAGER
    ) -> KubeApi:
        """Settings loaded off the event loop, then the client started."""
        settings = await asyncio.to_thread(KubeSettings.load, kubeconfig)
        api = cls(settings, field_manager=field_manager)
        await api.start()
        return api

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=32, ssl=self.settings.ssl_context)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        await self._refresh_token()

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _refresh_token(self) -> None:
        self._authorization = await asyncio.to_thread(self.settings.authorization)
        self._authorized_at = time.monotonic()

    # -- verbs -------------------------------------------------------------------------------

    async def get(self, path: str, *, what: str = "") -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", path, what=what)
        return result

    async def find(self, path: str, *, what: str = "") -> dict[str, Any] | None:
        """`get`, or None when the object is not there (404)."""
        try:
            return await self.get(path, what=what)
        except KubeNotFound:
            return None

    async def items(self, path: str, *, selector: str = "", what: str = "") -> list[dict[str, Any]]:
        """The items of a list call, filtered by a label selector."""
        params = {"labelSelector": selector} if selector else None
        result = await self.request("GET", path, params=params, what=what)
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    async def create(self, path: str, body: Mapping[str, Any], *, what: str = "") -> dict[str, Any]:
        result: dict[str, Any] = await self.request("POST", path, body=body, what=what)
        return result

    async def merge_patch(
        self, path: str, body: Mapping[str, Any], *, what: str = ""
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self.request(
            "PATCH", path, body=body, content_type="application/merge-patch+json", what=what
        )
        return result

    async def create_or_replace(
        self, path: str, body: dict[str, Any], found: Mapping[str, Any] | None, *, what: str
    ) -> None:
        """Create the object at `path` when `found` (what was read there) is None, else patch it
        over on `found`'s resourceVersion: `KubeConflict` when another writer came first."""
        if found is None:
            await self.create(path.rsplit("/", 1)[0], body, what=f"create {what}")
        else:
            body["metadata"]["resourceVersion"] = found["metadata"]["resourceVersion"]
            await self.merge_patch(path, body, what=f"renew {what}")

    async def apply(self, path: str, body: Mapping[str, Any], *, what: str = "") -> dict[str, Any]:
        """Server-side apply as the operator's field manager (create or update in one call)."""
        result: dict[str, Any] = await self.request(
            "PATCH",
            path,
            body=body,
            params={"fieldManager": self.field_manager, "force": "true"},
            content_type="application/apply-patch+yaml",  # JSON is YAML
            what=what,
        )
        return result

    async def watch(
        self, path: str, *, params: Mapping[str, str], what: str = ""
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch (`?watch=1`), one JSON object each, until the server ends it.

        No total timeout (a watch lasts minutes); the server's `timeoutSeconds` ends it, and a
        read that stalls longer than that by a margin is a dead connection."""
        if self._session is None:
            raise RuntimeError("KubeApi is not started")
        if time.monotonic() - self._authorized_at > _TOKEN_REFRESH_S:
            await self._refresh_token()
        headers = {"Accept": "application/json"}
        if self._authorization:
            headers["Authorization"] = self._authorization
        seconds = float(params.get("timeoutSeconds", "300"))
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=seconds + 30)
        try:
            async with self._session.get(
                self.settings.server + path,
                params={**params, "watch": "1"},
                headers=headers,
                timeout=timeout,
            ) as response:
                if response.status >= 300:
                    raise _error(response.status, await response.read(), what or f"watch {path}")
                # One event per line; a line may be a megabyte (the Edge ConfigMap), beyond
                # what aiohttp's line reader takes, so lines are cut here.
                pending = b""
                async for chunk in response.content.iter_any():
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield orjson.loads(line)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubeUnavailable(0, "Unreachable", repr(exc), what=what or path) from exc

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        what: str = "",
    ) -> Any:
        """One call; the answer's JSON. Retries once after a 401 with a re-read token."""
        if self._session is None:
            raise RuntimeError("KubeApi is not started")
        if time.monotonic() - self._authorized_at > _TOKEN_REFRESH_S:
            await self._refresh_token()
        if method in ("POST", "PUT", "PATCH"):  # managedFields name the writer
            params = {"fieldManager": self.field_manager, **(params or {})}
        data = orjson.dumps(body) if body is not None else None
        for attempt in (1, 2):
            headers = {"Accept": "application/json"}
            if data is not None:
                headers["Content-Type"] = content_type
            if self._authorization:
                headers["Authorization"] = self._authorization
            try:
                async with self._session.request(
                    method, self.settings.server + path, params=params, data=data, headers=headers
                ) as response:
                    raw = await response.read()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise KubeUnavailable(0, "Unreachable", repr(exc), what=what or path) from exc
            if status == 401 and attempt == 1:
                await self._refresh_token()
                continue
            if status < 300:
                return orjson.loads(raw) if raw else {}
            raise _error(status, raw, what or f"{method} {path}")
        raise AssertionError("unreachable")


def _error(status: int, raw: bytes, what: str) -> KubeApiError:
    """The API's `Status` answer as one of our errors."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError:
        document = {}
    if not isinstance(document, dict):
        document = {}
    reason = str(document.get("reason") or status)
    message = str(document.get("message") or raw[:500].decode("utf-8", "replace"))
    kind = _ERRORS.get(status)
    if kind is None:
        kind = KubeUnavailable if status >= 500 or status == 429 else KubeApiError
    return kind(status, reason, message, what=what)
