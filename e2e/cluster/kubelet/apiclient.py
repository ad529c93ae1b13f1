"""A small asyncio client for the few API calls a kubelet makes, over one aiohttp session.

The official `kubernetes` client is synchronous; a kubelet watches, probes and supervises many
processes at once, so it uses aiohttp (already a dependency of the project) and speaks the REST
API directly: JSON in, JSON out, watches as streamed lines. Errors are `ApiError` with the HTTP
status, translated here once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger("kubelet.api")

Object = dict[str, Any]


class ApiError(Exception):
    def __init__(self, status: int, body: Any, what: str) -> None:
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{what}: {status} {message}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Credentials:
    server: str
    ca_file: str
    cert_file: str
    key_file: str

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


class ApiClient:
    """REST calls against one API server; use as `async with ApiClient(...) as api`."""

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ApiClient:
        connector = aiohttp.TCPConnector(ssl=self._credentials.ssl_context(), limit=32)
        self._session = aiohttp.ClientSession(
            base_url=self._credentials.server, connector=connector, trust_env=False
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use ApiClient in `async with`"
        return self._session

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        data = None if body is None else json.dumps(body)
        what = f"{method} {path}"
        try:
            async with self.session.request(
                method,
                path,
                data=data,
                params=params,
                headers={"Content-Type": content_type, "Accept": "application/json"},
                timeout=aiohttp.ClientTimeout(total=30),
            ) as response:
                text = await response.text()
                try:
                    payload = json.loads(text) if text else None
                except ValueError:
                    payload = text
                if response.status >= 400:
                    raise ApiError(response.status, payload, what)
                return payload
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ApiError(0, str(error), what) from error

    async def get(self, path: str, **params: str) -> Any:
        return await self.call("GET", path, params=params)

    async def merge_patch(self, path: str, body: Any) -> Any:
        return await self.call("PATCH", path, body, content_type="application/merge-patch+json")

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[Object]:
        """The events of one watch request, until the server ends it."""
        query = {**params, "watch": "true", "allowWatchBookmarks": "true"}
        async with self.session.get(
            path, params=query, timeout=aiohttp.ClientTimeout(total=None, sock_read=120)
        ) as response:
            if response.status >= 400:
                raise ApiError(response.status, await response.text(), f"WATCH {path}")
            async for line in response.content:
                if line.strip():
                    event: Object = json.loads(line)
                    yield event


Handler = Callable[[str, Object], Awaitable[None]]


class Informer:
    """List, then watch, one collection and keep a copy of it; tell `handler` what changed.

    After a failed or expired watch it lists again and reports objects that vanished meanwhile
    as DELETED, so the handler sees every object's last state exactly as a watch would.
    """

    def __init__(self, api: ApiClient, path: str, handler: Handler, **params: str) -> None:
        self.api = api
        self.path = path
        self.params = params
        self.handler = handler
        self.objects: dict[tuple[str, str], Object] = {}
        self.synced = asyncio.Event()

    @staticmethod
    def key(obj: Object) -> tuple[str, str]:
        meta = obj["metadata"]
        return meta.get("namespace", ""), meta["name"]

    async def run(self) -> None:
        delay = 0.5
        while True:
            try:
                version = await self._relist()
                self.synced.set()
                delay = 0.5
                while True:
                    params = {**self.params, "resourceVersion": version, "timeoutSeconds": "300"}
                    async for event in self.api.watch(self.path, params):
                        kind, obj = event["type"], event["object"]
                        if kind == "ERROR":
                            raise ApiError(obj.get("code", 0), obj, f"WATCH {self.path}")
                        version = obj["metadata"]["resourceVersion"]
                        if kind == "BOOKMARK":
                            continue
                        if kind == "DELETED":
                            self.objects.pop(self.key(obj), None)
                        else:
                            self.objects[self.key(obj)] = obj
                        await self.handler(kind, obj)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a watch loop logs and carries on; only cancel ends it
                if not (isinstance(error, ApiError) and error.status == 410):
                    log.warning(
                        "watch %s failed (%s); listing again in %.1fs", self.path, error, delay
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)

    async def _relist(self) -> str:
        listing = await self.api.get(self.path, **self.params)
        fresh = {self.key(obj): obj for obj in listing["items"]}
        gone = [obj for key, obj in self.objects.items() if key not in fresh]
        # In place: others hold a reference to this very dict.
        self.objects.clear()
        self.objects.update(fresh)
        for obj in gone:
            await self.handler("DELETED", obj)
        for obj in fresh.values():
            await self.handler("MODIFIED", obj)
        version: str = listing["metadata"]["resourceVersion"]
        return version
