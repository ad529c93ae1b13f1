"""Active health checks: the Node probes each provider's upstream, one task per provider.

A probe is `GET` on the upstream (`base_url` + `/models` by default, which every
OpenAI-compatible server answers, or the configured path on the upstream's host, such as
vLLM's `/health`) with the adapter's own headers (its API key), bounded by the policy's timeout;
an answer below 400 passes. Each probed provider has one task, named after it, that probes
every `interval_ms` from one probe's start to the next; the router turns the results into
verdicts (`healthstates.py`) and reports the changes to every Edge.

Probes dial a new connection each time (`force_close`), apart from the adapter's pool: a pool
full of long completions must not make a probe wait for a connection and fail, and a probe
should see what a new request would (a refused connection), not a kept-alive socket. Only
adapters with an upstream are probed (the `fake` adapter answers in-process).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from iop.aiokits import guarded_task, stop_tasks
from iop.edgeconfig import HealthPolicy

from .adapters import Upstream

__all__ = ["ProbeTarget", "Prober", "probe_url"]

logger = logging.getLogger(__name__)


def probe_url(base_url: str, path: str | None) -> str:
    """What a probe GETs: `base_url` + `/models`, or `path` on the upstream's host."""
    if path is None:
        return base_url.rstrip("/") + "/models"
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """One provider's probe: where, with which headers, how often and how patiently."""

    provider_id: str
    url: str
    interval: float
    timeout: float
    #: May hold the API key: never shown.
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, provider_id: str, upstream: Upstream, policy: HealthPolicy) -> ProbeTarget:
        return cls(
            provider_id,
            probe_url(upstream.base_url, policy.path),
            policy.interval_ms / 1000,
            policy.timeout_ms / 1000,
            upstream.headers,
        )

    @property
    def shown_url(self) -> str:
        """The URL for logs and status pages: without userinfo, which may be a credential."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{host}:{parts.port}" if parts.port is not None else host
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


#: `on_result(provider_id, failure)`: failure is None when the probe passed.
ResultCallback = Callable[[str, str | None], None]


class Prober:
    """Owns the probe tasks: `watch(targets)` starts, restarts and stops them; `aclose()` ends
    them all and closes the HTTP session they share."""

    def __init__(self, on_result: ResultCallback) -> None:
        self._on_result = on_result
        self._targets: dict[str, ProbeTarget] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        #: Probes sent since start (every provider), for tests and benchmarks.
        self.probes = 0

    @property
    def targets(self) -> Mapping[str, ProbeTarget]:
        return self._targets

    def watch(self, targets: Mapping[str, ProbeTarget]) -> None:
        """Probe exactly `targets` from now on: a provider whose target changed starts over."""
        for provider_id in list(self._tasks):
            if targets.get(provider_id) != self._targets.get(provider_id):
                self._stop(provider_id)
        for provider_id, target in targets.items():
            if provider_id not in self._tasks:
                self._targets[provider_id] = target
                task = guarded_task(
                    self._probe_forever(target), name=f"probe-{provider_id}", logger=logger
                )
                self._tasks[provider_id] = task

    async def aclose(self) -> None:
        for provider_id in list(self._tasks):
            self._stop(provider_id)
        await stop_tasks(self._stopping)
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _stop(self, provider_id: str) -> None:
        task = self._tasks.pop(provider_id)
        del self._targets[provider_id]
        task.cancel()
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _probe_forever(self, target: ProbeTarget) -> None:
        """Probe every interval until cancelled. Anything unexpected is logged with its
        traceback and the next probe runs: a provider nobody probes would never come back."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                failure = await self.probe(target)
                self._on_result(target.provider_id, failure)
            except Exception:
                logger.exception("probing %s failed unexpectedly; carrying on", target.provider_id)
            await asyncio.sleep(max(0.0, started + target.interval - loop.time()))

    async def probe(self, target: ProbeTarget) -> str | None:
        """One probe: None when it passed, else what went wrong, in a sentence."""
        session = self._session
        if session is None:
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0),
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
            )
        self.probes += 1
        url = target.shown_url
        try:
            async with session.get(
                target.url,
                headers=target.headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=target.timeout),
            ) as response:
                status = response.status
        except TimeoutError:
            return f"no answer from GET {url} within {target.timeout:g}s"
        except aiohttp.ClientConnectorError as exc:
            return f"cannot connect to {url}: {_reason(exc.os_error)}"
        except aiohttp.ClientError as exc:
            return f"GET {url} failed: {exc or type(exc).__name__}"
        if status >= 400:
            return f"GET {url} answered HTTP {status}"
        return None


def _reason(error: OSError) -> str:
    """`Connection refused` rather than aiohttp's `Connect call failed ('10.0.0.1', 8000)`."""
    if not error.errno or error.errno < 0:
        return error.strerror or str(error)
    return os.strerror(error.errno)
