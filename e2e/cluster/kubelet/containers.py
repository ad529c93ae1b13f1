"""One container: a supervised process, its probes, its restarts, and its status.

A container of the project's image starts as podinit.py (which enters the pod's namespaces and
execs the command), in a session of its own so a signal reaches its whole process group. Its
container ID is `iop://<pid>`: tests read the PID from the status, as they would read a runtime's
ID. Crashes are restarted per the pod's restartPolicy with back-off (1 s doubling to 60 s, reset
after 60 s of running; the kubelet uses 10 s to 300 s, too slow for tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .probes import check, run_probe

Object = dict[str, Any]
log = logging.getLogger("kubelet.containers")

PODINIT = Path(__file__).resolve().with_name("podinit.py")
START_FAILED = 128  # podinit's exit code when it could not exec the command
BACKOFF_START, BACKOFF_MAX, BACKOFF_RESET = 1.0, 60.0, 60.0


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Launch:
    """What podinit.py needs to start the container (written as JSON next to its log)."""

    netns: str
    hostname: str
    #: The image's unpacked layers, bottom first (the overlay's lower layers, never written).
    layers: list[str]
    #: This container's writable layer (upper and work folders), new for every start.
    layer: str
    #: Where the container's root is mounted (in its own mount namespace only).
    root: str
    files: dict[str, str]
    mounts: list[dict[str, Any]]
    argv: list[str]
    env: dict[str, str]
    workdir: str
    user: dict[str, Any]
    capabilities: list[int]
    no_new_privs: bool
    read_only_root: bool


@dataclass
class Container:
    spec: Object
    log_dir: Path
    changed: Callable[[], None]
    image_id: str = ""
    state: Object = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Object = field(default_factory=dict)
    restart_count: int = 0
    ready: bool = False
    started: bool = False
    container_id: str = ""
    pid: int | None = None
    process: asyncio.subprocess.Process | None = None
    stopping: bool = False
    _probes: list[asyncio.Task[None]] = field(default_factory=list)
    _kill_reason: str = ""
    _pod_ip: str = ""
    _session: aiohttp.ClientSession | None = None

    @property
    def name(self) -> str:
        name: str = self.spec["name"]
        return name

    def log_path(self, restart: int | None = None) -> Path:
        return self.log_dir / f"{self.restart_count if restart is None else restart}.log"

    def status(self) -> Object:
        entry: Object = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": self.image_id,
            "state": self.state,
            "lastState": self.last_state,
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
        }
        if self.container_id:
            entry["containerID"] = self.container_id
        return entry

    def wait(self, reason: str, message: str = "") -> None:
        waiting: Object = {"reason": reason}
        if message:
            waiting["message"] = message
        self.state = {"waiting": waiting}
        self.ready = False
        self.changed()

    async def run_once(self, launch: Launch, pod_ip: str, session: aiohttp.ClientSession) -> int:
        """Start the process, probe it, wait for it to end; returns its exit code."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec_file = self.log_dir / f"{self.restart_count}.launch.json"
        # runc's exec fifo: podinit holds the write end, closed by its exec of the command (or
        # by its exit), so the container is reported running once the command runs.
        exec_read, exec_write = os.pipe()
        spec = {**launch.__dict__, "failure_exit_code": START_FAILED, "exec_fd": exec_write}
        spec_file.write_text(json.dumps(spec))
        try:
            with self.log_path().open("ab") as output:
                self.process = await asyncio.create_subprocess_exec(
                    sys.executable, "-S", str(PODINIT), str(spec_file),
                    stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output,
                    start_new_session=True, pass_fds=(exec_write,),
                )  # fmt: skip
        finally:
            os.close(exec_write)
        self.pid = self.process.pid
        self.container_id = f"iop://{self.pid}"
        try:
            await asyncio.to_thread(os.read, exec_read, 1)
        finally:
            os.close(exec_read)
        started_at = now()
        self.state = {"running": {"startedAt": started_at}}
        self._kill_reason = ""
        self._pod_ip, self._session = pod_ip, session
        self._start_probes(pod_ip, session)
        self.changed()
        code = await self.process.wait()
        for task in self._probes:
            task.cancel()
        self._probes.clear()
        self.pid = None
        reason = "Completed" if code == 0 else "Error"
        message = ""
        if self._kill_reason:
            reason = self._kill_reason
        elif code == START_FAILED:
            reason, message = "StartError", _last_line(self.log_path())
        terminated: Object = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": reason,
            "startedAt": started_at,
            "finishedAt": now(),
            "containerID": self.container_id,
        }
        if code < 0:
            terminated["signal"] = -code
        if message:
            terminated["message"] = message
        self.state = {"terminated": terminated}
        self.ready = False
        self.changed()
        return code

    def _start_probes(self, pod_ip: str, session: aiohttp.ClientSession) -> None:
        spec = self.spec
        startup, liveness, readiness = (
            spec.get("startupProbe"),
            spec.get("livenessProbe"),
            spec.get("readinessProbe"),
        )

        def pid() -> int | None:
            return self.pid

        def on_ready(ok: bool, _message: str) -> None:
            self.ready = ok and self.started
            self.changed()

        def on_alive(ok: bool, message: str) -> None:
            if not ok:
                log.info("%s: liveness probe failed (%s): restarting", self.name, message)
                self.kill("Error", signal.SIGTERM)

        def after_startup() -> None:
            self.started = True
            if liveness:
                self._spawn(run_probe(liveness, spec, pod_ip, pid, session, on_alive))
            if readiness:
                self._spawn(run_probe(readiness, spec, pod_ip, pid, session, on_ready))
            else:
                self.ready = True
            self.changed()

        self.started = False
        self.ready = False
        if startup:

            def on_started(ok: bool, message: str) -> None:
                if ok:
                    after_startup()
                else:
                    log.info("%s: startup probe failed (%s): restarting", self.name, message)
                    self.kill("Error", signal.SIGTERM)

            self._spawn(
                run_probe(startup, spec, pod_ip, pid, session, on_started, until_success=True)
            )
        else:
            after_startup()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine, name=f"probe:{self.name}")
        self._probes.append(task)

    def kill(self, reason: str, sig: signal.Signals) -> None:
        """Signal the container's process group (it runs in a session of its own)."""
        self._kill_reason = self._kill_reason or reason
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    async def stop(self, grace: float) -> None:
        """The preStop hook, SIGTERM, and SIGKILL once `grace` seconds have passed."""
        self.stopping = True
        process = self.process
        if process is None or process.returncode is not None:
            return
        deadline = time.monotonic() + grace
        hook = (self.spec.get("lifecycle") or {}).get("preStop")
        if hook:
            try:
                await asyncio.wait_for(self._pre_stop(hook, grace), grace)
            except TimeoutError:
                log.info("%s: preStop hook still running after the grace period", self.name)
        self.kill("", signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), max(deadline - time.monotonic(), 0.1))
        except TimeoutError:
            self.kill("", signal.SIGKILL)
            await process.wait()

    async def _pre_stop(self, hook: Object, grace: float) -> None:
        if "sleep" in hook:
            await asyncio.sleep(float(hook["sleep"]["seconds"]))
            return
        if self._session is None:
            return
        ok, message = await check(hook, self.spec, self._pod_ip, self.pid, self._session, grace)
        if not ok:
            log.info("%s: preStop hook failed: %s", self.name, message)

    def finished(self, code: int, policy: str) -> bool:
        """Whether the container stays down after exiting with `code` under `policy`."""
        if self.stopping:
            return True
        return policy == "Never" or (policy == "OnFailure" and code == 0)

    async def back_off(self, ran_for: float, attempt: int) -> None:
        delay = 0.0 if ran_for >= BACKOFF_RESET else min(BACKOFF_START * 2**attempt, BACKOFF_MAX)
        self.last_state = self.state
        self.restart_count += 1
        if delay:
            self.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:.0f}s restarting failed container={self.name}",
                }
            }
            self.changed()
            await asyncio.sleep(delay)


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""
