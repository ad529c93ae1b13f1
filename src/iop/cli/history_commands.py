"""`iop config history`: the config revisions and how each came out, from the cluster or an Edge.

`--name NAME` reads the EdgeConfig's `.status.history` (the operator's cluster revisions, the
newest 20) through the Kubernetes API, with the kubeconfig's conventions (`--kubeconfig`, else
$KUBECONFIG, else ~/.kube/config; `--namespace`, else the context's, else `default`). `--admin
URL` reads a running Edge's own log instead (what `iop edge history` prints). One line per
revision, newest first: `*` marks the stable revision, `?` the candidate; its paths (live, and
restart-required with their scope) and its outcome with the check and why. `--json`: the
document as read. Exit codes: 0 done, 1 any failure. docs/operator.md, "Revisions".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1


def register(sub: Any) -> None:
    """Add `iop config history` to the `iop config` parser."""
    history = sub.add_parser(
        "history",
        help="list the config revisions of an EdgeConfig (or of an Edge) and how each came out",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = history.add_mutually_exclusive_group(required=True)
    source.add_argument("--name", metavar="NAME", help="the EdgeConfig (read from the cluster)")
    source.add_argument(
        "--admin", metavar="URL", help="an Edge's admin API instead, e.g. http://127.0.0.1:9090"
    )
    history.add_argument("--namespace", "-n", default=None, help="the EdgeConfig's namespace")
    history.add_argument("--kubeconfig", default=None, help="a kubeconfig (default: kubectl's)")
    history.add_argument(
        "--token-file", type=Path, default=None, help="with --admin: the admin bearer token"
    )
    history.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")
    history.add_argument("--json", action="store_true", help="print the document as read")
    history.set_defaults(run=_history)


def _history(args: argparse.Namespace) -> int:
    if args.admin is not None:
        # The Edge's own log: what `iop edge history` does, with its arguments.
        from .revision_commands import run_history

        return run_history(args, prog="iop config history")
    from kubernetes.config import ConfigException

    from iop.operator import OperatorError

    try:
        edgeconfig = asyncio.run(_read(args))
    except TimeoutError:
        print(f"iop config history: no answer within {args.timeout:.0f}s", file=sys.stderr)
        return EXIT_FAILED
    except (OperatorError, ConfigException, OSError, ValueError) as failed:
        print(f"iop config history: {failed}", file=sys.stderr)
        return EXIT_FAILED
    status = edgeconfig.get("status") or {}
    if args.json:
        import orjson

        document = {key: status.get(key) for key in ("revision", "rollout", "history")}
        sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
        return EXIT_OK
    sys.stdout.write(cluster_history_table(status))
    return EXIT_OK


async def _read(args: argparse.Namespace) -> dict[str, Any]:
    from iop.operator import conventions, kubeapi

    settings = await asyncio.to_thread(kubeapi.KubeSettings.load, args.kubeconfig)
    namespace = args.namespace or await asyncio.to_thread(_context_namespace, args.kubeconfig)
    path = kubeapi.resource_path(
        f"{conventions.GROUP}/{conventions.VERSION}", conventions.PLURAL, namespace, args.name
    )
    async with kubeapi.KubeApi(settings) as api:
        found: dict[str, Any] = await asyncio.wait_for(
            api.get(path, what=f"read EdgeConfig {namespace}/{args.name}"), args.timeout
        )
    return found


def _context_namespace(kubeconfig: str | None) -> str:
    """The namespace of the kubeconfig's current context, as kubectl takes it, else `default`."""
    from kubernetes import config as kube_config

    try:
        _, active = kube_config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    except (kube_config.ConfigException, OSError):
        return "default"
    return str((active or {}).get("context", {}).get("namespace") or "default")


def cluster_history_table(status: dict[str, Any]) -> str:
    """`.status.history` as the lines `iop config history --name` prints."""
    rollout = status.get("rollout") or {}
    marks = {rollout.get("stable"): "*", rollout.get("candidate"): "?"}
    lines = ["  REV  GEN  HASH          APPLIED               OUTCOME     PATHS / WHY"]
    for entry in status.get("history") or ():
        paths = [
            *entry.get("livePaths", ()),
            *(f"{p['path']} (restart {p['scope']})" for p in entry.get("restartPaths", ())),
        ]
        shown = ", ".join(paths) or "-"
        if entry.get("omittedPaths"):
            shown += f" (+{entry['omittedPaths']})"
        details = [f"paths: {shown}"]
        if entry.get("restores"):
            details.append(f"again the config of revision {entry['restores']}")
        why = entry.get("reason") or ""
        if entry.get("check"):
            why = f"{entry['check']}: {why}" if why else entry["check"]
        if why:
            details.append(why)
        lines.append(
            f"{marks.get(entry['revision'], ' ')} {entry['revision']:>3}  "
            f"{entry['generation']:>3}  {entry['configHash'][:12]}  {entry['appliedAt']:<20}  "
            f"{entry['outcome']:<10}  " + "; ".join(details)
        )
    if len(lines) == 1:
        lines.append("  (no revision yet: the operator has not applied this EdgeConfig)")
    return "\n".join(lines) + "\n"
