"""The largest EdgeConfig each way in takes, in nodes of four providers (`iop.fakes.sized_spec`).

    eval "$(e2e/cluster/up)"   # or let this script find the running cluster
    uv run --frozen python -m bench.edgeconfig_sizes [--high 2000]

Against the real API server and etcd of `e2e/cluster`, by bisection on the number of nodes:

1. client-side `kubectl apply`: create, then change one capacity and apply again. Its limit is
   the `kubectl.kubernetes.io/last-applied-configuration` annotation (all annotations together
   at most 256 KiB), a full copy of the object.
2. `kubectl apply --server-side`: create, then the same change. Its limit is the object as etcd
   stores it (1.5 MiB per request by default), spec and `managedFields` together.
3. through the operator: server-side apply past its webhook, then the operator validates,
   classifies, writes the Edge ConfigMap (1 MiB of data at most) and its compressed record, and
   applies live on an Edge (a real `iop edge run` on this host, same config) until `Ready`; then
   one capacity change, whose warnings must state the plan, until `Ready` again.

Prints, for each path, the largest number of nodes that worked and the sizes that set the limit.
Figures go to docs/operator.md ("Sizes") and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.operator import CRD, cluster_env
from iop.fakes import sized_spec
from iop.processes import iop_command, spawn_edge, terminate

TOKEN = "bench-admin-token"


class Cluster:
    def __init__(self) -> None:
        found = cluster_env()
        self.kubeconfig = found["KUBECONFIG"]
        self.env = {**os.environ, **found}

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["kubectl", *args], input=stdin, capture_output=True, text=True, env=self.env,
            timeout=timeout,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args[:3])}: {result.stderr.strip()[:400]}")
        return result


def manifest(nodes: int, capacity: int = 8, **spec: Any) -> dict[str, Any]:
    document = sized_spec(nodes)
    document["nodes"][0]["providers"][0]["capacity"] = capacity
    document.update(spec)
    return {
        "apiVersion": "iop.dev/v1alpha1",
        "kind": "EdgeConfig",
        "metadata": {"name": "large"},
        "spec": document,
    }


def sizes(cluster: Cluster, namespace: str) -> dict[str, int]:
    raw = cluster.kubectl(
        "get", "ec", "large", "-n", namespace, "-o", "json", "--show-managed-fields"
    ).stdout
    obj = json.loads(raw)
    annotations = obj["metadata"].get("annotations") or {}
    return {
        "object": len(json.dumps(obj, separators=(",", ":"))),
        "spec": len(json.dumps(obj["spec"], separators=(",", ":"))),
        "annotations": sum(len(k) + len(v) for k, v in annotations.items()),
        "managedFields": len(
            json.dumps(obj["metadata"].get("managedFields"), separators=(",", ":"))
        ),
    }


def by_kubectl(cluster: Cluster, nodes: int, *flags: str) -> tuple[bool, str, dict[str, int]]:
    namespace = f"size-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        for capacity in (8, 9):
            result = cluster.kubectl(
                "apply", "-n", namespace, "-f", "-", *flags,
                stdin=json.dumps(manifest(nodes, capacity)), check=False,
            )  # fmt: skip
            if result.returncode != 0:
                return False, _why(result.stderr), {}
        return True, "", sizes(cluster, namespace)
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait(probe: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(0.25)
    return False


def ready(cluster: Cluster, namespace: str, generation: int) -> bool:
    obj = json.loads(cluster.kubectl("get", "ec", "large", "-n", namespace, "-o", "json").stdout)
    status = obj.get("status") or {}
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    got = conditions.get("Ready", {})
    return (
        status.get("observedGeneration") == generation
        and got.get("status") == "True"
        and got.get("observedGeneration") == generation
    )


async def by_operator(
    cluster: Cluster, nodes: int, folder: Path
) -> tuple[bool, str, dict[str, int]]:
    namespace = f"size-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", namespace)
    token_file = folder / "token"
    token_file.write_text(TOKEN)
    ports = {name: free_port() for name in ("hub", "openai", "admin", "webhook", "live")}
    edge_spec = {
        "id": "edge-large",
        "listen": f"127.0.0.1:{ports['hub']}",
        "admin": {"listen": f"127.0.0.1:{ports['admin']}", "tokenFile": str(token_file)},
    }
    openai = {"listen": f"127.0.0.1:{ports['openai']}", "longContextThresholdTokens": 32000}
    body = manifest(nodes, edge=edge_spec, openai=openai)
    config = folder / "edge.yaml"
    config.write_text(json.dumps(body["spec"]))
    webhook = f"size-{namespace}"
    edge, started = await spawn_edge(config, startup_timeout=120)
    operator: subprocess.Popen[bytes] | None = None
    log = folder / f"operator-{nodes}.log"
    try:
        cluster.kubectl(
            "create", "secret", "generic", "large-edge-admin", "-n", namespace,
            f"--from-literal=token={TOKEN}",
        )  # fmt: skip
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(_webhook(webhook, namespace, ports)))
        with log.open("wb") as out:
            operator = subprocess.Popen(
                [
                    *iop_command(), "operator", "run", "--namespace", namespace,
                    "--kubeconfig", cluster.kubeconfig, "--edge-admin", started["admin_url"],
                    "--webhook-listen", f"127.0.0.1:{ports['webhook']}",
                    "--webhook-configuration", webhook,
                    "--webhook-url", f"https://127.0.0.1:{ports['webhook']}",
                    "--liveness-listen", f"127.0.0.1:{ports['live']}",
                ],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

        def trusted() -> bool:  # the operator writes its caBundle at start
            found = cluster.kubectl("get", "validatingwebhookconfiguration", webhook, "-o", "json")
            return bool(json.loads(found.stdout)["webhooks"][0]["clientConfig"].get("caBundle"))

        if not await asyncio.to_thread(wait, trusted, 60):
            return False, "the operator never configured its webhook: " + _tail(log), {}

        def apply() -> subprocess.CompletedProcess[str]:
            """`kubectl apply --server-side` of the EdgeConfig as `body` stands."""
            stdin = json.dumps(body)
            return cluster.kubectl(
                "apply", "--server-side", "-n", namespace, "-f", "-", stdin=stdin, check=False
            )

        created = apply()
        if created.returncode != 0:
            return False, _why(created.stderr), {}
        if not await asyncio.to_thread(wait, lambda: ready(cluster, namespace, 1), 300):
            return False, "not Ready: " + _tail(log), {}
        body["spec"]["nodes"][0]["providers"][0]["capacity"] = 9
        changed = apply()
        if changed.returncode != 0:
            return False, "the change: " + _why(changed.stderr), {}
        if "Warning: live: nodes[node-0000].providers[n0000-vllm].capacity" not in changed.stderr:
            return False, f"no plan in the warnings: {changed.stderr[-300:]}", {}
        if not await asyncio.to_thread(wait, lambda: ready(cluster, namespace, 2), 300):
            return False, "not Ready after the change: " + _tail(log), {}
        found = sizes(cluster, namespace)
        cm = json.loads(
            cluster.kubectl("get", "cm", "large-edge", "-n", namespace, "-o", "json").stdout
        )
        record = json.loads(
            cluster.kubectl("get", "cm", "large-edge-applied", "-n", namespace, "-o", "json").stdout
        )
        found["configmap"] = len(cm["data"]["edge.yaml"])
        found["record"] = len(record["binaryData"]["config.json.gz"])
        return True, "", found
    finally:
        if operator is not None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(timeout=20)
            except subprocess.TimeoutExpired:
                operator.kill()
        await terminate(edge)
        cluster.kubectl("delete", "validatingwebhookconfiguration", webhook, check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _why(stderr: str) -> str:
    """The line of kubectl's error that names the limit."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for marker in ("Too long", "too large", "conflict", "denied"):
        for line in lines:
            if marker in line:
                return line[:300]
    return (lines[-1] if lines else "?")[:300]


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return " | ".join(lines[-3:])[:400]


def _webhook(name: str, namespace: str, ports: dict[str, int]) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "validate.edgeconfigs.iop.dev",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",  # here a refused or failed review must show
                "timeoutSeconds": 30,
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "rules": [
                    {
                        "apiGroups": ["iop.dev"],
                        "apiVersions": ["v1alpha1"],
                        "resources": ["edgeconfigs"],
                        "operations": ["CREATE", "UPDATE"],
                    }
                ],
                "clientConfig": {"url": f"https://127.0.0.1:{ports['webhook']}/validate"},
            }
        ],
    }


def bisect(
    label: str, low: int, high: int, attempt: Callable[[int], tuple[bool, str, dict[str, int]]]
) -> tuple[int, dict[str, int], str]:
    """The largest n in [low, high] that works (assuming `low` does); what stopped n + 1."""
    good: tuple[int, dict[str, int]] = (0, {})
    reason = ""
    ok, why, found = attempt(low)
    if not ok:
        return 0, {}, why
    good = (low, found)
    while high - low > 1:
        middle = (low + high) // 2
        ok, why, found = attempt(middle)
        print(f"  {label}: {middle} nodes: {'ok' if ok else 'refused: ' + why}", flush=True)
        if ok:
            low, good = middle, (middle, found)
        else:
            high, reason = middle, why
    return good[0], good[1], reason


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--high", type=int, default=1500, help="an upper bound to start from")
    parser.add_argument(
        "--only", choices=("client", "server", "operator"), action="append", default=[]
    )
    parser.add_argument(
        "--nodes", type=int, action="append", default=[], help="try these sizes, no bisection"
    )
    args = parser.parse_args()
    cluster = Cluster()
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/edgeconfigs.iop.dev")
    per_node = len(json.dumps(sized_spec(100), separators=(",", ":"))) / 100
    print(f"one node of four providers: {per_node:.0f} bytes of JSON in the spec")
    results = []
    wanted = args.only or ["client", "server", "operator"]
    if args.nodes:
        with tempfile.TemporaryDirectory() as folder:
            for n in args.nodes:
                for way in wanted:
                    if way == "operator":
                        outcome = asyncio.run(by_operator(cluster, n, Path(folder)))
                    else:
                        flags = ("--server-side",) if way == "server" else ()
                        outcome = by_kubectl(cluster, n, *flags)
                    print(f"{way} {n}: {outcome}", flush=True)
        return
    if "client" in wanted:
        results.append(
            ("kubectl apply", *bisect("client", 10, args.high, lambda n: by_kubectl(cluster, n)))
        )
    if "server" in wanted:
        results.append(
            (
                "kubectl apply --server-side",
                *bisect("server", 10, args.high, lambda n: by_kubectl(cluster, n, "--server-side")),
            )
        )
    if "operator" in wanted:
        with tempfile.TemporaryDirectory() as folder:
            results.append(
                (
                    "through the operator",
                    *bisect(
                        "operator", 10, args.high,
                        lambda n: asyncio.run(by_operator(cluster, n, Path(folder))),
                    ),
                )
            )  # fmt: skip
    print()
    print("| way in | largest (nodes) | sizes at the largest (bytes) | what refused one more |")
    print("|---|---|---|---|")
    for label, nodes, found, reason in results:
        shown = ", ".join(f"{k} {v:,}" for k, v in found.items())
        print(f"| {label} | {nodes} | {shown} | {reason} |")


if __name__ == "__main__":
    main()
