"""The kubelet's HTTPS endpoint, as far as `kubectl logs` needs it: /containerLogs and /healthz.

The API server proxies `kubectl logs` to the Node's InternalIP and kubelet port (from the Node's
status), presenting its kubelet client certificate; only clients with a certificate from the
cluster CA are served (no per-user authorization, unlike a real kubelet). exec, attach and
port-forward are not served.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

from aiohttp import web

from .contexts import LogContext

FOLLOW_POLL = 0.2


class LogServer:
    def __init__(self, kubelet: LogContext) -> None:
        self.kubelet = kubelet
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        config = self.kubelet.config
        context = ssl.create_default_context(
            ssl.Purpose.CLIENT_AUTH, cafile=config.credentials.ca_file
        )
        context.load_cert_chain(config.serving_cert, config.serving_key)
        context.verify_mode = ssl.CERT_REQUIRED
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", self.container_logs)
        for verb in ("exec", "attach", "portForward", "run"):
            app.router.add_route("*", f"/{verb}/{{tail:.*}}", self.unsupported)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, config.node_ip, config.serving_port, ssl_context=context)
        await site.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def unsupported(self, request: web.Request) -> web.Response:
        verb = request.path.split("/")[1]
        text = f"{verb} is not supported by the process kubelet (see e2e/cluster/README.md)"
        return web.Response(status=501, text=text)

    def _find(self, namespace: str, pod: str, name: str) -> tuple[Path, int, bool] | None:
        """(log folder, current restart count, whether it still runs) of one container."""
        for worker in self.kubelet.workers():
            meta = worker.pod["metadata"]
            if (meta["namespace"], meta["name"]) != (namespace, pod):
                continue
            for container in worker.containers + worker.init_containers:
                if container.name == name:
                    running = container.pid is not None
                    return container.log_dir, container.restart_count, running
        return None

    async def container_logs(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        found = self._find(info["namespace"], info["pod"], info["container"])
        if found is None:
            raise web.HTTPNotFound(text=f"container {info['container']} not found on this node")
        folder, restart, _ = found
        if request.query.get("previous") == "true":
            if restart == 0:
                raise web.HTTPBadRequest(text="previous terminated container not found")
            restart -= 1
        path = folder / f"{restart}.log"
        data = path.read_bytes() if path.exists() else b""
        tail = request.query.get("tailLines")
        if tail is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(tail) :]) if int(tail) > 0 else b""
        limit = request.query.get("limitBytes")
        if limit is not None:
            data = data[: int(limit)]
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        if request.query.get("follow") == "true":
            offset = path.stat().st_size if path.exists() else 0
            while True:
                current = self._find(info["namespace"], info["pod"], info["container"])
                if current is None or current[1] != restart:
                    break
                size = path.stat().st_size if path.exists() else 0
                if size > offset:
                    with path.open("rb") as handle:
                        handle.seek(offset)
                        chunk = handle.read(size - offset)
                    offset = size
                    await response.write(chunk)
                elif not current[2]:
                    break
                await asyncio.sleep(FOLLOW_POLL)
        await response.write_eof()
        return response
