"""`iop edge history` and `iop edge rollout`: a running Edge's revisions, and its watched change
ended by hand, through its admin API (docs/rollout.md).

`iop edge history` prints one line per revision the Edge keeps, newest first (`--json`: the
admin API's document): its number, hash, when, how it ended and why, the models it touched and
its paths; `*` marks the stable revision, `?` the candidate being watched. `iop edge rollout
promote|roll-back` ends the watch of the candidate. Exit codes: 0 done, 1 any failure
(unreachable Edge, wrong token, no change being watched).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

EXIT_OK = 0
EXIT_FAILED = 1


#: Added to a 401 of the admin API: the option that sends the token.
TOKEN_HINT = " (pass the admin token with --token-file FILE)"


class AdminCallFailed(Exception):
    """The admin API could not be reached, refused, or answered something else than JSON."""


def admin_headers(token_file: Path | None) -> dict[str, str]:
    """The bearer header from `token_file` (none without one); `AdminCallFailed` if unreadable."""
    if token_file is None:
        return {}
    try:
        token = token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminCallFailed(str(exc)) from exc
    if not token:
        raise AdminCallFailed(f"{token_file} is empty")
    return {"authorization": f"Bearer {token}"}


def register(sub: Any) -> None:
    """Add `iop edge history` and `iop edge rollout` to the `iop edge` parser."""
    history = sub.add_parser(
        "history",
        help="list a running Edge's config revisions and how each ended",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    admin_arguments(history)
    history.add_argument("--json", action="store_true", help="print the admin API's document")
    history.set_defaults(run=_history)
    rollout = sub.add_parser(
        "rollout",
        help="promote or roll back the change a running Edge is watching",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rollout.add_argument("action", choices=("promote", "roll-back"))
    admin_arguments(rollout)
    rollout.set_defaults(run=_rollout)


def admin_arguments(parser: argparse.ArgumentParser, timeout: float = 30.0) -> None:
    """`--admin URL`, `--token-file F` and `--timeout S`: what every admin API command takes."""
    parser.add_argument(
        "--admin", required=True, metavar="URL", help="the admin API, e.g. http://127.0.0.1:9090"
    )
    parser.add_argument(
        "--token-file", type=Path, default=None, help="file holding the admin bearer token"
    )
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds to wait")


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    url = args.admin.rstrip("/") + path
    content = orjson.dumps(body) if body is not None else None
    try:
        response = httpx.request(
            method, url, content=content, headers=admin_headers(args.token_file),
            timeout=args.timeout,
        )  # fmt: skip
        document = response.json()
    except httpx.HTTPError as exc:
        raise AdminCallFailed(f"cannot reach {url}: {exc}") from exc
    except ValueError as exc:
        raise AdminCallFailed(f"{response.status_code} from {url}: not JSON") from exc
    if response.status_code != 200:
        error = document.get("error") if isinstance(document, dict) else None
        detail = error.get("message") if isinstance(error, dict) else str(document)[:200]
        hint = TOKEN_HINT if response.status_code == 401 else ""
        raise AdminCallFailed(f"{response.status_code} from {url}: {detail}{hint}")
    return document


def _history(args: argparse.Namespace) -> int:
    return run_history(args)


def run_history(args: argparse.Namespace, prog: str = "iop edge history") -> int:
    """Print the Edge's revisions (`args`: `admin`, `token_file`, `timeout`, `json`); also what
    `iop config history --admin` runs."""
    try:
        document = _call(args, "GET", "/revisions")
    except AdminCallFailed as failed:
        print(f"{prog}: {failed}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
        return EXIT_OK
    sys.stdout.write(history_table(document))
    return EXIT_OK


def history_table(document: dict[str, Any]) -> str:
    """`GET /revisions` as the lines `iop edge history` prints."""
    marks = {document.get("stable"): "*", document.get("candidate"): "?"}
    lines = ["  REV  HASH          APPLIED              OUTCOME      MODELS / PATHS / WHY"]
    for revision in document["revisions"]:
        applied = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(revision["applied_at"]))
        paths = [*revision["live_paths"], *(p["path"] for p in revision["restart_required_paths"])]
        restores = revision.get("restores")
        details = [
            f"models: {', '.join(revision['touched_models']) or '-'}",
            f"paths: {', '.join(paths[:6]) or '-'}"
            + (f" (+{len(paths) - 6})" if len(paths) > 6 else ""),
            *([f"again the config of revision {restores}"] if restores else []),
            *([revision["reason"]] if revision["reason"] else []),
        ]
        lines.append(
            f"{marks.get(revision['revision'], ' ')} {revision['revision']:>3}  "
            f"{revision['config_hash'][:12]}  {applied}  {revision['outcome']:<11}  "
            + "; ".join(details)
        )
    return "\n".join(lines) + "\n"


def _rollout(args: argparse.Namespace) -> int:
    action = args.action.replace("-", "_")
    try:
        revision = _call(args, "POST", "/rollout", {"action": action})
    except AdminCallFailed as failed:
        print(f"iop edge rollout: {failed}", file=sys.stderr)
        return EXIT_FAILED
    print(f"revision {revision['revision']}: {revision['outcome']} ({revision['reason']})")
    return EXIT_OK
