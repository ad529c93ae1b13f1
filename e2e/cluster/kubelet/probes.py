"""Startup, liveness and readiness probes: httpGet, tcpSocket and exec, with the API's defaults.

Probes run from the host, which reaches every pod IP through the node namespace, as a kubelet
probes from the node. An exec probe runs its command inside the container's namespaces and root
(`nsenter --target PID`), as the container's user and with its environment, as a runtime's
exec does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

Object = dict[str, Any]


@dataclass(frozen=True)
class Settings:
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int

    @classmethod
    def of(cls, probe: Object) -> Settings:
        return cls(
            initial_delay=float(probe.get("initialDelaySeconds", 0)),
            period=float(probe.get("periodSeconds", 10)),
            timeout=float(probe.get("timeoutSeconds", 1)),
            success_threshold=int(probe.get("successThreshold", 1)),
            failure_threshold=int(probe.get("failureThreshold", 3)),
        )


def resolve_port(port: int | str, container: Object) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ValueError(f"no container port named {port!r}")


async def check(
    probe: Object,
    container: Object,
    pod_ip: str,
    pid: int | None,
    session: aiohttp.ClientSession,
    timeout: float,
) -> tuple[bool, str]:
    """One probe attempt: (succeeded, message)."""
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            scheme = get.get("scheme", "HTTP").lower()
            port = resolve_port(get["port"], container)
            host = get.get("host") or pod_ip
            path = get.get("path", "/")
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            headers.setdefault("User-Agent", "kube-probe/1.37")
            async with session.get(
                f"{scheme}://{host}:{port}{path}",
                headers=headers,
                ssl=False,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                ok = 200 <= response.status < 400
                return ok, f"HTTP probe failed with statuscode: {response.status}"
        if "tcpSocket" in probe:
            port = resolve_port(probe["tcpSocket"]["port"], container)
            host = probe["tcpSocket"].get("host") or pod_ip
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            return True, ""
        if "exec" in probe:
            if pid is None:
                return False, "container is not running"
            command = probe["exec"]["command"]
            uid, gid, env = _process_of(pid)
            process = await asyncio.create_subprocess_exec(
                "nsenter", f"--target={pid}", "--net", "--mount", "--uts", "--root", "--wd",
                f"--setuid={uid}", f"--setgid={gid}", "--", *command,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            )  # fmt: skip
            try:
                out, _ = await asyncio.wait_for(process.communicate(), timeout)
            except TimeoutError:
                process.kill()
                await process.wait()
                return False, f"command timed out after {timeout}s"
            return process.returncode == 0, out.decode(errors="replace")[-200:]
        if "grpc" in probe:
            return False, "grpc probes are not supported by this kubelet"
        return False, "probe has no handler"
    except (OSError, aiohttp.ClientError, TimeoutError, ValueError) as error:
        return False, f"probe failed: {type(error).__name__}: {error}"


def _process_of(pid: int) -> tuple[int, int, dict[str, str]]:
    """The user, group and environment of the container's process."""
    ids = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid"):
            ids[key] = int(value.split()[0])
    env = {}
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        name, sep, value = entry.decode(errors="replace").partition("=")
        if sep:
            env[name] = value
    return ids["Uid"], ids["Gid"], env


async def run_probe(
    probe: Object,
    container: Object,
    pod_ip: str,
    pid: Callable[[], int | None],
    session: aiohttp.ClientSession,
    report: Callable[[bool, str], None],
    *,
    until_success: bool = False,
) -> None:
    """Probe forever (or until the first success), calling `report` on every verdict change.

    The verdict starts unknown; it turns after successThreshold successes or failureThreshold
    failures in a row, as the kubelet's prober does.
    """
    settings = Settings.of(probe)
    await asyncio.sleep(settings.initial_delay)
    verdict: bool | None = None
    successes = failures = 0
    while True:
        ok, message = await check(probe, container, pod_ip, pid(), session, settings.timeout)
        if ok:
            successes, failures = successes + 1, 0
            if successes >= settings.success_threshold and verdict is not True:
                verdict = True
                report(True, "")
            if until_success and verdict:
                return
        else:
            successes, failures = 0, failures + 1
            if failures >= settings.failure_threshold and verdict is not False:
                verdict = False
                report(False, message)
                failures = 0
        await asyncio.sleep(settings.period)
