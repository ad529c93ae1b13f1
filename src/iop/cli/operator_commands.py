"""`iop operator run | crd`: the EdgeConfig operator, and the CRD it serves."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import uvloop

from iop.operator import OperatorError, OperatorOptions, crd_yaml, default_namespace, run_operator

from .policies import PolicyRefused, add_policy_option, policy_for_run


def register(parser: argparse.ArgumentParser) -> None:
    """Add the `iop operator` subcommands to its parser."""
    sub = parser.add_subparsers(dest="operator_command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="reconcile the EdgeConfigs of one namespace",
        description="Watch the EdgeConfigs of the namespace: validate each change, write the "
        "Edge ConfigMap, apply live changes on every Edge replica or roll only the workloads "
        "a restart needs, and report in status and Events; serve the validating webhook. "
        "docs/operator.md describes it all.",
    )
    run.add_argument(
        "--namespace",
        default=None,
        help="the namespace to serve (default: $POD_NAMESPACE, the ServiceAccount's, 'default')",
    )
    run.add_argument("--kubeconfig", default=None, help="a kubeconfig (default: in-cluster)")
    run.add_argument(
        "--edgeconfig",
        default=None,
        metavar="NAME",
        help="serve only the EdgeConfig NAME (what a Helm release's operator does: the API "
        "server sends it nothing of other releases); default: every EdgeConfig of the namespace",
    )
    run.add_argument(
        "--edge-admin",
        action="append",
        default=[],
        metavar="URL",
        help="the admin API of an Edge replica running outside the cluster (repeat for "
        "several); by default the replicas are the pods of the Edge workload",
    )
    run.add_argument(
        "--webhook-listen",
        default="0.0.0.0:9443",
        metavar="HOST:PORT",
        help="where the validating webhook listens (HTTPS)",
    )
    run.add_argument("--no-webhook", action="store_true", help="serve no webhook")
    run.add_argument(
        "--webhook-configuration",
        default=None,
        metavar="NAME",
        help="the ValidatingWebhookConfiguration to give this operator's CA bundle",
    )
    run.add_argument(
        "--webhook-service",
        default=None,
        metavar="NAME",
        help="the Service the API server calls the webhook through (named in the certificate)",
    )
    run.add_argument(
        "--webhook-url",
        default=None,
        metavar="URL",
        help="instead of the Service, the base URL the API server calls (operator outside "
        "the cluster); it is written into the webhook configuration",
    )
    run.add_argument(
        "--webhook-secret",
        default=None,
        metavar="NAME",
        help="keep the webhook certificate in this Secret (made by the first replica, shared "
        "by all, so one caBundle trusts every replica); default: a new certificate per start",
    )
    run.add_argument(
        "--webhook-san",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name or IP address for the webhook certificate",
    )
    run.add_argument(
        "--hub-tls-secret",
        default=None,
        metavar="NAME",
        help="make the Node link's TLS certificates (a CA, the Edge's and the Nodes') in this "
        "Secret at start, unless it holds ones that name the hub; default: none made",
    )
    run.add_argument(
        "--hub-tls-service",
        default=None,
        metavar="NAME",
        help="the hub's Service: its DNS names go into the Edge's certificate, and it owns the "
        "Secret",
    )
    run.add_argument(
        "--hub-tls-san",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name for the Edge's certificate (repeat for several)",
    )
    run.add_argument(
        "--liveness-listen",
        default="0.0.0.0:8080",
        metavar="HOST:PORT",
        help="where GET /healthz answers (kopf's liveness endpoint); 'off' for none",
    )
    run.add_argument(
        "--metrics-listen",
        default="0.0.0.0:8081",
        metavar="HOST:PORT",
        help="where GET /metrics (Prometheus) and GET /readyz answer; 'off' for none",
    )
    run.add_argument(
        "--leader-election",
        default=None,
        metavar="LEASE",
        help="elect one active replica with this coordination.k8s.io Lease (the others watch, "
        "serve the webhook and take over when it goes); default: act alone",
    )
    add_policy_option(run, "that every config's providers must keep to (or be refused)")
    run.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    run.set_defaults(run=_run)

    crd = sub.add_parser(
        "crd",
        help="print the EdgeConfig CustomResourceDefinition",
        description="The CRD generated from the config model: the file under deploy/crds/.",
    )
    crd.add_argument("--output", type=Path, default=None, help="write it to this file")
    crd.set_defaults(run=_crd)


def _crd(args: argparse.Namespace) -> int:
    text = crd_yaml()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # kopf logs every handler call at INFO, and pods change often: its object log is for DEBUG.
    if args.log_level != "DEBUG":
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # probes, every second
    try:
        policy = policy_for_run(args, "iop operator run")
    except PolicyRefused:
        return 2
    options = OperatorOptions(
        namespace=args.namespace or default_namespace(),
        kubeconfig=args.kubeconfig,
        edgeconfig=args.edgeconfig,
        edge_admin_urls=tuple(args.edge_admin),
        webhook_listen=None if args.no_webhook else args.webhook_listen,
        webhook_configuration=args.webhook_configuration,
        webhook_service=args.webhook_service,
        webhook_url=args.webhook_url,
        webhook_secret=args.webhook_secret,
        liveness_listen=None if args.liveness_listen == "off" else args.liveness_listen,
        metrics_listen=None if args.metrics_listen == "off" else args.metrics_listen,
        leader_election=args.leader_election,
        extra_sans=tuple(args.webhook_san),
        upstream_policy=policy,
        hub_tls_secret=args.hub_tls_secret,
        hub_tls_service=args.hub_tls_service,
        hub_tls_sans=tuple(args.hub_tls_san),
    )
    try:
        uvloop.run(_serve(options))
    except OperatorError as error:  # what it cannot work with, said once (a too old cluster)
        print(f"iop operator: {error}", file=sys.stderr)
        return 1
    return 0


async def _serve(options: OperatorOptions) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await run_operator(options, stop=stop)
