"""Run `iop fake-upstream` as a child process and learn where it listens.

The server prints one JSON line on stdout once it listens (`{"listen": ..., "base_url": ...}`);
this module reads it, so tests, benchmarks and `iop up` can start it on port 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

__all__ = ["UpstreamProcess", "iop_command", "spawn_fake_upstream", "terminate"]


def iop_command() -> list[str]:
    """How to start the `iop` command of this installation (the script beside the interpreter).

    Never `python -m` from the repository root: there, `operator/` would shadow the standard
    library's module.
    """
    script = Path(sys.executable).with_name("iop")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-P", "-c", "import sys; from iop.cli import main; sys.exit(main())"]


@dataclass(frozen=True, slots=True)
class UpstreamProcess:
    pid: int
    listen: str
    base_url: str


@contextlib.asynccontextmanager
async def spawn_fake_upstream(
    args: Sequence[str] = (), *, startup_timeout: float = 20.0
) -> AsyncIterator[UpstreamProcess]:
    """Start `iop fake-upstream --listen 127.0.0.1:0 ARGS...`; on exit SIGTERM it (then kill)."""
    process = await asyncio.create_subprocess_exec(
        *iop_command(),
        "fake-upstream",
        "--listen",
        "127.0.0.1:0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), startup_timeout)
        if not line:
            raise RuntimeError(f"iop fake-upstream exited early with {await process.wait()}")
        info = orjson.loads(line)
        yield UpstreamProcess(pid=process.pid, listen=info["listen"], base_url=info["base_url"])
    finally:
        await terminate(process)


async def terminate(process: asyncio.subprocess.Process, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; waits for the exit either way."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            process.kill()
            await process.wait()
