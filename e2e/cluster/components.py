"""The components of the cluster: the files they read and the command line each runs with.

`write_configs` writes what the components read from the state directory (the Corefile, the
audit policy, a kubeconfig per client); `command_lines` says how each component is started
(etcd, the API server, the controller manager, the scheduler, kwok, CoreDNS, kube-proxy in the
node namespace, the process kubelet with its node's image list); `spawn` starts one, in a
session of its own, and records what `down` needs to recognise it. Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from . import clusternet, imagebuild
from .certificates import kubeconfig
from .gobuilding import Build
from .layout import (
    CHECKOUT,
    CLUSTER_DOMAIN,
    KUBELET_NODE,
    KWOK_NODE_ANNOTATION,
    KWOK_POD_CIDR,
    LOOPBACK,
    PROGRAM,
    ClusterError,
    python_command,
)
from .states import Started, State, process_start_time, tail

# The API server's audit policy: the calls of workloads' ServiceAccounts, as metadata (verb,
# resource, name, the answer's code), once each, when answered; nothing of the control plane's
# own controllers (kube-system) or of people.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    userGroups: ["system:serviceaccounts:kube-system"]
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""


def corefile(state: State) -> str:
    """CoreDNS: cluster names from the API server, on the host's end of the node link."""
    net = state.net
    return f"""\
.:53 {{
    bind {net.host_ip}
    errors
    health {net.host_ip}:{state.ports["coredns-health"]}
    ready {net.host_ip}:{state.ports["coredns-ready"]}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {state.root / "coredns.kubeconfig"} {PROGRAM}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    loadbalance
}}
"""


def kubelet_python() -> Path:
    """The Python the kubelet runs on (it needs aiohttp): the checkout's `.venv`, or
    IOP_KUBELET_VENV. Its pods run from the project's image, not from this virtualenv."""
    venv = Path(os.environ.get("IOP_KUBELET_VENV") or CHECKOUT / ".venv")
    python = venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        raise ClusterError(f"{venv} has no bin/python: run scripts/bootstrap first")
    return python


#: The clients that get a kubeconfig of their own in the state directory.
KUBECONFIG_USERS = ("controller-manager", "scheduler", "kwok", "coredns", "kube-proxy")


def kubeconfig_path(state: State, user: str) -> Path:
    return state.root / f"{user}.kubeconfig"


def write_configs(state: State) -> None:
    """Write what the components read from the state directory: the Corefile, the API
    server's audit policy and a kubeconfig per client (its certificate from `state.pki`)."""
    (state.root / "Corefile").write_text(corefile(state))
    (state.root / "audit-policy.yaml").write_text(AUDIT_POLICY)
    for user in KUBECONFIG_USERS:
        path = kubeconfig_path(state, user)
        path.write_text(kubeconfig(state.apiserver, state.pki, user))
        path.chmod(0o600)


def command_lines(state: State, build_: Build) -> dict[str, list[str]]:
    """How each component starts, in `COMPONENTS` order; the files they name are
    `write_configs`'s (and the certificates')."""
    ports, pki, root, net = state.ports, state.pki, state.root, state.net
    apiserver = state.apiserver
    etcd_client = f"http://{LOOPBACK}:{ports['etcd']}"
    etcd_peer = f"http://{LOOPBACK}:{ports['etcd-peer']}"
    serving = [
        f"--tls-cert-file={pki / 'serving.crt'}",
        f"--tls-private-key-file={pki / 'serving.key'}",
    ]

    def component_kubeconfig(user: str) -> list[str]:
        path = kubeconfig_path(state, user)
        return [
            f"--kubeconfig={path}",
            f"--authentication-kubeconfig={path}",
            f"--authorization-kubeconfig={path}",
        ]

    kube_proxy_config = kubeconfig_path(state, "kube-proxy")
    kwok_kubeconfig = kubeconfig_path(state, "kwok")

    return {
        "etcd": [
            str(build_.binary("etcd")),
            "--name=iop",
            f"--data-dir={root / 'etcd'}",
            f"--listen-client-urls={etcd_client}",
            f"--advertise-client-urls={etcd_client}",
            f"--listen-peer-urls={etcd_peer}",
            f"--initial-advertise-peer-urls={etcd_peer}",
            f"--initial-cluster=iop={etcd_peer}",
            # A throwaway test store: durability buys nothing, fsync costs seconds.
            "--unsafe-no-fsync",
            "--auto-compaction-retention=1",
            "--log-level=warn",
        ],
        "kube-apiserver": [
            str(build_.binary("kube-apiserver")),
            f"--etcd-servers={etcd_client}",
            # The host's end of the node link: reachable from the host and from every pod.
            f"--bind-address={net.host_ip}",
            f"--advertise-address={net.host_ip}",
            f"--secure-port={ports['apiserver']}",
            *serving,
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={net.service_cidr}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            # Webhooks and APIServices backed by a Service are called at its endpoints (pod
            # IPs), not its ClusterIP: they work even where kube-proxy does not.
            "--enable-aggregator-routing=true",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            "--profiling=false",
            f"--cert-dir={root / 'apiserver-certs'}",
            # What workloads' ServiceAccounts call (the tests compare a Role with it).
            f"--audit-policy-file={root / 'audit-policy.yaml'}",
            f"--audit-log-path={state.audit_log}",
            "--audit-log-format=json",
            "--audit-log-maxsize=200",
        ],
        "kube-controller-manager": [
            str(build_.binary("kube-controller-manager")),
            *component_kubeconfig("controller-manager"),
            f"--bind-address={LOOPBACK}",
            f"--secure-port={ports['controller-manager']}",
            *serving,
            f"--cert-dir={root / 'controller-manager-certs'}",
            "--leader-elect=false",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={net.service_cidr}",
            "--profiling=false",
        ],
        "kube-scheduler": [
            str(build_.binary("kube-scheduler")),
            *component_kubeconfig("scheduler"),
            f"--bind-address={LOOPBACK}",
            f"--secure-port={ports['scheduler']}",
            *serving,
            f"--cert-dir={root / 'scheduler-certs'}",
            "--leader-elect=false",
            "--profiling=false",
        ],
        # No --server-address/--node-port: kwok then opens no listener at all.
        "kwok": [
            str(build_.binary("kwok")),
            f"--kubeconfig={kwok_kubeconfig}",
            f"--config={build_.kwok_stages}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--node-ip={LOOPBACK}",
            f"--cidr={KWOK_POD_CIDR}",
            "--node-lease-duration-seconds=40",
        ],
        "coredns": [str(build_.binary("coredns")), "-conf", str(root / "Corefile")],
        # In the node namespace: its nftables table and conntrack entries stay there, and
        # every packet to a ClusterIP passes through it (from pods via the bridge, from the
        # host via the routes clusternet.py adds).
        "kube-proxy": [
            "nsenter",
            f"--net={clusternet.NETNS_DIR / net.node_netns}",
            "--",
            str(build_.binary("kube-proxy")),
            f"--kubeconfig={kube_proxy_config}",
            "--proxy-mode=nftables",
            f"--hostname-override={KUBELET_NODE}",
            f"--cluster-cidr={net.pod_cidr}",
            # Replies from a pod on the same bridge must come back through the translation.
            "--masquerade-all=true",
            # conntrack's table size is machine-wide: leave it alone.
            "--conntrack-max-per-core=0",
            f"--healthz-bind-address={net.node_ip}:{ports['kube-proxy-health']}",
            f"--metrics-bind-address={net.node_ip}:{ports['kube-proxy-metrics']}",
            "--nodeport-addresses=primary",
        ],
        "kubelet": [
            *python_command("e2e.cluster.kubelet", python=str(kubelet_python())),
            f"--node-name={KUBELET_NODE}",
            f"--node-ip={net.host_ip}",
            f"--pod-cidr={net.pod_cidr}",
            f"--node-netns={net.node_netns}",
            f"--netns-prefix={net.netns_prefix}",
            f"--cluster-dns={net.host_ip}",
            f"--cluster-domain={CLUSTER_DOMAIN}",
            f"--server={apiserver}",
            # What pods get as KUBERNETES_SERVICE_HOST/PORT: the `kubernetes` Service's
            # ClusterIP, which kube-proxy translates to the API server.
            f"--api-host={net.kubernetes_service_ip}",
            "--api-port=443",
            f"--ca={pki / 'ca.crt'}",
            f"--cert={pki / 'kubelet.crt'}",
            f"--key={pki / 'kubelet.key'}",
            f"--serving-cert={pki / 'kubelet-serving.crt'}",
            f"--serving-key={pki / 'kubelet-serving.key'}",
            f"--serving-port={ports['kubelet']}",
            f"--state={root / 'kubelet'}",
            f"--images={imagebuild.images_file(root)}",
            f"--image-cache={imagebuild.rootfs_dir()}",
        ],
    }


def child_env(state: State) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("KUBE")}
    # Nothing here goes through a proxy: every address is on this machine.
    net = state.net
    local = [LOOPBACK, "localhost", net.host_ip, str(net.pod_cidr), str(net.service_cidr)]
    no_proxy = ",".join(filter(None, [*local, os.environ.get("NO_PROXY", "")]))
    env["NO_PROXY"] = env["no_proxy"] = no_proxy
    env["KWOK_WORKDIR"] = str(state.root / "kwok")
    # Where the kubelet's `python -P -m e2e.cluster.kubelet` finds its package.
    env["PYTHONPATH"] = str(CHECKOUT)
    return env


def spawn(name: str, argv: list[str], state: State, env: Mapping[str, str]) -> Started:
    log_file = state.log_file(name)
    with log_file.open("ab") as output:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=state.root,
            env=dict(env),
            # Its own session: a Ctrl-C in the shell or test run that started it must not reach
            # it; only `down` stops it.
            start_new_session=True,
        )
    # Popen returns once exec succeeded, so /proc now shows the component, not this Python
    # (or, for a component started through `nsenter ... --`, nsenter until it execs in turn).
    start_time = process_start_time(process.pid)
    expected = argv[argv.index("--") + 1] if argv[0] == "nsenter" else None
    deadline = time.monotonic() + 5
    while True:
        try:
            exe = os.readlink(f"/proc/{process.pid}/exe")
        except OSError:
            start_time = None
            break
        if expected is None or exe == expected or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    # Forget the Popen object without a ResourceWarning: the process outlives this launcher.
    process.returncode = 0
    if start_time is None:
        raise ClusterError(f"{name} exited at once:\n{tail(log_file)}")
    return Started(pid=process.pid, start_time=start_time, exe=exe)
