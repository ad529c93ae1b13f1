"""A faithful fake of the few Kubernetes API calls the operator's small parts make, for unit
tests: objects kept by path with a resourceVersion, optimistic concurrency on PUT (409 on a stale
version), 404 and 409 `Status` answers, and `/version`. The reconcile itself is tested against
the real API server (e2e/operator/); this is for the leader election, the version check and the
status writes, whose timing a unit test drives better than a cluster. JSON merge patches are
applied; a patch of `.../status` changes only the status. Enough of the rest for a whole pass
against Edges outside the cluster (tests/operator/test_revisions_replicas.py): a list answers the
objects under its path that an equality label selector (`a=b,c=d`) matches (a field selector is
not evaluated), a server-side apply stores the body, and a watch stays open and silent."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp.web
from kubernetes import client as kube_client

from iop.operator.kubeapi import KubeApi, KubeSettings


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {
        "kind": "Status",
        "status": "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }
    return aiohttp.web.json_response(body, status=code)


class FakeApi:
    """Objects by path; `/version` answers `version`."""

    def __init__(self, version: tuple[str, str] = ("1", "37")) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = version
        self._versions = itertools.count(1)
        self.calls: list[tuple[str, str]] = []
        #: Seconds each PUT takes before it is applied (a slow API server: a write in flight).
        self.put_delay = 0.0
        #: Set when the fake stops: the watches it holds open end.
        self.closing = asyncio.Event()

    def app(self) -> aiohttp.web.Application:
        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.route("*", "/{path:.*}", self._handle)])
        return app

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        path = "/" + request.match_info["path"]
        self.calls.append((request.method, path))
        if path == "/version":
            major, minor = self.version
            return aiohttp.web.json_response(
                {"major": major, "minor": minor, "gitVersion": f"v{major}.{minor}.0"}
            )
        if request.method == "GET" and "watch" in request.query:
            await self.closing.wait()  # open and silent until the fake stops
            return aiohttp.web.Response(body=b"", content_type="application/json")
        if request.method == "GET" and (
            "labelSelector" in request.query or "fieldSelector" in request.query
        ):
            wanted = dict(
                term.split("=", 1)
                for term in request.query.get("labelSelector", "").split(",")
                if term
            )
            items = [
                o
                for key, o in self.objects.items()
                if key.startswith(path + "/")
                and wanted.items() <= ((o.get("metadata") or {}).get("labels") or {}).items()
            ]
            return aiohttp.web.json_response({"metadata": {"resourceVersion": "1"}, "items": items})
        if request.method == "GET":
            found = self.objects.get(path)
            if found is None:
                return _status(404, "NotFound", f"{path} not found")
            return aiohttp.web.json_response(found)
        body = await request.json()
        if request.method == "POST":
            target = f"{path}/{body['metadata']['name']}"
            if target in self.objects:
                return _status(409, "AlreadyExists", f"{target} already exists")
            return aiohttp.web.json_response(self._store(target, body), status=201)
        if request.method == "PUT":
            await asyncio.sleep(self.put_delay)
            current = self.objects.get(path)
            if current is None:
                return _status(404, "NotFound", f"{path} not found")
            sent = body["metadata"].get("resourceVersion")
            if sent != current["metadata"]["resourceVersion"]:
                return _status(409, "Conflict", "the object has been modified")
            return aiohttp.web.json_response(self._store(path, body))
        if request.method == "PATCH" and request.content_type == "application/merge-patch+json":
            # A status subresource's patch changes only the status of the object it belongs to.
            target = path.removesuffix("/status")
            current = self.objects.get(target)
            if current is None:
                return _status(404, "NotFound", f"{target} not found")
            if target != path:
                body = {"status": body.get("status")}
            return aiohttp.web.json_response(self._store(target, merge_patch(current, body)))
        if request.method == "PATCH" and request.content_type == "application/apply-patch+yaml":
            # One field manager (the operator's): the fields it applies are the object's data;
            # one it applied before and leaves out now is removed, as the API server does.
            return aiohttp.web.json_response(self._store(path, body))
        return _status(405, "MethodNotAllowed", request.method)

    def _store(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        stored = {
            **body,
            "metadata": {**body["metadata"], "resourceVersion": str(next(self._versions))},
        }
        self.objects[path] = stored
        return stored


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null removes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


@asynccontextmanager
async def fake_api(fake: FakeApi) -> AsyncIterator[KubeApi]:
    """A started `KubeApi` talking to `fake` over a real socket."""
    runner = aiohttp.web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    settings = KubeSettings(f"http://127.0.0.1:{port}", False, kube_client.Configuration())
    api = KubeApi(settings)
    await api.start()
    try:
        yield api
    finally:
        fake.closing.set()
        await api.stop()
        await runner.cleanup()
