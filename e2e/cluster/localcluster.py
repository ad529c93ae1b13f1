"""A real, local Kubernetes cluster for the end-to-end tests, with pods that really run.

The command line (`python3 -m e2e.cluster.localcluster build | up | image | down | status |
pin` from the checkout's root; the executables `build`, `up`, `down`, `status` beside this file
call it from any folder). The control plane is built from pinned Go modules and run as plain
processes, with a process kubelet (`kubelet/`) whose pods run the project's image
(`imagebuild.py`) on the cluster's network (`clusternet.py`); the other parts are modules beside
this one (`layout.py`, `gobuilding.py`, `certificates.py`, `states.py`, `components.py`,
`supervising.py`, `hostpackages.py`). Standard library only (plus the `openssl` and `ip`
commands), so any python3 >= 3.11 runs it. e2e/cluster/README.md ("Files", "Commands", "What
`up` runs") says what each does and why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .gobuilding import build, pin_kubernetes
from .layout import PROGRAM, ClusterError, log
from .supervising import down, exports, load_image, status_report, up


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build the pinned binaries if needed")
    build_parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    up_parser = commands.add_parser("up", help="start the cluster; prints export lines")
    up_parser.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("IOP_CLUSTER_TIMEOUT", "90")),
        help="seconds to wait for every component to be healthy (default 90)",
    )
    commands.add_parser(
        "image", help="build the project's image if its inputs changed; load it if running"
    )
    commands.add_parser("down", help="stop what `up` started and remove its state")
    status_parser = commands.add_parser("status", help="say what runs")
    status_parser.add_argument("--json", action="store_true", help="machine-readable output")
    pin_parser = commands.add_parser("pin", help="re-pin k8s.io/kubernetes (rewrites go.mod)")
    pin_parser.add_argument("kubernetes_version", help="for example v1.37.2")
    args = parser.parse_args(argv)

    try:
        if args.command == "build":
            build(force=args.force)
        elif args.command == "up":
            state = up(args.timeout)
            sys.stdout.write(exports(state))
        elif args.command == "image":
            load_image()
        elif args.command == "down":
            stopped = down()
            log(f"stopped {', '.join(stopped)}" if stopped else "nothing was running")
        elif args.command == "status":
            code, report = status_report()
            if args.json:
                print(json.dumps(report, indent=2))
            else:
                print(f"cluster: {report['status']} (state {report['state_dir']})")
                for name, entry in report["components"].items():
                    health = "healthy" if entry["healthy"] else "NOT healthy"
                    where = f"pid {entry['pid']}" if entry["running"] else "not running"
                    print(f"  {name:<24} {where:<12} {health}")
                net = report.get("network")
                if net:
                    pods = len(net["namespaces"]) - 1
                    print(f"  network: pods {net['pod_cidr']}, services {net['service_cidr']}, "
                          f"DNS {net['cluster_dns']}, host link {net['host_link']}, "
                          f"node netns {net['node_netns']} (+{pods} pod namespaces)")  # fmt: skip
                if report["status"] != "stopped":
                    print(f"export KUBECONFIG={report['kubeconfig']}")
                built = "built" if report["built"] else "not built yet"
                print(f"binaries: {report['bin_dir']} ({built})")
            return code
        elif args.command == "pin":
            pin_kubernetes(args.kubernetes_version)
    except ClusterError as error:
        log(f"error: {error}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except BrokenPipeError:  # `status | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
