"""What the bench scripts share: loading each other, pinned tools' environments, /proc readers.

bench/ is no package, and its scripts run as `python -P bench/<name>.py`, which keeps their
folder off sys.path (bench/operator.py would shadow the standard library's `operator`); so no
script can `import benchkit`. Each loads this file by its path, in the same five lines (mypy,
which reads bench/ as a namespace package, takes `from bench import benchkit` instead), and
other scripts through `load_sibling`. Standard library only: it also runs inside the pinned
tools' own virtual environments (the `--inner` and `--serve` runs).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any


def load_sibling(name: str) -> ModuleType:
    """bench/`name`.py as the module `bench.<name>`, loaded once."""
    key = f"bench.{name}"  # never a top-level name: bench/operator.py is no `operator`
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def default_cache(name: str) -> Path:
    """`$XDG_CACHE_HOME/iop-bench/<name>`, where a script keeps its pinned tools."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "iop-bench" / name


def ensure_venv(
    venv: Path,
    packages: Sequence[str],
    *,
    project: Path | None = None,
    command: str = "python",
    announce: bool = False,
) -> Path:
    """`venv`'s bin/`command`, the environment built with uv first unless it holds `packages`."""
    found = venv / "bin" / command
    marker = venv / ".installed"  # what the environment was built with, written last
    wanted = list(packages)
    if project is not None:
        # A checkout whose locked dependencies (`uv export`) and itself (editable) go in too:
        # its lock's hash in the marker rebuilds the environment when the lock changes.
        wanted += [str(project), hashlib.sha256((project / "uv.lock").read_bytes()).hexdigest()]
    if marker.exists() and marker.read_text() == "\n".join(wanted) and found.exists():
        return found
    uv = shutil.which("uv")
    if uv is None:
        script = Path(sys.argv[0]).name
        raise SystemExit(f"bench/{script} needs uv on PATH (scripts/bootstrap installs it)")
    if announce:  # for an install that takes minutes (LiteLLM's)
        print(f"installing {' '.join(packages)} into {venv}", file=sys.stderr)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    requirements: list[str] = []
    if project is not None:
        exported = subprocess.run(
            [uv, "export", "--frozen", "--no-dev", "--no-hashes", "--no-emit-project", "--quiet"],
            check=True,
            capture_output=True,
            text=True,
            cwd=project,
        )
        (venv.parent / "requirements.txt").write_text(exported.stdout)
        requirements = ["-r", str(venv.parent / "requirements.txt")]
    python = f"{sys.version_info.major}.{sys.version_info.minor}"  # this interpreter's version
    env = {**os.environ, "VIRTUAL_ENV": str(venv)}
    subprocess.run([uv, "venv", "--quiet", "--python", python, str(venv)], check=True)
    subprocess.run([uv, "pip", "install", "--quiet", *requirements, *packages], check=True, env=env)
    if project is not None:
        subprocess.run(
            [uv, "pip", "install", "--quiet", "--no-deps", "-e", str(project)], check=True, env=env
        )
    marker.write_text("\n".join(wanted))
    return found


def cpu_seconds(*pids: int) -> float:
    """User + system CPU time the processes `pids` have used so far (Linux)."""
    ticks = 0
    for pid in pids:
        # After the command's closing parenthesis (a command may hold spaces and parentheses).
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


async def started_line(
    process: asyncio.subprocess.Process, who: str = "the Edge"
) -> dict[str, Any]:
    """The JSON line `process` prints on stdout once it listens (`who` names it in the error)."""
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    if not line:
        raise RuntimeError(f"{who} exited with {await process.wait()}")
    started: dict[str, Any] = json.loads(line)
    return started


async def until(condition: Callable[[], Any], timeout: float, interval: float = 0.02) -> float:
    """Poll `condition` (sync or async) until true; returns when it became true (monotonic)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic()
        if time.monotonic() > end:
            raise TimeoutError("condition not met")
        await asyncio.sleep(interval)
