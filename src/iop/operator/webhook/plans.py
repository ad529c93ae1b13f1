"""The plan of a change in a few short lines: what the admission webhook warns at apply time.

`kubectl apply` (and `--dry-run=server`) print each warning on its own line, so the user sees
before anything happens which paths apply live and what restarts:

    Warning: restart edge: openai.listen
    Warning: restart node node-2: nodes[node-2].providers[ollama-c].adapter.base_url
    Warning: live: nodes[node-1].providers[vllm-a].capacity
    Warning: rollout: canary 5% -> 25% -> 100% for m: about 30s (at most 60s), rolled back ...

The API server truncates long warnings and drops them beyond 4 KiB in all, so each line is
kept short and the list bounded; the last line says how many were left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from iop.edgeconfig import (
    ChangeReport,
    ConfigError,
    EdgeConfig,
    camel_path,
    is_loopback_listener,
    plan_trial,
)

#: Longest warning line: the API server may truncate warnings beyond 256 characters, and
#: terminals wrap far sooner.
MAX_LINE: Final = 120
#: All warning text together (the API server keeps 4 KiB of warnings per response).
MAX_TOTAL: Final = 3500
#: Most problems an admission refusal lists (the status message keeps them all).
MAX_PROBLEMS: Final = 50


def _line(text: str) -> str:
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 1] + "…"


def plan_warnings(
    change: ChangeReport | None,
    desired: EdgeConfig,
    desired_hash: str,
    waiting: Sequence[str] = (),
    base: EdgeConfig | None = None,
    invalid: Sequence[str] = (),
) -> list[str]:
    """The plan as warning lines, paths in the CRD's camelCase (what the user edits); `change`
    is None when nothing was applied before; `waiting` names token Secrets still missing and
    `invalid` those that hold no usable token; `base`, the config applied, is what the change's
    trial is planned against."""
    lines: list[str] = []
    if change is None:
        lines.append(f"plan: first apply of config {desired_hash[:12]}")
    elif not change.changed:
        lines.append("plan: nothing in effect changes")
    else:
        ordered = sorted(
            change.restart_required_paths, key=lambda p: (p.scope != "edge", p.scope, p.path)
        )
        for path in ordered:  # the Edge's restart first: it is the one clients notice
            where = "edge" if path.scope == "edge" else f"node {path.scope.removeprefix('node:')}"
            lines.append(_line(f"restart {where}: {camel_path(path.path)}"))
        lines += [_line(f"live: {camel_path(path)}") for path in change.live_paths]
        if base is not None:
            lines += _trial_lines(change, base, desired)
    lines[:0] = [_line(f"waiting: {what}; the change applies once it exists") for what in waiting]
    lines[:0] = [f"waiting: {what}; the change applies once it is put right" for what in invalid]
    if is_loopback_listener(desired.edge.admin.listen):
        lines.insert(
            0,
            _line(
                f"edge.admin.listen {desired.edge.admin.listen} is loopback: the operator "
                "cannot reach the Edge replicas to apply changes"
            ),
        )
    return _bounded(lines)


def _trial_lines(change: ChangeReport, base: EdgeConfig, desired: EdgeConfig) -> list[str]:
    """How the Edges put the change on trial (docs/rollout.md), and about how long it takes."""
    trial = plan_trial(base, desired)
    if not trial.touched:
        return []
    if change.restart_required_paths:
        return [
            _line("rollout: restart-required: the restart rolls it out, not judged by the Edges")
        ]
    if desired.rollout.mode == "off":
        return [_line("rollout: off: applied and kept, not judged")]
    usual, longest = trial.duration_s(desired)
    plan = trial.describe(desired.rollout.steps)
    return [
        _line(f"rollout: {plan}"),
        _line(
            f"rollout: about {usual:g}s with {desired.rollout.min_requests} requests judged "
            f"(at most {longest:g}s); the Edges roll it back if it fails a check"
        ),
    ]


def _bounded(lines: list[str]) -> list[str]:
    kept: list[str] = []
    total = 0
    for index, line in enumerate(lines):
        rest = len(lines) - index
        if total + len(line) > MAX_TOTAL - 80:
            kept.append(f"... and {rest} more (the full list: status.lastChange once applied)")
            break
        kept.append(line)
        total += len(line)
    return kept


def unowned_warnings(name: str, owned: str, namespace: str) -> list[str]:
    """What the webhook tells whoever writes an EdgeConfig its operator does not reconcile."""
    return [
        f"this namespace's operator (of EdgeConfig {owned!r}) reconciles only EdgeConfig "
        f"{owned!r} in {namespace}; {name!r} is neither validated nor applied by it",
        f"{name!r} takes effect only if another release's operator serves that name "
        "(docs/operator.md, 'One operator per EdgeConfig')",
    ]


def admission_message(error: ConfigError) -> str:
    """Why the webhook refuses a spec: every problem with its path (bounded)."""
    problems = error.problems
    count = len(problems)
    lines = [f"{count} problem{'s' if count != 1 else ''} in the EdgeConfig spec:"]
    lines += [f"  {problem}" for problem in problems[:MAX_PROBLEMS]]
    if count > MAX_PROBLEMS:
        lines.append(f"  ... and {count - MAX_PROBLEMS} more")
    return "\n".join(lines)
