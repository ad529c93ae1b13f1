"""`python -P -m e2e.cluster.kubelet` (the checkout on PYTHONPATH): started by `e2e/cluster/up`.

The images it runs are those of its image list (--images, written by e2e/cluster/imagebuild.py's
`load`); their root file systems are unpacked under --image-cache (see e2e/cluster/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
from pathlib import Path

from .apiclient import Credentials
from .contexts import Config
from .images import NodeImages
from .kubelet import serve


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
    add("--images", required=True, help="the node's image list (JSON, see images.py)")
    add("--image-cache", required=True, help="folder of the images' unpacked root file systems")
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
        images=NodeImages(Path(args.images), Path(args.image_cache)),
    )


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(parse()))


if __name__ == "__main__":
    main()
