"""`iop edge reload`: have a running Edge apply (or dry-run) a config, and show the report.

Without `--config` the Edge re-reads the file it was started from (what SIGHUP does); with it,
this command sends the file's text, so the Edge may run on another machine. The report (JSON)
goes to stdout, its one-line summary to stderr. Exit codes: 0 applied (or no change, or a dry run
that could apply live), 2 restart-required (an apply is refused and nothing changed), 1 invalid
config, a config the Edge rolled back (docs/rollout.md) or any other failure (unreachable Edge,
wrong token, ...).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson

from .revision_commands import TOKEN_HINT, AdminCallFailed, admin_arguments, admin_headers

EXIT_APPLIED = 0
EXIT_INVALID = 1
EXIT_RESTART_REQUIRED = 2


def register(sub: Any) -> None:
    """Add `iop edge reload` to the `iop edge` parser."""
    reload = sub.add_parser(
        "reload",
        help="apply (or dry-run) a config on a running Edge through its admin API",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    admin_arguments(reload, timeout=60.0)
    reload.add_argument(
        "--config",
        type=Path,
        default=None,
        help="send this edge.yaml (default: the Edge re-reads its own config file)",
    )
    reload.add_argument(
        "--dry-run", action="store_true", help="validate and classify only; change nothing"
    )
    reload.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    body: dict[str, object] = {"mode": "dry_run" if args.dry_run else "apply"}
    try:
        if args.config is not None:
            body["config_yaml"] = args.config.read_text(encoding="utf-8")
        headers = admin_headers(args.token_file)
    except (OSError, UnicodeDecodeError, AdminCallFailed) as exc:
        print(f"iop edge reload: {exc}", file=sys.stderr)
        return EXIT_INVALID
    url = args.admin.rstrip("/") + "/refresh"
    try:
        response = httpx.post(
            url, content=orjson.dumps(body), headers=headers, timeout=args.timeout
        )
    except httpx.HTTPError as exc:
        print(f"iop edge reload: cannot reach {url}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        document = response.json()
    except ValueError:
        document = None
    if not isinstance(document, dict) or "outcome" not in document:
        error = document.get("error") if isinstance(document, dict) else None
        detail = error.get("message") if isinstance(error, dict) else response.text[:200]
        hint = TOKEN_HINT if response.status_code == 401 else ""
        print(
            f"iop edge reload: {response.status_code} from {url}: {detail}{hint}", file=sys.stderr
        )
        return EXIT_INVALID
    sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
    print(f"iop edge reload: {document.get('message', '')}", file=sys.stderr)
    for problem in document.get("problems") or ():
        print(f"  {problem.get('path') or '(document)'}: {problem.get('message')}", file=sys.stderr)
    outcome = document["outcome"]
    if outcome in ("invalid", "rolled_back"):
        return EXIT_INVALID
    if outcome == "restart_required":
        return EXIT_RESTART_REQUIRED
    return EXIT_APPLIED
