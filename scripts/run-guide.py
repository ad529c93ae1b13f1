"""What `make run` prints once the chart is Ready: where things are and what to type.

It reads the live objects (the OpenAI Service's ClusterIP, an API key from the chart's Secret),
writes two ready-made edits of the EdgeConfig next to the cluster's state (one live, one that
restarts the Edge), and says what `kubectl apply` will warn and what the status will show for
each: the webhook states the plan, the operator carries it out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml


def kubectl(*args: str) -> str:
    return subprocess.run(["kubectl", *args], capture_output=True, text=True, check=True).stdout


def edit_file(live: dict[str, Any], change: str) -> dict[str, Any]:
    """A manifest of the EdgeConfig as it is, with one change; apply it with `kubectl apply`."""
    spec = copy.deepcopy(live["spec"])
    if change == "capacity":
        provider = spec["nodes"][0]["providers"][0]
        provider["capacity"] = provider["capacity"] + 4
    else:
        spec["openai"]["listen"] = "[::]:8080"  # the same port, IPv6 too: an Edge restart
    return {
        "apiVersion": live["apiVersion"],
        "kind": live["kind"],
        "metadata": {"name": live["metadata"]["name"], "namespace": live["metadata"]["namespace"]},
        "spec": spec,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--exports", required=True)
    parser.add_argument("--elapsed", type=int, default=0)
    args = parser.parse_args()
    ns = args.namespace
    state = Path(os.environ["IOP_CLUSTER_STATE"])
    live = json.loads(kubectl("get", "ec", "edge", "-n", ns, "-o", "json"))
    edits = state / "edits"
    edits.mkdir(parents=True, exist_ok=True)
    capacity, listener = edits / "capacity.yaml", edits / "listener.yaml"
    live_edit = edit_file(live, "capacity")
    capacity.write_text(yaml.safe_dump(live_edit, sort_keys=False))
    # The second edit starts from the first, so applying both in order changes one thing each.
    listener.write_text(yaml.safe_dump(edit_file(live_edit, "listener"), sort_keys=False))
    node = live["spec"]["nodes"][0]
    provider = node["providers"][0]
    before = provider["capacity"]
    broken = '{"spec":{"openai":{"longContextThresholdTokens":0}}}'

    ip = kubectl("get", "svc", "iop-openai", "-n", ns, "-o", "jsonpath={.spec.clusterIP}")
    port = kubectl("get", "svc", "iop-openai", "-n", ns, "-o", "jsonpath={.spec.ports[0].port}")
    url = f"http://{ip}:{port}/v1"
    key_command = (
        f"kubectl -n {ns} get secret iop-api-keys -o jsonpath='{{.data.search-chat}}' | base64 -d"
    )

    print(f"""
IOP Edge runs in Kubernetes (ready in {args.elapsed}s): the operator, the Edge, three Nodes and a
fake upstream, each pod a real `iop` process. In another shell:

{args.exports.strip()}
kubectl -n {ns} get pods -o wide
kubectl -n {ns} get ec -o wide
kubectl -n {ns} describe ec edge

Ask the Edge, through its Service (the key the operator generated into Secret iop-api-keys):

export OPENAI_API_KEY=$({key_command})
curl {url}/chat/completions -H "Authorization: Bearer $OPENAI_API_KEY" \\
  -H "Content-Type: application/json" \\
  -d '{{"model":"llama-3.1-8b","messages":[{{"role":"user","content":"Hello!"}}]}}'

uv run python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{url}")  # reads OPENAI_API_KEY
for chunk in client.chat.completions.create(model="demo-echo", stream=True,
        messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY

Two ready-made edits of the EdgeConfig (written to {edits}):

1. Live: {node["id"]}'s provider {provider["id"]}: capacity {before} -> {before + 4}
   kubectl apply -f {capacity}
   kubectl apply warns (the webhook states the plan):
     Warning: live: nodes[{node["id"]}].providers[{provider["id"]}].capacity
   (the first apply also warns that the Helm-made object has no last-applied annotation: harmless)
   Then `kubectl -n {ns} get ec -o wide`: GENERATION goes up, READY and APPLIED True, RESTART
   none, a new CONFIG hash; `describe` shows the AppliedLive event and the capacity under Last
   Change. No pod restarts: `kubectl -n {ns} get pods` shows the same pods and AGEs.

2. Restart: openai.listen 0.0.0.0:8080 -> [::]:8080 (the same port, IPv6 clients too)
   kubectl apply -f {listener}
   kubectl apply warns:
     Warning: restart edge: openai.listen
   Then `kubectl -n {ns} get ec -o wide` shows READY False, APPLIED False and RESTART edge while
   the Edge rolls, its MESSAGE saying how far (`edge: Deployment/iop-edge 1 of 2 new replicas
   updated`), then READY True once the new Edge pods serve and the Nodes are back on them (NODES
   3/3); only the Edge pods are replaced (`kubectl -n {ns} get pods`: new iop-edge-... pods, the
   Nodes, the operator and the fake upstream keep theirs); the Rolling and RolledOut events say so.
   To wait for it in a script (never on the previous generation's Ready):
     GEN=$(kubectl -n {ns} get ec edge -o jsonpath='{{.metadata.generation}}')
     kubectl -n {ns} wait --for=jsonpath='{{.status.observedGeneration}}'=$GEN ec/edge
     kubectl -n {ns} wait --for=condition=Ready ec/edge --timeout=180s

A broken edit is refused with every problem and its path, e.g.
   kubectl -n {ns} patch ec edge --type=merge -p '{broken}'

Ctrl-C here (or `make stop` in another shell) stops everything. `make run-local` is the quick
mode without Kubernetes (`iop up`).
""")


if __name__ == "__main__":
    main()
