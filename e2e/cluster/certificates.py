"""The cluster's certificates (a CA, serving and client certificates, the ServiceAccount keys),
made with the `openssl` command, and the kubeconfig text of each client. Standard library only.
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

from .clusternet import Network
from .layout import KUBELET_NODE, PROGRAM, ClusterError


def openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"openssl {args[0]} failed:\n{result.stderr.strip()}")


EXTENSIONS = """\
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, IP:{host_ip}, IP:{service_ip}, DNS:localhost, DNS:kubernetes, \
DNS:kubernetes.default, DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local
authorityKeyIdentifier = keyid
[kubelet]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:{host_ip}, DNS:{kubelet_node}
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
"""


# Client identities: file stem -> subject. The API server's bootstrap RBAC already binds the
# controller-manager and scheduler users; `admin` and `kwok` are cluster admins.
CLIENTS = {
    "admin": "/O=system:masters/CN=iop-admin",
    "controller-manager": "/CN=system:kube-controller-manager",
    "scheduler": "/CN=system:kube-scheduler",
    "kwok": "/O=system:masters/CN=kwok",
    # The kubelet is a cluster admin (not limited by the Node authorizer; see kubelet/).
    "kubelet": f"/O=system:masters/CN=system:node:{KUBELET_NODE}",
    # The API server's client certificate towards kubelets (kubectl logs).
    "apiserver-kubelet-client": "/O=system:masters/CN=kube-apiserver-kubelet-client",
    # Bootstrap RBAC binds system:node-proxier to this user.
    "kube-proxy": "/CN=system:kube-proxy",
    "coredns": "/O=system:masters/CN=coredns",
}


def make_pki(pki: Path, net: Network) -> None:
    """A throwaway CA, serving certificates (API server, kubelet), client certificates, the SA
    key pair."""
    pki.mkdir(mode=0o700, parents=True, exist_ok=True)
    (pki / "extensions.cnf").write_text(
        EXTENSIONS.format(
            host_ip=net.host_ip,
            service_ip=net.kubernetes_service_ip,
            kubelet_node=KUBELET_NODE,
        )
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    days = ["-days", "3650"]
    openssl(
        "req", "-x509", *ec, *days, "-subj", "/CN=iop-cluster-ca", "-keyout", "ca.key",
        "-out", "ca.crt", "-config", "extensions.cnf", "-extensions", "ca", cwd=pki,
    )  # fmt: skip

    def leaf(stem: str, subject: str, extensions: str) -> None:
        openssl("req", "-new", *ec, "-subj", subject, "-keyout", f"{stem}.key",
                "-out", f"{stem}.csr", cwd=pki)  # fmt: skip
        openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", *days, "-extfile", "extensions.cnf", "-extensions",
                extensions, "-out", f"{stem}.crt", cwd=pki)  # fmt: skip

    leaf("serving", "/CN=iop-cluster-apiserver", "server")
    leaf("kubelet-serving", f"/CN={KUBELET_NODE}", "kubelet")
    for stem, subject in CLIENTS.items():
        leaf(stem, subject, "client")
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-out", "sa.key", cwd=pki)  # fmt: skip
    openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def kubeconfig(server: str, pki: Path, user: str) -> str:
    def data(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    # JSON is YAML: no YAML library needed.
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": PROGRAM,
                "cluster": {"server": server, "certificate-authority-data": data("ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": data(f"{user}.crt"),
                    "client-key-data": data(f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": PROGRAM, "context": {"cluster": PROGRAM, "user": user}}],
        "current-context": PROGRAM,
    }
    return json.dumps(config, indent=2) + "\n"
