"""`iop config check | diff | schema | history`: the config model at the command line, and the
revisions of the configs applied (`history_commands`)."""

from __future__ import annotations

import argparse
import json
import sys

from iop.edgeconfig import (
    ChangeReport,
    ConfigError,
    EdgeConfig,
    classify,
    config_hash,
    is_loopback_listener,
    load_file,
)

from . import history_commands
from .policies import add_policy_option, read_policy
from .problems import print_problems

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_RESTART_REQUIRED = 2


def register(parser: argparse.ArgumentParser) -> None:
    """Add the `iop config` subcommands to its parser."""
    sub = parser.add_subparsers(dest="config_command", required=True, metavar="COMMAND")

    check = sub.add_parser("check", help="validate a config and explain what it sets up")
    check.add_argument("file", help="path of an edge.yaml")
    add_policy_option(check, "its providers must keep to, as a Node or the operator would judge")
    _add_format(check)
    check.set_defaults(run=_check)

    diff = sub.add_parser(
        "diff",
        help="classify the changes from OLD to NEW (exit 0 live or none, 2 restart, 1 invalid)",
    )
    diff.add_argument("old")
    diff.add_argument("new")
    _add_format(diff)
    diff.set_defaults(run=_diff)

    schema = sub.add_parser("schema", help="print the JSON schema of the config")
    schema.add_argument(
        "--camel", action="store_true", help="camelCase keys, as in the EdgeConfig CRD"
    )
    schema.set_defaults(run=_schema)

    history_commands.register(sub)


def _add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("text", "json"), default="text")


def _emit_json(document: object) -> None:
    json.dump(document, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")


def _report_invalid(args: argparse.Namespace, label: str, error: ConfigError) -> int:
    if args.format == "json":
        _emit_json(
            {"valid": False, "file": label, "problems": [p.as_dict() for p in error.problems]}
        )
    else:
        print_problems(label, error)
    return EXIT_INVALID


def _check(args: argparse.Namespace) -> int:
    try:
        _, policy = read_policy(args)
    except ConfigError as error:
        return _report_invalid(args, "--upstream-policy", error)
    try:
        config = load_file(args.file)
        if policy is not None:
            policy.require_allowed(config, camel=False)
    except ConfigError as error:
        return _report_invalid(args, args.file, error)
    if args.format == "json":
        _emit_json({"valid": True, "file": args.file, "hash": config_hash(config), "problems": []})
    else:
        print(f"{args.file}: valid (config hash {config_hash(config)[:12]})")
        print(explain(config))
    return EXIT_OK


def _diff(args: argparse.Namespace) -> int:
    configs: list[EdgeConfig] = []
    for label in (args.old, args.new):
        try:
            configs.append(load_file(label))
        except ConfigError as error:
            return _report_invalid(args, label, error)
    report = classify(configs[0], configs[1])
    if args.format == "json":
        _emit_json(report.as_dict())
    else:
        print(describe_report(report))
    return EXIT_RESTART_REQUIRED if report.restart_required else EXIT_OK


def _schema(args: argparse.Namespace) -> int:
    _emit_json(EdgeConfig.model_json_schema(by_alias=args.camel))
    return EXIT_OK


def describe_report(report: ChangeReport) -> str:
    """The classification report for people."""
    if not report.changed:
        return "No changes."
    lines: list[str] = []
    if report.live_paths:
        lines.append("Live (applies without a restart):")
        lines += [f"  {path}" for path in report.live_paths]
    if report.restart_required_paths:
        lines.append("Restart required:")
        width = max(len(p.path) for p in report.restart_required_paths)
        lines += [f"  {p.path:<{width}}  scope {p.scope}" for p in report.restart_required_paths]
    for title, items in (
        ("Changed nodes", report.changed_nodes),
        ("Changed providers", report.changed_providers),
        ("Changed models", report.changed_models),
        ("Nodes to push", report.nodes_to_push),
    ):
        lines.append(f"{title}: {', '.join(items) if items else '-'}")
    verdict = (
        f"Verdict: restart required ({', '.join(report.restart_scopes)})"
        if report.restart_required
        else "Verdict: applies live"
    )
    lines.append(verdict)
    return "\n".join(lines)


def explain(config: EdgeConfig) -> str:
    """What a valid config sets up, in a few lines a newcomer can read."""
    edge, openai = config.edge, config.openai
    admin_scope = "loopback" if is_loopback_listener(edge.admin.listen) else "token required"
    principals = {t.principal_ref for t in openai.principal_tokens}
    link = "plaintext"
    if edge.tls is not None:
        link = "mutual TLS" if edge.tls.client_ca_file else "TLS"
    metrics = edge.metrics.listen or "off"
    lines = [
        f"Edge {edge.id}: OpenAI API on {openai.listen}, Nodes dial {edge.listen} ({link}), "
        f"admin API on {edge.admin.listen} ({admin_scope}), metrics on {metrics}",
        f"Clients: {len(openai.principal_tokens)} token(s) for {len(principals)} principal(s); "
        f"requests without a token are {'accepted' if openai.allow_unauthenticated else 'refused'}"
        f"; long-context threshold {openai.long_context_threshold_tokens} tokens",
    ]
    providers = {p.id: (node, p) for node in config.nodes for p in node.providers}
    lines.append(f"Models ({len(config.models)}), candidates in dispatch order:")
    for model in config.models:
        mapped = sorted(
            ((providers[pid][1], served) for pid, served in model.providers.items()),
            key=lambda pair: (pair[0].priority, pair[0].id),
        )
        chain = ", ".join(
            f"{p.id}={served} (prio {p.priority}, cap {p.capacity}"
            f"{'' if p.long_context_slots is None else f', long {p.long_context_slots}'}"
            f"{'' if p.enabled else ', disabled'})"
            for p, served in mapped
        )
        then = f"; then {', '.join(model.fallbacks)}" if model.fallbacks else ""
        lines.append(f"  {model.id}: {chain}{then}")
    lines.append(f"Nodes ({len(config.nodes)}):")
    for node in config.nodes:
        alias = f" ({node.alias})" if node.alias else ""
        kinds = ", ".join(f"{p.id}[{p.adapter.type}]" for p in node.providers) or "no providers"
        lines.append(f"  {node.id}{alias}: {kinds}")
    return "\n".join(lines)
