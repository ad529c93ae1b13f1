"""The HTTPS server the API server sends admission reviews to (kopf's webhook server protocol).

kopf's own `WebhookServer` keeps aiohttp's default body limit of 1 MiB, and an AdmissionReview
of an UPDATE carries the object twice (`object` and `oldObject`): an EdgeConfig of a few hundred
nodes would be refused with 413 before kopf saw it, and with `failurePolicy: Ignore` admitted
unchecked. This server takes bodies up to `MAX_BODY` (two copies of the largest object etcd
stores, with room to spare), with the operator's own certificate (`certificates.py`), and hands
each review to kopf, which runs the `kopf.on.validate` handlers.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator
from typing import Any, Final

import aiohttp.web
import kopf
import orjson

from iop.aiokits import split_listener

from .certificates import SelfSignedCertificate

logger = logging.getLogger(__name__)

#: Largest admission review accepted: etcd stores objects up to 1.5 MiB, a review holds two.
MAX_BODY: Final = 8 * 1024 * 1024


class AdmissionServer:
    """Serves `POST /<handler id>` on `listen` over TLS until cancelled (kopf's protocol: an
    async iterator yielding the client config once the socket listens)."""

    def __init__(self, listen: str, certificate: SelfSignedCertificate, url: str) -> None:
        self._host, self._port = split_listener(listen)
        self._certificate = certificate
        self._url = url

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        context = self._certificate.server_context()

        async def review(request: aiohttp.web.Request) -> aiohttp.web.Response:
            try:
                document = orjson.loads(await request.read())
            except orjson.JSONDecodeError as exc:
                raise aiohttp.web.HTTPBadRequest(reason=f"not JSON: {exc}") from exc
            try:
                answer = await fn(
                    document,
                    webhook=request.match_info["id"],
                    headers=dict(request.headers),
                    sslpeer=_peer(request),
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a malformed review (kopf's own checks), not a bad object
                logger.warning("admission review refused: %r", exc)
                raise aiohttp.web.HTTPBadRequest(reason=str(exc)[:200] or repr(exc)) from exc
            return aiohttp.web.Response(body=orjson.dumps(answer), content_type="application/json")

        app = aiohttp.web.Application(client_max_size=MAX_BODY)
        app.add_routes([aiohttp.web.post("/{id}", review)])
        runner = aiohttp.web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        try:
            site = aiohttp.web.TCPSite(runner, self._host, self._port, ssl_context=context)
            await site.start()
            logger.info("admission webhook listening on %s:%d", self._host, self._port)
            bundle = base64.b64encode(self._certificate.cert_pem).decode()
            yield kopf.WebhookClientConfig(url=self._url, caBundle=bundle)
            await asyncio.Event().wait()  # serve until kopf stops (cancels) us
        finally:
            await runner.cleanup()


def _peer(request: aiohttp.web.Request) -> dict[str, Any]:
    transport = request.transport
    certificate = transport.get_extra_info("peercert") if transport is not None else None
    return dict(certificate) if isinstance(certificate, dict) else {}
