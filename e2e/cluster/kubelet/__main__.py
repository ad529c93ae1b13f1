"""`python -m kubelet` (with e2e/cluster on PYTHONPATH): started by `e2e/cluster/up`.

The project's image and the checkout that runs it are set by --image / IOP_KUBELET_IMAGE and
--venv / IOP_KUBELET_VENV (see e2e/cluster/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
from pathlib import Path

from .apiclient import Credentials
from .contexts import Config
from .envs import Image, repository
from .kubelet import serve

DEFAULT_IMAGE = "ghcr.io/iop-edge/iop-edge"
CHECKOUT = Path(__file__).resolve().parents[3]


def image(name: str, venv: Path) -> Image:
    """The image: `venv`'s `iop`, with the folders a container must see to run it."""
    python_home = (venv / "bin" / "python").resolve().parent.parent
    contents = tuple(sorted({str(venv), str(CHECKOUT), str(python_home)}))
    return Image(name=name, venv=str(venv), contents=contents)


def parse() -> Config:
    parser = argparse.ArgumentParser(prog="kubelet", description=__doc__)
    add = parser.add_argument
    add("--node-name", required=True)
    add("--node-ip", required=True, help="this host's address on the link to the node namespace")
    add("--pod-cidr", required=True)
    add("--node-netns", required=True, help="network namespace holding the pod bridge")
    add("--bridge", default="br0")
    add("--netns-prefix", required=True, help="pod namespaces are named PREFIX<uid[:8]>")
    add("--cluster-dns", required=True)
    add("--cluster-domain", default="cluster.local")
    add("--server", required=True, help="API server URL")
    add("--api-host", required=True, help="KUBERNETES_SERVICE_HOST given to pods")
    add("--api-port", type=int, required=True, help="KUBERNETES_SERVICE_PORT given to pods")
    add("--ca", required=True)
    add("--cert", required=True)
    add("--key", required=True)
    add("--serving-cert", required=True)
    add("--serving-key", required=True)
    add("--serving-port", type=int, default=10250)
    add("--state", required=True, help="folder for pods' volumes, files and logs")
    add("--image", default=os.environ.get("IOP_KUBELET_IMAGE", DEFAULT_IMAGE),
        help=f"the image this node runs, any tag (default {DEFAULT_IMAGE})")  # fmt: skip
    add("--venv", default=os.environ.get("IOP_KUBELET_VENV", str(CHECKOUT / ".venv")),
        help="virtualenv whose bin/ holds `iop` (default: the checkout's .venv)")  # fmt: skip
    args = parser.parse_args()
    return Config(
        node_name=args.node_name,
        node_ip=args.node_ip,
        pod_cidr=ipaddress.IPv4Network(args.pod_cidr),
        node_netns=args.node_netns,
        bridge=args.bridge,
        netns_prefix=args.netns_prefix,
        cluster_dns=args.cluster_dns,
        cluster_domain=args.cluster_domain,
        api_host=args.api_host,
        api_port=args.api_port,
        credentials=Credentials(args.server, args.ca, args.cert, args.key),
        serving_cert=args.serving_cert,
        serving_key=args.serving_key,
        serving_port=args.serving_port,
        state=Path(args.state),
        image=image(repository(args.image), Path(args.venv).absolute()),
    )


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = parse()
    venv_iop = Path(config.image.venv) / "bin" / "iop"
    if not os.access(venv_iop, os.X_OK):
        raise SystemExit(f"kubelet: {venv_iop} is missing: run scripts/bootstrap in the checkout")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
