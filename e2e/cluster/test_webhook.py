"""An admission webhook served by a pod, called by the API server through its Service.

The operator's validating webhook will run this way: the API server resolves the Service to its
endpoints (`--enable-aggregator-routing=true`) and calls the pod's IP over TLS.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from e2e.cluster.imagebuild import project_reference
from tests.waiting import wait_for

if TYPE_CHECKING:
    from e2e.conftest import KubeCluster

pytestmark = pytest.mark.e2e

IMAGE = project_reference()  # what the cluster's node has: the Dockerfile's build
MESSAGE = "denied by the e2e webhook"

SERVER = """
import http.server, json, ssl
class Review(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request = review["request"]
        labels = (request["object"].get("metadata") or {}).get("labels") or {}
        response = {"uid": request["uid"], "allowed": labels.get("deny") != "yes"}
        if not response["allowed"]:
            response["status"] = {"code": 403, "message": "MESSAGE"}
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "response": response}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
server = http.server.ThreadingHTTPServer(("0.0.0.0", 8443), Review)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("/tls/tls.crt", "/tls/tls.key")
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
""".replace("MESSAGE", MESSAGE)


def certificate(folder: Path, dns_name: str) -> tuple[Path, Path]:
    key, crt = folder / "tls.key", folder / "tls.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(crt), "-days", "1", "-subj", "/CN=webhook",
         "-addext", f"subjectAltName=DNS:{dns_name}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return crt, key


def webhook_server() -> dict[str, Any]:
    labels = {"app": "webhook"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "webhook"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "webhook",
                            "image": IMAGE,
                            "command": ["python", "-c", SERVER],
                            "readinessProbe": {"tcpSocket": {"port": 8443}, "periodSeconds": 1},
                            "volumeMounts": [{"name": "tls", "mountPath": "/tls"}],
                        }
                    ],
                    "volumes": [{"name": "tls", "secret": {"secretName": "webhook-tls"}}],
                },
            },
        },
    }


def test_a_validating_webhook_served_by_a_pod_is_called(
    kube_cluster: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    crt, key = certificate(tmp_path, f"webhook.{namespace}.svc")
    kube_cluster.kubectl(
        "create", "secret", "tls", "webhook-tls", "-n", namespace, f"--cert={crt}", f"--key={key}"
    )
    kube_cluster.apply(webhook_server(), "-n", namespace)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "webhook"},
        "spec": {"selector": {"app": "webhook"}, "ports": [{"port": 443, "targetPort": 8443}]},
    }
    kube_cluster.apply(service, "-n", namespace)
    kube_cluster.kubectl(
        "rollout", "status", "deployment/webhook", "-n", namespace, "--timeout=60s", timeout=70
    )
    name = f"{namespace}.e2e.iop-edge.test"
    configuration = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": name,
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 5,
                "clientConfig": {
                    "service": {"namespace": namespace, "name": "webhook", "path": "/validate"},
                    "caBundle": base64.b64encode(crt.read_bytes()).decode(),
                },
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["configmaps"],
                    }
                ],
            }
        ],
    }
    kube_cluster.apply(configuration)
    try:

        def create(labels: str) -> subprocess.CompletedProcess[str]:
            manifest = (
                '{"apiVersion":"v1","kind":"ConfigMap",'
                f'"metadata":{{"name":"probe","labels":{{{labels}}}}}}}'
            )
            return kube_cluster.kubectl(
                "create", "-n", namespace, "--dry-run=server", "-f", "-",
                stdin=manifest, check=False,
            )  # fmt: skip

        # The API server picks the configuration up within a moment; until then all pass.
        error = wait_for(
            lambda: (lambda r: r.stderr if r.returncode != 0 else None)(create('"deny":"yes"')),
            timeout=30,
            what="the webhook to refuse a labelled ConfigMap",
        )
        assert MESSAGE in error
        admitted = create('"deny":"no"')  # the same webhook admits the others
        assert admitted.returncode == 0, admitted.stderr
    finally:
        kube_cluster.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found")
