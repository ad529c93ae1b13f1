"""Active health checks: each provider's upstream probed by a task of its own, and its load read.

A probe is `GET` on the upstream (`base_url` + `/models`, or the configured path on its host)
with the adapter's headers, on a new connection each time (`force_close`), bounded by the
policy's timeout; an answer below 400 passes. After a passing probe the same task reads a vLLM
server's load from its `/metrics` (asked again only after `_METRICS_RETRY_S` when it has none).
The runner, in a Node or in the Edge, turns the results into verdicts (`healthstates.py`) and
reports the changes. docs/edge.md, "Health" and "Choosing among equals", says why. Given an
upstream policy, a probe connects only to addresses it allows (`_PolicyResolver`; a provider the
policy refuses by its URL is never probed at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import aiohttp.abc

from iop.aiokits import guarded_task, stop_tasks
from iop.edgeconfig import HealthPolicy, UpstreamPolicy
from iop.wire import MAX_ADAPTERS, ServerLoad

from .adapters import Upstream

logger = logging.getLogger(__name__)

#: Seconds before a server whose /metrics told nothing is asked again.
_METRICS_RETRY_S: Final = 60.0
#: Most bytes of a /metrics answer read (vLLM's, histograms and all, is far below).
_METRICS_MAX_BYTES: Final = 4 * 1024 * 1024
_RUNNING: Final = "vllm:num_requests_running"
_WAITING: Final = "vllm:num_requests_waiting"
_KV_USAGE: Final = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
#: The LoRA adapters of the server's requests (labels running_lora_adapters,
#: waiting_lora_adapters, max_lora), its value the time it was set.
_LORA_INFO: Final = "vllm:lora_requests_info"
_LABEL: Final = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metrics_url(base_url: str) -> str:
    """Where a model server serves Prometheus metrics: `/metrics` on its host."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, "/metrics", "", ""))


def read_server_load(text: str) -> ServerLoad | None:
    """A server's load from its Prometheus text, or None when it has none of vLLM's names."""
    running = waiting = 0.0
    usage = 0.0
    found = False
    lora: tuple[float, str] | None = None  # the latest lora_requests_info: (stamp, its labels)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        value_text = rest.rpartition("}")[2] if "{" in line else rest
        fields = value_text.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if name == _RUNNING:
            running += value
            found = True
        elif name == _WAITING:
            waiting += value
            found = True
        elif name in _KV_USAGE:
            usage = max(usage, value)
        elif name == _LORA_INFO and (lora is None or value >= lora[0]):
            # vLLM sets a new label set to the time at each update and keeps the old ones:
            # the sample of the highest value is the server's state now.
            lora = (value, rest.rpartition("}")[0])
    if not found:
        return None
    load = ServerLoad(int(running), int(waiting), min(max(usage, 0.0), 1.0))
    if lora is not None:
        labels = _labels(lora[1])
        try:
            max_loras = int(float(labels.get("max_lora") or labels.get("max_loras") or 0))
        except ValueError:
            max_loras = 0
        load = replace(
            load,
            running_adapters=_names(labels.get("running_lora_adapters", "")),
            waiting_adapters=_names(labels.get("waiting_lora_adapters", "")),
            max_loras=max(0, max_loras),
        )
    return load


def _labels(text: str) -> dict[str, str]:
    """The labels of a Prometheus sample (what is between its braces), unescaped."""
    labels: dict[str, str] = {}
    for match in _LABEL.finditer(text):
        value = match.group(2)
        if "\\" in value:
            value = re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)
        labels[match.group(1)] = value
    return labels


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list of adapter names (vLLM's labels), bounded, blanks dropped."""
    names = (name.strip() for name in value.split(","))
    return tuple(name for name in names if name)[:MAX_ADAPTERS]


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
    #: Where the server's load is read (`/metrics` on its host); empty: nowhere.
    metrics_url: str = ""

    @classmethod
    def of(cls, provider_id: str, upstream: Upstream, policy: HealthPolicy) -> ProbeTarget:
        return cls(
            provider_id,
            probe_url(upstream.base_url, policy.path),
            policy.interval_ms / 1000,
            policy.timeout_ms / 1000,
            upstream.headers,
            metrics_url(upstream.base_url),
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
#: `on_load(provider_id, load)`: what the server's /metrics said after a passing probe.
LoadCallback = Callable[[str, ServerLoad], None]


class Prober:
    """Owns the probe tasks: `watch(targets)` starts, restarts and stops them; `aclose()` ends
    them all and closes the HTTP session they share."""

    def __init__(
        self,
        on_result: ResultCallback,
        on_load: LoadCallback | None = None,
        *,
        policy: UpstreamPolicy | None = None,
    ) -> None:
        self._on_result = on_result
        self._on_load = on_load
        self._policy = policy
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
        metrics_after = 0.0  # loop time before which /metrics is not read
        while True:
            started = loop.time()
            try:
                failure = await self.probe(target)
                self._on_result(target.provider_id, failure)
                if (
                    failure is None
                    and self._on_load is not None
                    and target.metrics_url
                    and started >= metrics_after
                ):
                    load = await self.read_load(target)
                    if load is None:
                        metrics_after = started + _METRICS_RETRY_S
                    else:
                        self._on_load(target.provider_id, load)
            except Exception:
                logger.exception("probing %s failed unexpectedly; carrying on", target.provider_id)
            await asyncio.sleep(max(0.0, started + target.interval - loop.time()))

    async def read_load(self, target: ProbeTarget) -> ServerLoad | None:
        """The server's load from its /metrics; None when it tells none (or cannot be read)."""
        session = self._session
        if session is None:
            return None
        try:
            async with _get(session, target, target.metrics_url) as response:
                if response.status != 200:
                    return None
                body = await response.content.read(_METRICS_MAX_BYTES)
        except (TimeoutError, aiohttp.ClientError):
            return None
        return read_server_load(body.decode("utf-8", "replace"))

    async def probe(self, target: ProbeTarget) -> str | None:
        """One probe: None when it passed, else what went wrong, in a sentence."""
        session = self._session
        if session is None:
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    force_close=True,
                    limit=0,
                    resolver=None if self._policy is None else _PolicyResolver(self._policy),
                ),
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
            )
        self.probes += 1
        url = target.shown_url
        try:
            async with _get(session, target, target.url) as response:
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


@contextlib.asynccontextmanager
async def _get(
    session: aiohttp.ClientSession, target: ProbeTarget, url: str
) -> AsyncIterator[aiohttp.ClientResponse]:
    """`GET url` as a probe sends it, and a read of the load too: with the adapter's headers,
    following no redirect, within the policy's timeout."""
    async with session.get(
        url,
        headers=target.headers,
        allow_redirects=False,
        timeout=aiohttp.ClientTimeout(total=target.timeout),
    ) as response:
        yield response


class _PolicyResolver(aiohttp.abc.AbstractResolver):
    """The default resolver, keeping only the addresses an upstream policy allows (a host with
    none fails like a name that does not resolve, saying why)."""

    def __init__(self, policy: UpstreamPolicy) -> None:
        self._policy = policy
        self._resolver = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[aiohttp.abc.ResolveResult]:
        found = await self._resolver.resolve(host, port, family)
        name = host.lower().rstrip(".")
        kept, refused = [], ""
        for result in found:
            address = ipaddress.ip_address(result["host"].split("%", 1)[0])
            problem = self._policy.address_problem(name, port, address)
            if problem is None:
                kept.append(result)
            else:
                refused = refused or problem
        if not kept:
            raise OSError(0, refused or f"{host} resolved to no address")
        return kept

    async def close(self) -> None:
        await self._resolver.close()


def _reason(error: OSError) -> str:
    """`Connection refused` rather than aiohttp's `Connect call failed ('10.0.0.1', 8000)`."""
    if not error.errno or error.errno < 0:
        return error.strerror or str(error)
    return os.strerror(error.errno)
