"""The largest EdgeConfig docs/operator.md documents for the operator is admitted by the webhook,
classified (the plan in the warnings), applied on a real Edge, and a change to it applied live.

The limits themselves are measured by `bench/edgeconfig_sizes.py`.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from iop.fakes import sized_spec

pytestmark = pytest.mark.e2e

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operator.md"


def documented_largest() -> int:
    """The node count docs/operator.md gives for the operator's path."""
    match = re.search(r"\| through the operator \| \*\*(\d+)\*\*", DOCS.read_text())
    assert match, "docs/operator.md has no 'through the operator' row in its sizes table"
    return int(match.group(1))


@pytest.mark.timeout(600)  # a 644-node config: each apply moves about a megabyte, four times over
async def test_the_largest_documented_edgeconfig_is_admitted_classified_and_applied(
    kube_cluster, namespace, start_operator, host_stack, host_spec, edgeconfigs
) -> None:
    nodes = documented_largest()
    small = host_spec()
    spec = sized_spec(nodes)
    spec["edge"] = small["edge"]
    spec["openai"] = {**small["openai"], "longContextThresholdTokens": 32000}
    # No Node processes: hundreds of them would take the machine's memory, and the point is the
    # config's path through the API server, the operator and the Edge.
    stack = await host_stack(spec, nodes=False)
    start_operator(edge_admins=[stack.admin_url])

    manifest = {
        "apiVersion": "iop.dev/v1alpha1",
        "kind": "EdgeConfig",
        "metadata": {"name": "large"},
        "spec": spec,
    }
    created = await asyncio.to_thread(
        kube_cluster.kubectl, "apply", "--server-side", "-n", namespace, "-f", "-",
        stdin=json.dumps(manifest), timeout=120,
    )  # fmt: skip
    assert "plan: first apply of config" in created.stderr
    ec = await asyncio.to_thread(edgeconfigs.wait, "large", timeout=240)
    assert ec["status"]["nodesAcked"] == f"0/{nodes}"  # no Node runs: they are not connected
    assert ec["status"]["omittedNodes"] == nodes - 100

    spec["nodes"][-1]["providers"][0]["capacity"] = 9
    changed = await asyncio.to_thread(
        kube_cluster.kubectl, "apply", "--server-side", "-n", namespace, "-f", "-",
        stdin=json.dumps(manifest), timeout=120,
    )  # fmt: skip
    last = spec["nodes"][-1]
    path = f"nodes[{last['id']}].providers[{last['providers'][0]['id']}].capacity"
    assert f"Warning: live: {path}" in changed.stderr
    ec = await asyncio.to_thread(edgeconfigs.wait, "large", generation=2, timeout=240)
    assert ec["status"]["lastChange"]["livePaths"] == [path]
    configmap = await asyncio.to_thread(kube_cluster.get, "cm", "large-edge", "-n", namespace)
    assert len(configmap["data"]["edge.yaml"]) < 1024 * 1024
