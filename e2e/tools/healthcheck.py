"""What the GitOps tools make of an object's status, asked of the tools' own code.

- kstatus: `sigs.k8s.io/cli-utils`' library (Flux's health checks, Helm 4's `--wait`), called by
  the small command in `kstatus/` (its own Go module), built and cached by gotools.py;
- Argo CD: the Lua health check `deploy/argocd/edgeconfig-health.lua`, run in Lua 5.1 with only
  what Argo CD gives a health check, through `lupa` (a dev dependency: run this with `uv run`).
Standard library only at import, like chartcheck.py. e2e/tools/README.md ("kstatus") says more.

    python3 -m e2e.tools.healthcheck build     build kstatus unless up to date; print its path
    uv run python -m e2e.tools.healthcheck [FILE...]
                                               both verdicts for each object (stdin: -)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import gotools

if TYPE_CHECKING:
    import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

KSTATUS = gotools.GoTool("kstatus", package=".", module="sigs.k8s.io/cli-utils")
ARGOCD_HEALTH = REPO / "deploy" / "argocd" / "edgeconfig-health.lua"

#: What Argo CD accepts from a health check (gitops-engine's HealthStatusCode); anything else
#: it shows as Unknown, "Lua returned an invalid health status".
ARGOCD_STATUSES = frozenset(
    {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}
)


class HealthError(Exception):
    """A tool failed to give a verdict: the message says which and why."""


@dataclass(frozen=True)
class Verdict:
    """One tool's reading of one object."""

    status: str
    message: str


def build_kstatus() -> Path:
    """The kstatus binary for the pin, built first if the cache does not have it."""
    return KSTATUS.build()


def kstatus(objects: Sequence[Mapping[str, Any]], binary: Path) -> list[Verdict]:
    """kstatus's verdict on each object, in order (one process for all of them)."""
    stream = "\n".join(json.dumps(obj) for obj in objects)
    result = subprocess.run(
        [str(binary), "-o", "json"],
        input=stream,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise HealthError(f"kstatus exited with {result.returncode}: {result.stderr.strip()}")
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    if len(lines) != len(objects):
        raise HealthError(f"kstatus answered {len(lines)} lines for {len(objects)} objects")
    return [Verdict(line["status"], line["message"]) for line in lines]


# Argo CD runs a health check from argocd-cm in a gopher-lua state with SkipOpenLibs and then
# only the package, base and table libraries and its safe os (util/lua/lua.go, runLua): no
# string or math library, and strings have no methods. This sandbox gives the script the same,
# or less, so a script that passes here does not fail in Argo CD for want of a function.
_SANDBOX = """
debug.setmetatable("", nil)
local base = {"assert", "error", "getmetatable", "ipairs", "next", "pairs", "pcall", "print",
  "rawequal", "rawget", "rawset", "select", "setmetatable", "tonumber", "tostring", "type",
  "unpack", "xpcall", "_VERSION"}
return function(source, name, obj)
  local env = {}
  for _, key in ipairs(base) do env[key] = _G[key] end
  env._G = env
  env.table = {concat = table.concat, insert = table.insert, remove = table.remove,
    sort = table.sort, maxn = table.maxn, getn = table.getn}
  env.os = {time = os.time, date = os.date, clock = os.clock, difftime = os.difftime}
  env.obj = obj
  local chunk, problem = loadstring(source, "=" .. name)
  if chunk == nil then error(problem, 0) end
  setfenv(chunk, env)
  return chunk()
end
"""


class ArgoHealth:
    """Argo CD's verdict on objects by a Lua health check (one Lua runtime, reused)."""

    def __init__(self, script: Path = ARGOCD_HEALTH) -> None:
        try:
            from lupa import lua51
        except ImportError as error:
            raise HealthError(
                "running the Argo CD health check needs lupa, a dev dependency of the "
                "checkout: run from its virtualenv (uv run)"
            ) from error
        self._lua = lua51.LuaRuntime(register_eval=False, register_builtins=False)
        self._errors = (lua51.LuaError, lua51.LuaSyntaxError)
        self._type = lua51.lua_type
        self._run = self._lua.execute(_SANDBOX)
        self.script = script
        self._source = script.read_text()

    def _table(self, value: Any) -> Any:
        """A JSON value as Argo CD hands it to Lua (decodeValue): objects and arrays become
        tables (arrays 1-based), null becomes nil (an absent key)."""
        if isinstance(value, Mapping):
            table = self._lua.table()
            for key, item in value.items():
                if item is not None:
                    table[key] = self._table(item)
            return table
        if isinstance(value, list):
            return self._lua.table(*(self._table(item) for item in value))
        return value

    def __call__(self, obj: Mapping[str, Any]) -> Verdict:
        try:
            returned = self._run(self._source, self.script.name, self._table(obj))
        except self._errors as error:
            raise HealthError(f"{self.script.name} failed: {error}") from error
        if self._type(returned) != "table":
            raise HealthError(f"{self.script.name} returned {returned!r}, not a table")
        status, message = returned["status"], returned["message"]
        if status not in ARGOCD_STATUSES:
            raise HealthError(f"{self.script.name} returned the status {status!r}")
        return Verdict(str(status), "" if message is None else str(message))


#: kstatus's status -> the Argo CD health status that says the same thing.
AGREEING = {
    "Current": "Healthy",
    "InProgress": "Progressing",
    "Failed": "Degraded",
    "Terminating": "Progressing",
}


@dataclass(frozen=True)
class Reading:
    """Both tools' verdicts on one object."""

    kstatus: Verdict
    argocd: Verdict

    @property
    def agree(self) -> bool:
        return AGREEING.get(self.kstatus.status) == self.argocd.status


class HealthReaders:
    """kstatus and the Argo CD health check, ready to read objects."""

    def __init__(self, kstatus_binary: Path, argocd: ArgoHealth) -> None:
        self.kstatus_binary = kstatus_binary
        self.argocd = argocd

    @classmethod
    def prepare(cls) -> HealthReaders:
        """Build kstatus unless the cache has it; load the Lua check."""
        return cls(build_kstatus(), ArgoHealth())

    def read(self, objects: Sequence[Mapping[str, Any]]) -> list[Reading]:
        verdicts = kstatus(objects, self.kstatus_binary)
        return [Reading(v, self.argocd(o)) for o, v in zip(objects, verdicts, strict=True)]

    def read_one(self, obj: Mapping[str, Any]) -> Reading:
        return self.read([obj])[0]


#: The fixture that needs the readers: what `collection_finished` looks for.
FIXTURE = "health_readers"
_STASH = "iop_health_readers"


def collection_finished(session: pytest.Session) -> None:
    """For a conftest's `pytest_collection_finish`: when a selected test needs the readers,
    build them once, with pytest's output capture off so a cold build's progress shows (outside
    any test's timeout); a failure is kept for every such test to fail with. Nothing is skipped."""
    config = session.config
    if config.option.collectonly or hasattr(config, _STASH):
        return
    if any(FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        setattr(config, _STASH, _prepare(config))


def readers_for(config: pytest.Config) -> HealthReaders:
    """For the conftests' `health_readers` fixture: the readers, or the test fails with why
    there are none (tests/gitops, e2e/operator)."""
    if not hasattr(config, _STASH):
        setattr(config, _STASH, _prepare(config))
    prepared: HealthReaders | str = getattr(config, _STASH)
    if isinstance(prepared, str):
        import pytest

        pytest.fail(prepared, pytrace=False)
    return prepared


def _prepare(config: pytest.Config) -> HealthReaders | str:
    capture = config.pluginmanager.getplugin("capturemanager")
    try:
        if capture is None:
            return HealthReaders.prepare()
        with capture.global_and_fixture_disabled():
            return HealthReaders.prepare()
    except Exception as error:
        return f"kstatus or the Argo CD check was not prepared: {type(error).__name__}: {error}"


def objects_of(documents: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The objects of `kubectl get -o json` documents: an object, or a List's items."""
    found: list[Mapping[str, Any]] = []
    for document in documents:
        if str(document.get("kind", "")).endswith("List") and "items" in document:
            found += document["items"] or []
        else:
            found.append(document)
    return found


def read_documents(paths: Sequence[str]) -> list[Mapping[str, Any]]:
    decoder = json.JSONDecoder()
    documents: list[Mapping[str, Any]] = []
    for path in paths:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        position = 0
        while True:
            while position < len(text) and text[position].isspace():
                position += 1
            if position >= len(text):
                break
            document, position = decoder.raw_decode(text, position)
            documents.append(document)
    return documents


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["-"], help="`build`, or JSON files (- stdin)")
    args = parser.parse_args(argv)
    try:
        if args.paths == ["build"]:
            print(build_kstatus())
            return 0
        objects = objects_of(read_documents(args.paths))
        readings = HealthReaders.prepare().read(objects)
        for obj, reading in zip(objects, readings, strict=True):
            who = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
            print(f"{who}: kstatus {reading.kstatus.status} ({reading.kstatus.message})")
            print(f"{who}: Argo CD {reading.argocd.status} ({reading.argocd.message})")
        return 0
    except (HealthError, gotools.ToolError, ValueError) as error:
        print(f"healthcheck: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
