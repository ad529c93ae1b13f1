"""`iop up`: the whole product on this machine, from one config file, in one command.

It starts a fake OpenAI-compatible upstream, an Edge and one Node per node of the config, as
real processes, and prints the URL, an API key and examples to paste. The config is rewritten
for the local stack only (the file is never changed): `openai` adapters point at the fake
upstream, listeners move to loopback, each node gets a fresh token and a client key `local-up`
is added. A SIGHUP rewrites the edited file the same way and has the Edge apply it live through
its admin API. docs/edge.md, "Running it locally: `iop up`", has the details.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import uvloop
import yaml

from iop.aiokits import guarded_task, stop_tasks
from iop.edgeconfig import ConfigError, EdgeConfig, load_data, load_file, token_sha256
from iop.processes import owned, spawn_edge, spawn_fake_upstream, spawn_node

from .problems import print_problems

logger = logging.getLogger("iop.up")

DEFAULT_CONFIG = Path("configs/edge.yaml")
LOCAL_TOKEN_REF = "local-up"
LOCAL_PRINCIPAL = "local"
READY_TIMEOUT_S = 30.0


def register(up: argparse.ArgumentParser) -> None:
    """Add the arguments of `iop up` to its parser."""
    up.description = __doc__
    up.formatter_class = argparse.RawDescriptionHelpFormatter
    up.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help=f"the edge.yaml to run (default: {DEFAULT_CONFIG})",
    )
    up.add_argument("--port", type=int, default=0, help="port of the OpenAI API (default: free)")
    up.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line (url, api_key, models, pids) instead of the examples",
    )
    up.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level of the processes (default: WARNING)",
    )
    up.set_defaults(run=_run)


@dataclass(frozen=True, slots=True)
class LocalStack:
    """What `iop up` runs: the rewritten config, and the secrets it made for it."""

    config: EdgeConfig
    api_key: str
    node_tokens: dict[str, str]


def local_config(
    config: EdgeConfig, upstream_url: str, port: int = 0, *, keep: LocalStack | None = None
) -> LocalStack:
    """`config` rewritten for a stack on this machine (see the module docstring); with `keep`,
    the API key and node tokens of that stack are kept (a reload of a running stack)."""
    document = config.model_dump(mode="json")
    document["edge"]["listen"] = "127.0.0.1:0"
    document["edge"]["admin"]["listen"] = "127.0.0.1:0"
    document["edge"]["metrics"]["listen"] = "127.0.0.1:0"
    document["openai"]["listen"] = f"127.0.0.1:{port}"
    document["a2a"]["listen"] = ""
    api_key = keep.api_key if keep is not None else f"sk-local-{secrets.token_urlsafe(18)}"
    tokens = document["openai"]["principal_tokens"]
    tokens[:] = [t for t in tokens if t["token_ref"] != LOCAL_TOKEN_REF]
    tokens.append(
        {
            "token_ref": LOCAL_TOKEN_REF,
            "token_hash_sha256": token_sha256(api_key),
            "principal_ref": LOCAL_PRINCIPAL,
            "alias": "iop up",
        }
    )
    node_tokens: dict[str, str] = {}
    kept = keep.node_tokens if keep is not None else {}
    for node in document["nodes"]:
        if node.get("placement") != "edge":  # a node placed on the Edge runs in it: no Node
            token = kept.get(node["id"]) or secrets.token_urlsafe(24)
            node_tokens[node["id"]] = token
            node["token_hash_sha256"] = token_sha256(token)
        for provider in node["providers"]:
            if provider["adapter"]["type"] == "openai":
                provider["adapter"] = {"type": "openai", "base_url": upstream_url}
    return LocalStack(load_data(document), api_key, node_tokens)


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = load_file(args.config)
    except ConfigError as error:
        print_problems(str(args.config), error)
        return 1
    if not 0 <= args.port <= 65535:
        print("iop up: --port must be 0..65535", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="iop-up-"))
    try:
        return uvloop.run(_up(config, args, folder))
    except KeyboardInterrupt:
        return 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class _Running:
    """The processes `iop up` started, and where they answer."""

    local: LocalStack
    upstream_url: str
    config_path: Path
    url: str
    admin_url: str
    metrics_url: str
    #: A name for each process (`edge`, `node node-1`, ...) and its pid.
    pids: dict[str, int]
    #: The children whose end ends the stack (the fake upstream is owned by its context).
    children: list[asyncio.subprocess.Process]


async def _up(config: EdgeConfig, args: argparse.Namespace, folder: Path) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        running = await _start(stack, config, args, folder)
        if running is None:
            return 1
        wanted = {p.id for n in running.local.config.nodes for p in n.providers if p.enabled}
        missing = await _wait_ready(running.url, wanted)
        if missing:
            print(
                f"iop up: still not available after {READY_TIMEOUT_S:.0f}s: "
                f"{', '.join(sorted(missing))}",
                file=sys.stderr,
            )
        _announce(running, args)
        died = await _serve(running, args, stop)
    return 1 if died else 0


async def _start(
    stack: contextlib.AsyncExitStack, config: EdgeConfig, args: argparse.Namespace, folder: Path
) -> _Running | None:
    """The fake upstream, the Edge and one Node per node, owned by `stack`; None (said on
    stderr) when the Edge did not start."""
    upstream = await stack.enter_async_context(spawn_fake_upstream())
    local = local_config(config, upstream.base_url, args.port)
    config_path = folder / "edge.yaml"
    config_path.write_text(yaml.safe_dump(local.config.model_dump(mode="json")))
    try:
        edge_process, started = await spawn_edge(
            config_path, log_level=args.log_level, startup_timeout=READY_TIMEOUT_S
        )
    except (RuntimeError, TimeoutError) as error:
        print(f"iop up: the Edge did not start: {error!r}", file=sys.stderr)
        return None
    edge = await stack.enter_async_context(owned(edge_process))
    running = _Running(
        local=local,
        upstream_url=upstream.base_url,
        config_path=config_path,
        url=started["url"],
        admin_url=started["admin_url"],
        metrics_url=started["metrics_url"],
        pids={"fake-upstream": upstream.pid, "edge": edge.pid},
        children=[edge],
    )
    for node_id, token in local.node_tokens.items():
        token_file = folder / f"{node_id}.token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        node_process = await spawn_node(
            started["hub_port"], node_id, token_file, log_level=args.log_level
        )
        node = await stack.enter_async_context(owned(node_process))
        running.pids[f"node {node_id}"] = node.pid
        running.children.append(node)
    return running


def _announce(running: _Running, args: argparse.Namespace) -> None:
    """What to type: the URL and API key, as JSON with `--json`, else the banner."""
    models = [model.id for model in running.local.config.models]
    if args.json:
        document = {
            "url": running.url,
            "base_url": f"{running.url}/v1",
            "api_key": running.local.api_key,
            "models": models,
            "admin_url": running.admin_url,
            "metrics_url": running.metrics_url,
            "pids": running.pids,
        }
        print(orjson.dumps(document).decode(), flush=True)
        return
    banner = _banner(
        running.url, running.local.api_key, models, running.pids, args.config, running.metrics_url
    )
    print(banner, flush=True)
    print(
        f"Admin:   {running.admin_url}/config    Edit {args.config}, then "
        f"`kill -HUP {os.getpid()}` to apply it live.",
        flush=True,
    )


async def _serve(running: _Running, args: argparse.Namespace, stop: asyncio.Event) -> bool:
    """Until a signal, or a child's death (the stack would be half there), applying the config
    file again on SIGHUP; whether a child died."""
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Task[None]] = set()

    def hangup() -> None:
        reload = _reload(
            args.config,
            running.local,
            running.upstream_url,
            args.port,
            running.config_path,
            running.admin_url,
        )
        task = guarded_task(reload, name="iop-up-reload", logger=logger)
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, hangup)
    watchers = [
        guarded_task(_exited(child, stop), name=f"iop-up-watch-{child.pid}", logger=logger)
        for child in running.children
    ]
    try:
        await stop.wait()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        await stop_tasks([*watchers, *reloads])
    died = [child for child in running.children if child.returncode is not None]
    for child in died:
        print(f"iop up: process {child.pid} exited with {child.returncode}", file=sys.stderr)
    return bool(died)


async def _reload(
    path: Path,
    running: LocalStack,
    upstream_url: str,
    port: int,
    config_path: Path,
    admin_url: str,
) -> None:
    """SIGHUP: the edited config, localised with the running stack's tokens, applied live."""
    try:
        config = await asyncio.to_thread(load_file, path)
    except ConfigError as error:
        print_problems(f"iop up: {path}", error)
        return
    local = local_config(config, upstream_url, port, keep=running)
    text = yaml.safe_dump(local.config.model_dump(mode="json"))
    await asyncio.to_thread(config_path.write_text, text)
    async with httpx.AsyncClient(base_url=admin_url, timeout=60) as admin:
        response = await admin.post("/refresh", json={"mode": "apply"})
    report = response.json()
    message = report.get("message") or report.get("error", {}).get("message", "")
    print(f"iop up: reload of {path}: {message}", file=sys.stderr, flush=True)


async def _exited(process: asyncio.subprocess.Process, stop: asyncio.Event) -> None:
    await process.wait()
    stop.set()


async def _wait_ready(url: str, wanted: set[str]) -> set[str]:
    """Wait until the Edge can dispatch to every wanted provider; returns those still missing."""
    loop = asyncio.get_running_loop()
    until = loop.time() + READY_TIMEOUT_S
    missing = set(wanted)
    async with httpx.AsyncClient(base_url=url, timeout=2.0) as http:
        while loop.time() < until:
            with contextlib.suppress(httpx.HTTPError):
                response = await http.get("/readyz")
                missing = wanted - set(response.json().get("providers_available", ()))
                if response.status_code == 200 and not missing:
                    return set()
            await asyncio.sleep(0.05)
    return missing


def _banner(
    url: str,
    api_key: str,
    models: list[str],
    processes: dict[str, int],
    config: Path,
    metrics_url: str,
) -> str:
    model = models[-1] if models else "MODEL"
    body = orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hello!"}]}
    ).decode()
    pids = ", ".join(f"{name} {pid}" for name, pid in processes.items())
    return f"""\
IOP Edge is up on {url}/v1 (from {config}; {pids})
API key: {api_key}
Models:  {", ".join(models)}

Try it with curl:

curl {url}/v1/chat/completions \\
  -H "Authorization: Bearer {api_key}" \\
  -H "Content-Type: application/json" \\
  -d {shlex.quote(body)}

or with the openai Python client:

python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{api_key}")
reply = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}]
)
print(reply.choices[0].message.content)
EOF

Metrics: {metrics_url}/metrics    Press Ctrl-C to stop."""
