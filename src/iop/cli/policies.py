"""`--upstream-policy`: what the providers a process runs may reach and which keys they may read,
given by whoever runs the process (the chart renders it into `IOP_UPSTREAM_POLICY`).

The Node and the Edge (for its placed nodes) enforce it; the operator's webhook refuses a config
that breaks it. `iop.edgeconfig.upstreampolicy` holds the model; docs/operator.md, "Who may do
what", the account.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:  # the config model (pydantic) is imported only by the commands that use it
    from iop.edgeconfig import UpstreamPolicy

logger = logging.getLogger(__name__)

#: The environment variable that holds a process's policy (JSON or YAML) when no option does.
POLICY_ENV: Final = "IOP_UPSTREAM_POLICY"


def add_policy_option(parser: argparse.ArgumentParser, enforced_by: str) -> None:
    parser.add_argument(
        "--upstream-policy",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"the upstream policy (JSON or YAML: allow, deny, keys) {enforced_by}; default: "
        f"the text of ${POLICY_ENV}, else none (any address, any key variable)",
    )


def read_policy(args: argparse.Namespace) -> tuple[str, UpstreamPolicy | None]:
    """(where it came from, the policy) of `--upstream-policy` or `$IOP_UPSTREAM_POLICY`; None
    when neither is given. A `ConfigError` names the file or the variable and each problem."""
    from iop.edgeconfig import ConfigError, Problem, parse_policy

    path: Path | None = args.upstream_policy
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            problem = Problem("", f"cannot read it: {exc.strerror or exc}")
            raise ConfigError([problem]) from None
        return str(path), parse_policy(text, str(path))
    text = os.environ.get(POLICY_ENV, "")
    if not text.strip():
        return "", None
    return f"${POLICY_ENV}", parse_policy(text, POLICY_ENV)


def policy_for_run(args: argparse.Namespace, command: str) -> UpstreamPolicy | None:
    """The policy a long-running `command` (`iop node run`) enforces, logged once as it starts;
    a bad one is shown with its problems and ends the command (`PolicyRefused`)."""
    from iop.edgeconfig import ConfigError

    from .problems import print_problems

    try:
        source, policy = read_policy(args)
    except ConfigError as error:
        print_problems(f"{command}: --upstream-policy or ${POLICY_ENV}", error)
        raise PolicyRefused from None
    logger.info("%s: %s%s", command, described(policy), f" (from {source})" if source else "")
    return policy


class PolicyRefused(Exception):
    """The policy given to a command does not load (its problems were shown)."""


def described(policy: UpstreamPolicy | None) -> str:
    """The policy in a log line: its entries, never a key (bindings name variables only)."""
    if policy is None:
        return "no upstream policy: providers may reach any address and read any key variable"
    keys = ", ".join(f"{b.env} -> {' '.join(b.hosts)}" for b in policy.keys) or "none"
    allow = " ".join(policy.allow) or "nothing"
    deny = " ".join(policy.deny) or "built-in ranges only"
    return f"upstream policy: allow {allow}; deny {deny}; keys {keys}"
