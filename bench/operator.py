"""Benchmark: the operator. From the API call that changes an EdgeConfig to `Ready` again.

    eval "$(e2e/cluster/up)"   # or let this script find the running cluster
    uv run --frozen python -m bench.operator [--changes 30] [--nodes 4]

1. **Live change -> Applied.** An Edge (`iop edge run`) and `--nodes` Nodes (`iop node run`,
   each with one `fake` provider) on this host; the operator in this process (the same code as
   `iop operator run`, told the Edge's admin URL). `--changes` changes in a row, alternating a
   capacity flip (every node's payload changes: the Edge pushes to all and waits for their acks)
   and a priority flip (Edge-only: no push). Each change is one merge patch of the spec through
   the API; the clock runs from just before the patch until a GET of the EdgeConfig shows
   `Ready=True` for the new generation (polled every 5 ms). Split into its parts from the
   operator's own timings of the pass (`PassTimings`):
   - watch delay: the patch sent -> the operator's worker has the new generation;
   - validate + classify: the model's load and `classify` against the applied record;
   - ConfigMap: writing `NAME-edge` (server-side apply) and the applied record;
   - replicas: `POST /refresh` on the replica and `GET /status`, of which the replica itself
     reports its apply (node acks included); node acks = that, capacity minus priority flips;
   - status: the status patch;
   - seen: the status written -> the client's poll sees it.
2. **Restart change -> rollout complete** (`--pods`, needs the process kubelet): the product's
   chart (`deploy/helm/iop-edge`) on pods, without its operator (`operator.enabled=false`) nor
   its EdgeConfig: two Edge replicas (maxSurge 1, maxUnavailable 0) and `--nodes` Nodes with the
   tokens the chart generates; the operator as in (1) but finding the replicas as pods; first
   (1) on pods, then `--restarts` Edge-scope changes (`openai.maxRequestBytes`), each from the
   patch until `Ready` again: the rollout complete and the new pods running the new config.

Figures go to docs/benchmarks.md ("## Operator").
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.benchkit import nearest_rank
from e2e.cluster.layout import LAUNCHER, python_command, python_env
from iop.edgeconfig import token_sha256
from iop.operator import OperatorOptions, PassTimings, run_operator
from iop.operator.kubeapi import KubeApi, resource_path
from iop.processes import spawn_edge, spawn_node, terminate

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "deploy" / "crds" / "edgeconfigs.iop.dev.yaml"
CHART = REPO / "deploy" / "helm" / "iop-edge"
NAME = "bench"


def cluster_env() -> dict[str, str]:
    """`KUBECONFIG` and `PATH` (its kubectl first) of e2e/cluster's running cluster, or exit."""
    status = subprocess.run(
        python_command(LAUNCHER, "status", "--json"),
        env=python_env(),
        capture_output=True,
        text=True,
    )
    if status.returncode != 0:
        sys.exit("no healthy cluster: run e2e/cluster/up first")
    report = json.loads(status.stdout)
    return {
        "KUBECONFIG": report["kubeconfig"],
        "PATH": f"{report['bin_dir']}{os.pathsep}{os.environ['PATH']}",
    }


def kubectl(env: dict[str, str], *args: str, stdin: str | None = None) -> str:
    result = subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, env={**os.environ, **env}
    )
    if result.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args[:3])}: {result.stderr.strip()}")
    return result.stdout


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spec(nodes: int) -> dict[str, Any]:
    providers = [f"p{n}" for n in range(nodes)]
    return {
        "edge": {
            "id": "edge-bench",
            "listen": f"127.0.0.1:{free_port()}",
            "admin": {"listen": f"127.0.0.1:{free_port()}"},
        },
        "openai": {"listen": f"127.0.0.1:{free_port()}"},
        "models": [{"id": "m", "providers": {p: "served" for p in providers}}],
        "nodes": [
            {
                "id": f"node-{n}",
                "tokenHashSha256": token_sha256(f"node-{n}-token"),
                "providers": [
                    {
                        "id": f"p{n}",
                        "adapter": {"type": "fake"},
                        "servedModels": ["served"],
                        "capacity": 8,
                    }
                ],
            }
            for n in range(nodes)
        ],
    }


async def ready_generation(api: KubeApi, path: str, generation: int, timeout: float) -> float:
    """Poll until Ready=True for `generation`; the monotonic time it was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = await api.get(path)
        status = obj.get("status") or {}
        ready = {c["type"]: c for c in status.get("conditions", [])}.get("Ready", {})
        if (
            status.get("observedGeneration") == generation
            and ready.get("status") == "True"
            and ready.get("observedGeneration") == generation
        ):
            return time.monotonic()
        await asyncio.sleep(0.005)
    raise TimeoutError(f"generation {generation} not Ready in {timeout}s")


def prepare(env: dict[str, str]) -> str:
    """The cluster's environment in this process's, the CRD applied and established, and a
    namespace of this run's own: its name."""
    os.environ.update(env)
    namespace = f"bench-{os.getpid()}"
    kubectl(env, "apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl(env, "wait", "--for=condition=Established", "crd/edgeconfigs.iop.dev")
    kubectl(env, "create", "namespace", namespace)
    return namespace


async def live(args: argparse.Namespace, env: dict[str, str]) -> None:
    """Host mode: an Edge and its Nodes as processes here, the operator told their admin URL."""
    namespace = prepare(env)
    document = spec(args.nodes)
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "edge.yaml"
        config.write_text(json.dumps(document))
        edge, started = await spawn_edge(config, startup_timeout=60)
        nodes = []
        try:
            for n in range(args.nodes):
                token = Path(folder) / f"node-{n}.token"
                token.write_text(f"node-{n}-token")
                nodes.append(await spawn_node(started["hub_port"], f"node-{n}", token))
            await measure(args, env, namespace, document, (started["admin_url"],))
        finally:
            for node in nodes:
                await terminate(node)
            await terminate(edge)
            kubectl(env, "delete", "namespace", namespace, "--wait=false")


async def pods(args: argparse.Namespace, env: dict[str, str]) -> None:
    """Pods mode: the chart's Edge (2 replicas) and Nodes run by the process kubelet; the
    operator here finds the replicas as pods, as in a cluster. The chart names everything after
    the EdgeConfig (fullnameOverride) and generates the Nodes' tokens, whose hashes go into the
    spec this benchmark creates."""
    namespace = prepare(env)
    document = spec(args.nodes)
    document["edge"]["listen"] = "0.0.0.0:7443"
    document["edge"]["admin"] = {"listen": "0.0.0.0:9090", "tokenFile": "/etc/iop/admin/token"}
    document["openai"]["listen"] = "0.0.0.0:8080"
    values = {
        "fullnameOverride": NAME,
        "operator": {"enabled": False},
        "edgeConfig": {"create": False},
        # The admin port admits only the chart's operator pods; this one runs here.
        "edge": {"replicas": 2, "networkPolicy": {"enabled": False}},
        "nodes": [{"id": node["id"]} for node in document["nodes"]],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        file.write(json.dumps(values))
        file.flush()
        subprocess.run(
            ["helm", "install", "iop", str(CHART), "-n", namespace, "-f", file.name],
            check=True, capture_output=True, env={**os.environ, **env},
        )  # fmt: skip
    for node in document["nodes"]:
        token = kubectl(env, "get", "secret", f"{NAME}-node-{node['id']}", "-n", namespace,
                        "-o", "jsonpath={.data.token}")  # fmt: skip
        node["tokenHashSha256"] = token_sha256(base64.b64decode(token).decode())
    try:
        await measure(args, env, namespace, document, ())
    finally:
        kubectl(env, "delete", "namespace", namespace, "--wait=false")


async def measure(
    args: argparse.Namespace,
    env: dict[str, str],
    namespace: str,
    document: dict[str, Any],
    edge_admin_urls: tuple[str, ...],
) -> None:
    timings: dict[int, PassTimings] = {}
    stop = asyncio.Event()
    options = OperatorOptions(
        namespace=namespace,
        kubeconfig=env["KUBECONFIG"],
        edge_admin_urls=edge_admin_urls,
        webhook_listen=None,
        liveness_listen=None,
    )

    def record(timing: PassTimings) -> None:
        timings[timing.generation] = timing

    operator = asyncio.create_task(
        run_operator(options, stop=stop, on_pass=record), name="bench-operator"
    )
    api = await KubeApi.connect(env["KUBECONFIG"])
    path = resource_path("iop.dev/v1alpha1", "edgeconfigs", namespace, NAME)
    try:
        metadata = {"name": NAME, "namespace": namespace}
        body = {"apiVersion": "iop.dev/v1alpha1", "kind": "EdgeConfig", "metadata": metadata}
        body["spec"] = document
        collection = resource_path("iop.dev/v1alpha1", "edgeconfigs", namespace)
        created = time.monotonic()
        await api.create(collection, body)
        seen = await ready_generation(api, path, 1, 300)
        print(f"create -> Ready: {(seen - created) * 1000:.0f} ms")
        # Wait until every node is connected and acked, so each flip pushes to all of them.
        for _ in range(1200):
            obj = await api.get(path)
            if obj["status"].get("nodesAcked") == f"{args.nodes}/{args.nodes}":
                break
            await asyncio.sleep(0.1)
        rows: list[dict[str, float | str]] = []
        generation = 1
        for change in range(args.changes):
            generation += 1
            kind = "capacity" if change % 2 == 0 else "priority"
            value = 8 + (change // 2) % 2 + (1 if kind == "capacity" else 0)
            for node in document["nodes"]:
                node["providers"][0][kind] = value
            sent = time.monotonic()
            await api.merge_patch(path, {"spec": {"nodes": document["nodes"]}})
            seen = await ready_generation(api, path, generation, 60)
            while generation not in timings:  # the pass ends just after its status write
                await asyncio.sleep(0.001)
            t = timings[generation]
            rows.append(
                {
                    "kind": kind,
                    "total": (seen - sent) * 1000,
                    "watch": (t.received_at - sent) * 1000,
                    "validate+classify": t.parts.get("validate", 0) + t.parts.get("classify", 0),
                    "configmap": t.parts.get("configmap", 0),
                    "workloads": t.parts.get("workloads", 0),
                    "replicas": t.parts.get("replicas", 0),
                    "replica apply": statistics.fmean(t.replica_apply_ms or [0.0]),
                    "status": t.parts.get("status", 0),
                    "seen": (seen - t.finished_at) * 1000,
                }
            )
        report(rows)
        if not edge_admin_urls:  # pods: the operator rolls the Edge itself
            # An Edge-scope change the chart's probes do not depend on (a listener would be).
            for restart in range(args.restarts):
                generation += 1
                limit = 4 * 1024 * 1024 + restart
                sent = time.monotonic()
                await api.merge_patch(path, {"spec": {"openai": {"maxRequestBytes": limit}}})
                seen = await ready_generation(api, path, generation, 300)
                print(
                    f"restart edge (openai.maxRequestBytes): patch -> Ready (rollout complete, "
                    f"the new pods run it): {(seen - sent) * 1000:.0f} ms"
                )
    finally:
        stop.set()
        await operator
        await api.stop()


def report(rows: list[dict[str, float | str]]) -> None:
    columns = ["total", "watch", "validate+classify", "configmap", "workloads", "replicas",
               "replica apply", "status", "seen"]  # fmt: skip
    print(f"| change | n | {' | '.join(f'{c} p50' for c in columns)} | total p99 |")
    print(f"|---|---:|{'---:|' * (len(columns) + 1)}")
    groups = {"all": rows}
    for kind in ("capacity", "priority"):
        groups[kind] = [r for r in rows if r["kind"] == kind]
    for label, group in groups.items():
        cells = [f"{nearest_rank((float(r[c]) for r in group), 50):.1f}" for c in columns]
        p99 = nearest_rank((float(r["total"]) for r in group), 99)
        print(f"| {label} | {len(group)} | {' | '.join(cells)} | {p99:.1f} |")
    acks = nearest_rank((float(r["replica apply"]) for r in groups["capacity"]), 50) - nearest_rank(
        (float(r["replica apply"]) for r in groups["priority"]), 50
    )
    print(f"\nnode acks (capacity minus priority, the replica's own apply time): {acks:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--pods", action="store_true", help="on pods (needs the process kubelet)")
    parser.add_argument("--restarts", type=int, default=2, help="Edge restarts to time (pods)")
    args = parser.parse_args()
    env = cluster_env()
    asyncio.run(pods(args, env) if args.pods else live(args, env))


if __name__ == "__main__":
    main()
