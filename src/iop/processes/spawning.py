"""Run `iop` commands as child processes: the fake upstream, an Edge, a Node.

`iop fake-upstream` and `iop edge run` print one JSON line on stdout once they listen (where
they listen); this module reads it, so tests, benchmarks and `iop up` can start them on port 0.
The caller owns what it starts: it stops it with `terminate`, or enters `owned(process)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson


def iop_command() -> list[str]:
    """How to start the `iop` command of this installation (the script beside the interpreter).

    Never `python -m` from the repository root: there, `operator/` would shadow the standard
    library's module.
    """
    script = Path(sys.executable).with_name("iop")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-P", "-c", "import sys; from iop.cli import main; sys.exit(main())"]


async def spawn_iop(
    *args: str,
    stdout: bool = False,
    stderr: bool | Path = False,
    open_files: int | None = None,
    env: Mapping[str, str] | None = None,
) -> asyncio.subprocess.Process:
    """`iop ARGS...`, unbuffered; stdout and stderr piped when asked, else inherited; stderr
    appended to a file when given its path. `open_files`: the child's open-file limit
    (`ulimit -n`), for a test of what happens at it; `env`: variables the child has on top of
    the caller's environment.

    Pipe only what you read: a child blocks once an unread pipe fills.
    """
    with contextlib.ExitStack() as files:
        errors: Any = asyncio.subprocess.PIPE if stderr is True else None
        if isinstance(stderr, Path):
            errors = files.enter_context(stderr.open("ab"))
        command = iop_command()
        if open_files is not None:
            # The shell sets the limit and becomes the command (no preexec_fn: not safe in a
            # process with threads).
            command = ["/bin/sh", "-c", f'ulimit -n {int(open_files)} && exec "$@"', "sh", *command]
        return await asyncio.create_subprocess_exec(
            *command,
            *args,
            stdout=asyncio.subprocess.PIPE if stdout else None,
            stderr=errors,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )


async def spawn_edge(
    config: Path,
    *extra: str,
    log_level: str = "WARNING",
    startup_timeout: float = 60.0,
    log_file: Path | None = None,
    open_files: int | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    """`iop edge run --config CONFIG`: the process and its start line (url, hub_port, admin_url).
    `log_file`: where its log goes (else the caller's stderr); `open_files`, `env`: see
    `spawn_iop`."""
    process = await spawn_iop(
        *("edge", "run", "--config", str(config), "--log-level", log_level, *extra),
        stdout=True,
        stderr=log_file or False,
        open_files=open_files,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), startup_timeout)
        if not line:
            raise RuntimeError(f"iop edge run exited with {await process.wait()}")
        started: dict[str, Any] = orjson.loads(line)
    except BaseException:
        await terminate(process)
        raise
    return process, started


async def spawn_node(
    hub_port: int,
    node_id: str,
    token_file: Path,
    *extra: str,
    log_level: str = "WARNING",
    env: Mapping[str, str] | None = None,
) -> asyncio.subprocess.Process:
    """`iop node run` dialing the Edge's node hub on 127.0.0.1:HUB_PORT (`env`: see
    `spawn_iop`)."""
    return await spawn_iop(
        *("node", "run", "--edge", f"127.0.0.1:{hub_port}", "--node-id", node_id),
        *("--token-file", str(token_file), "--log-level", log_level, *extra),
        env=env,
    )


@contextlib.asynccontextmanager
async def owned(process: asyncio.subprocess.Process) -> AsyncIterator[asyncio.subprocess.Process]:
    """`async with owned(await spawn_...(...))`: the process is terminated on the way out."""
    try:
        yield process
    finally:
        await terminate(process)


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
