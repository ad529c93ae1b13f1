"""The chart wires the Node link as the product needs it: every process drains within its pod's
grace period, and TLS (on by default, with certificates the operator makes unless the values
name a Secret; mutual optional) names files that are really mounted, with the flags and config
fields the Edge, the Node and the operator read.

The workloads' arguments are parsed with the real `iop` command line, so a flag the chart passes
and the CLI does not know fails here, not in a crash-looping pod.
"""

from __future__ import annotations

import argparse
import json
import posixpath
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from iop.cli import build_parser
from iop.edgeconfig.loading import load_data
from tests.chart.conftest import CHART, RenderFailed

if TYPE_CHECKING:
    from tests.chart.conftest import ChartTools

HUB_TLS = {"enabled": True, "secretName": "hub-tls"}
MUTUAL_TLS = {**HUB_TLS, "mutual": True, "clientSecretName": "node-tls"}


def by_kind(documents: Sequence[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def workload(documents: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    pod: dict[str, Any] = by_kind(documents, "Deployment")[name]["spec"]["template"]["spec"]
    return pod


def parsed_args(pod: dict[str, Any]) -> argparse.Namespace:
    (container,) = pod["containers"]
    return build_parser().parse_args(container["args"])


def mounted_files(pod: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret, key), for every Secret key the pod mounts."""
    (container,) = pod["containers"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    files: dict[str, tuple[str, str]] = {}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        sources = volume["projected"]["sources"] if "projected" in volume else [volume]
        for source in sources:
            secret = source.get("secret")
            if secret is None:
                continue
            name = secret.get("name") or secret["secretName"]
            for item in secret["items"]:
                files[posixpath.join(mount["mountPath"], item["path"])] = (name, item["key"])
    return files


def test_every_process_drains_within_its_pods_grace(chart_tools: ChartTools) -> None:
    documents = chart_tools.documents()
    node = workload(documents, "iop-iop-edge-node-node-1")
    args = parsed_args(node)
    assert args.shutdown_grace == 25
    assert args.drain_timeout == 30  # a refresh's adapter drain: not the shutdown
    assert node["terminationGracePeriodSeconds"] == 30

    edge = workload(documents, "iop-iop-edge-edge")
    assert parsed_args(edge).shutdown_grace == 20
    # Deleted, it serves on for 5 s while the Service's endpoints follow, then drains.
    (container,) = edge["containers"]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert edge["terminationGracePeriodSeconds"] == 30


def test_an_edge_without_a_pre_stop_sleep(chart_tools: ChartTools) -> None:
    documents = chart_tools.documents(values={"edge": {"preStopSleepSeconds": 0}})
    edge = workload(documents, "iop-iop-edge-edge")
    (container,) = edge["containers"]
    assert "lifecycle" not in container
    assert edge["terminationGracePeriodSeconds"] == 25


@pytest.mark.parametrize(
    ("values", "grace", "drain"),
    [
        pytest.param({"shutdownGraceSeconds": 40, "drainTimeoutSeconds": 120}, 40, 120, id="long"),
        pytest.param({"shutdownGraceSeconds": 0}, 0, 30, id="none"),
    ],
)
def test_the_node_grace_follows_shutdown_grace_not_the_drain_timeout(
    chart_tools: ChartTools, values: dict[str, int], grace: int, drain: int
) -> None:
    documents = chart_tools.documents(values={"nodeDefaults": values})
    node = workload(documents, "iop-iop-edge-node-node-1")
    args = parsed_args(node)
    assert (args.shutdown_grace, args.drain_timeout) == (grace, drain)
    assert node["terminationGracePeriodSeconds"] == grace + 5


def test_a_new_edge_waits_for_its_nodes_which_find_it_before_it_is_ready(
    chart_tools: ChartTools,
) -> None:
    """The hub Service lists not-ready Edge pods, so the Nodes reach a new Edge that waits for
    them (bounded) before it takes traffic; the Nodes look for new Edges every 5 s."""
    documents = chart_tools.documents()
    hub = by_kind(documents, "Service")["iop-iop-edge-hub"]["spec"]
    assert hub["clusterIP"] == "None" and hub["publishNotReadyAddresses"] is True
    openai = by_kind(documents, "Service")["iop-iop-edge-openai"]["spec"]
    assert "publishNotReadyAddresses" not in openai  # clients reach only ready Edges
    edge = by_kind(documents, "Deployment")["iop-iop-edge-edge"]
    args = parsed_args(edge["spec"]["template"]["spec"])
    assert args.wait_for_nodes == 20
    assert args.wait_for_nodes < edge["spec"]["progressDeadlineSeconds"]
    assert args.peers_service == "iop-iop-edge-hub:7443"
    assert parsed_args(workload(documents, "iop-iop-edge-node-node-1")).resolve_interval == 5


@pytest.mark.parametrize(
    ("wait", "interval"),
    [pytest.param(0, 30, id="off"), pytest.param(2.5, 0.5, id="fractions")],
)
def test_the_wait_and_the_resolve_interval_follow_the_values(
    chart_tools: ChartTools, wait: float, interval: float
) -> None:
    values = {
        "edge": {"readiness": {"nodesWaitSeconds": wait}},
        "nodeDefaults": {"resolveIntervalSeconds": interval},
    }
    documents = chart_tools.documents(values=values)
    assert parsed_args(workload(documents, "iop-iop-edge-edge")).wait_for_nodes == wait
    node = parsed_args(workload(documents, "iop-iop-edge-node-node-1"))
    assert node.resolve_interval == interval


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {"edge": {"readiness": {"nodesWaitSeconds": 180}}},
            "edge.readiness.nodesWaitSeconds (180) must stay below "
            "edge.progressDeadlineSeconds (180)",
            id="wait-past-the-deadline",
        ),
        pytest.param(
            {"edge": {"readiness": {"nodesWaitSeconds": -1}}},
            "nodesWaitSeconds",
            id="negative-wait",
        ),
        pytest.param(
            {"nodeDefaults": {"resolveIntervalSeconds": 0}},
            "resolveIntervalSeconds",
            id="no-interval",
        ),
    ],
)
def test_a_wait_or_interval_that_cannot_work_is_refused(
    chart_tools: ChartTools, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(RenderFailed) as caught:
        chart_tools.template(values=values)
    assert message in str(caught.value)


def test_tls_can_be_turned_off(chart_tools: ChartTools) -> None:
    documents = chart_tools.documents(values={"tls": {"enabled": False}})
    spec = by_kind(documents, "EdgeConfig")["iop-iop-edge"]["spec"]
    assert load_data(spec).edge.tls is None
    edge = workload(documents, "iop-iop-edge-edge")
    assert not [path for path in mounted_files(edge) if path.startswith("/etc/iop/tls")]
    node = workload(documents, "iop-iop-edge-node-node-1")
    args = parsed_args(node)
    assert (args.tls_ca_file, args.tls_cert_file, args.tls_key_file) == (None, None, None)
    assert args.tls_server_name is None
    assert set(mounted_files(node)) == {"/etc/iop/node/token"}
    assert parsed_args(workload(documents, "iop-iop-edge-operator")).hub_tls_secret is None


@pytest.mark.parametrize("mutual", [pytest.param(False, id="tls"), pytest.param(True, id="mutual")])
def test_tls_is_on_by_default_with_certificates_the_operator_makes(
    chart_tools: ChartTools, mutual: bool
) -> None:
    """No Secret named: the operator makes FULLNAME-hub-tls at start (it may read and create it,
    and read the hub Service that owns it), for the names the Nodes verify; the Edge and the
    Nodes mount it as they would the user's, the Nodes never the Edge's key."""
    documents = chart_tools.documents(values={"tls": {"mutual": mutual}})
    secret = "iop-iop-edge-hub-tls"
    config = load_data(by_kind(documents, "EdgeConfig")["iop-iop-edge"]["spec"])
    assert config.edge.tls is not None
    edge_files = mounted_files(workload(documents, "iop-iop-edge-edge"))
    assert edge_files[config.edge.tls.cert_file] == (secret, "tls.crt")
    assert edge_files[config.edge.tls.key_file] == (secret, "tls.key")
    if mutual:
        assert config.edge.tls.client_ca_file is not None
        assert edge_files[config.edge.tls.client_ca_file] == (secret, "ca.crt")

    node = workload(documents, "iop-iop-edge-node-node-1")
    args = parsed_args(node)
    node_files = mounted_files(node)
    assert node_files[str(args.tls_ca_file)] == (secret, "ca.crt")
    assert (secret, "tls.key") not in node_files.values()
    hub = by_kind(documents, "Service")["iop-iop-edge-hub"]
    assert args.tls_server_name == f"{hub['metadata']['name']}.iop-system.svc"
    if mutual:
        assert node_files[str(args.tls_cert_file)] == (secret, "client.crt")
        assert node_files[str(args.tls_key_file)] == (secret, "client.key")
    else:
        assert (args.tls_cert_file, args.tls_key_file) == (None, None)

    operator = parsed_args(workload(documents, "iop-iop-edge-operator"))
    assert operator.hub_tls_secret == secret
    assert operator.hub_tls_service == hub["metadata"]["name"]
    assert operator.hub_tls_san == []
    rules = by_kind(documents, "Role")["iop-iop-edge-operator"]["rules"]
    assert any(
        r["resources"] == ["secrets"] and secret in r.get("resourceNames", []) for r in rules
    )
    assert any(
        r["resources"] == ["services"] and hub["metadata"]["name"] in r["resourceNames"]
        for r in rules
    )


def test_a_generated_certificate_names_the_server_name_too(chart_tools: ChartTools) -> None:
    documents = chart_tools.documents(values={"tls": {"serverName": "hub.example.org"}})
    assert parsed_args(workload(documents, "iop-iop-edge-operator")).hub_tls_san == [
        "hub.example.org"
    ]
    node = parsed_args(workload(documents, "iop-iop-edge-node-node-1"))
    assert node.tls_server_name == "hub.example.org"


def test_the_users_secret_wins_and_nothing_is_generated(chart_tools: ChartTools) -> None:
    documents = chart_tools.documents(values={"tls": MUTUAL_TLS})
    assert parsed_args(workload(documents, "iop-iop-edge-operator")).hub_tls_secret is None
    rules = by_kind(documents, "Role")["iop-iop-edge-operator"]["rules"]
    named = {n for r in rules for n in r.get("resourceNames", [])}
    assert not {"iop-iop-edge-hub-tls", "iop-iop-edge-hub"} & named
    assert "iop-iop-edge-hub-tls" not in yaml.safe_dump_all(documents)


@pytest.mark.parametrize(
    "tls", [pytest.param(HUB_TLS, id="server-tls"), pytest.param(MUTUAL_TLS, id="mutual-tls")]
)
def test_tls_names_the_files_it_mounts(chart_tools: ChartTools, tls: dict[str, Any]) -> None:
    documents = chart_tools.documents(values={"tls": tls})
    mutual = bool(tls.get("mutual"))

    # The Edge: its certificate and key (and the client CA for mutual TLS) from the Secret, at
    # the paths the EdgeConfig names.
    config = load_data(by_kind(documents, "EdgeConfig")["iop-iop-edge"]["spec"])
    assert config.edge.tls is not None
    edge_files = mounted_files(workload(documents, "iop-iop-edge-edge"))
    assert edge_files[config.edge.tls.cert_file] == ("hub-tls", "tls.crt")
    assert edge_files[config.edge.tls.key_file] == ("hub-tls", "tls.key")
    if mutual:
        assert config.edge.tls.client_ca_file is not None
        assert edge_files[config.edge.tls.client_ca_file] == ("hub-tls", "ca.crt")
    else:
        assert config.edge.tls.client_ca_file is None
        assert ("hub-tls", "ca.crt") not in edge_files.values()

    # The Node: the CA from the Edge's Secret (never the Edge's key), its own pair for mutual
    # TLS, and the hub Service's name to verify, since it dials the pod IPs behind it.
    node = workload(documents, "iop-iop-edge-node-node-1")
    args = parsed_args(node)
    node_files = mounted_files(node)
    assert node_files[str(args.tls_ca_file)] == ("hub-tls", "ca.crt")
    assert ("hub-tls", "tls.key") not in node_files.values()
    (service,) = args.edge_service
    hub = by_kind(documents, "Service")["iop-iop-edge-hub"]
    assert service.split(":")[0] == hub["metadata"]["name"]
    assert hub["spec"]["clusterIP"] == "None"  # so the Node dials pod IPs: the name is needed
    assert args.tls_server_name == f"{hub['metadata']['name']}.iop-system.svc"
    if mutual:
        assert node_files[str(args.tls_cert_file)] == ("node-tls", "tls.crt")
        assert node_files[str(args.tls_key_file)] == ("node-tls", "tls.key")
    else:
        assert (args.tls_cert_file, args.tls_key_file) == (None, None)
        assert set(node_files.values()) == {
            ("iop-iop-edge-node-node-1", "token"),
            ("hub-tls", "ca.crt"),
        }


def test_tls_server_name_can_be_given(chart_tools: ChartTools) -> None:
    tls = {**HUB_TLS, "serverName": "hub.example.org"}
    documents = chart_tools.documents(values={"tls": tls})
    args = parsed_args(workload(documents, "iop-iop-edge-node-node-1"))
    assert args.tls_server_name == "hub.example.org"


@pytest.mark.parametrize(
    ("values", "says"),
    [
        pytest.param(
            {"operator": {"enabled": False}},
            "tls.secretName: with operator.enabled=false nothing makes",
            id="no-operator-to-make-it",
        ),
        pytest.param(
            {"tls": {"mutual": True, "clientSecretName": "node-tls"}},
            "tls.clientSecretName: needs tls.secretName",
            id="client-secret-for-a-generated-ca",
        ),
        pytest.param(
            {"tls": {**HUB_TLS, "mutual": True}},
            "tls.clientSecretName: tls.mutual needs",
            id="mutual-no-client-secret",
        ),
        pytest.param(
            {"tls": {"enabled": False, "mutual": True}},
            "tls.mutual: needs tls.enabled",
            id="mutual-off",
        ),
        pytest.param(
            {
                "edgeConfig": {
                    "spec": {"edge": {"id": "e", "tls": {"certFile": "/c", "keyFile": "/k"}}}
                }
            },
            "edgeConfig.spec.edge.tls: the chart sets it from the values tls.*",
            id="tls-in-the-spec",
        ),
    ],
)
def test_a_half_made_tls_setting_fails_with_what_is_missing(
    chart_tools: ChartTools, values: dict[str, Any], says: str
) -> None:
    with pytest.raises(AssertionError) as failure:  # conftest's RenderFailed
        chart_tools.template(values=values)
    assert says in str(failure.value)


def test_a_node_placed_on_the_edge_has_no_token_nor_workload_and_the_edges_count_each_other(
    chart_tools: ChartTools,
) -> None:
    local: dict[str, Any] = {
        "id": "local-1",
        "placement": "edge",
        "providers": [
            {
                "id": "vllm-local",
                "adapter": {
                    "type": "openai",
                    "baseUrl": "http://vllm.models:8000/v1",
                    "apiKeyEnv": "VLLM_KEY",
                },
                "servedModels": ["echo"],
                "capacity": 64,
            }
        ],
    }
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["edgeConfig"]["spec"]
    key = {
        "env": "VLLM_KEY",
        "secretName": "vllm-key",
        "secretKey": "key",
        "hosts": ["vllm.models:8000"],
    }
    values = {
        "edgeConfig": {"spec": {"nodes": [*defaults["nodes"], local]}},
        "edge": {"apiKeys": [key]},
        "upstreams": {"allow": ["vllm.models:8000"]},
    }
    documents = chart_tools.documents(values=values)
    (rendered,) = [d["spec"] for d in documents if d["kind"] == "EdgeConfig"]
    node = {n.id: n for n in load_data(rendered).nodes}["local-1"]
    assert node.on_edge and node.token_secret is None and node.token_hash_sha256 is None
    assert "iop-iop-edge-node-local-1" not in by_kind(documents, "Deployment")
    edge = workload(documents, "iop-iop-edge-edge")
    (container,) = edge["containers"]
    policy, secret = container["env"]
    assert secret == {
        "name": "VLLM_KEY",
        "valueFrom": {"secretKeyRef": {"name": "vllm-key", "key": "key"}},
    }
    # The Edge runs the placed node's providers: its policy binds the key it holds.
    assert policy["name"] == "IOP_UPSTREAM_POLICY"
    assert json.loads(policy["value"]) == {
        "allow": ["vllm.models:8000"],
        "deny": [],
        "keys": [{"env": "VLLM_KEY", "hosts": ["vllm.models:8000"], "providers": []}],
    }
    args = parsed_args(edge)
    (hub,) = [
        s for s in by_kind(documents, "Service").values() if s["spec"].get("clusterIP") == "None"
    ]
    assert args.peers_service == f"{hub['metadata']['name']}:{hub['spec']['ports'][0]['port']}"

    with pytest.raises(AssertionError) as failure:  # conftest's RenderFailed
        chart_tools.template(values={**values, "nodes": [{"id": "node-1"}, {"id": "local-1"}]})
    assert "nodes[1]: node local-1 is placed on the Edge" in str(failure.value)
