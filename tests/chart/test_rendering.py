"""The chart renders what the cluster accepts, the same bytes every time (no token drawn, no
hash computed: the operator makes tokens in the cluster), follows the operator's contract, and
refuses values it does not know.

Rendered with the pinned helm and validated by kubeconform (-strict) against the pinned
Kubernetes release's schemas and the EdgeConfig CRD, so a misspelt field or a spec the CRD
refuses fails here, not at `helm install`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from iop.edgeconfig import EdgeConfig, camel_path
from iop.edgeconfig.loading import load_data

if TYPE_CHECKING:
    # Only for annotations: conftest.py is pytest's to import.
    from tests.chart.conftest import ChartTools

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "iop-edge"
RUN_VALUES = REPO / "configs" / "helm-values.yaml"

# Every optional part on, so that each template is rendered and validated at least once.
EVERYTHING = {
    "fakeUpstream": {"enabled": True},
    "limitStore": {"redis": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}},
    "edge": {"replicas": 3, "service": {"type": "NodePort", "nodePort": 30080}},
    "tls": {
        "enabled": True,
        "secretName": "hub-tls",
        "mutual": True,
        "clientSecretName": "node-tls",
    },
}
VALUE_SETS = [
    pytest.param([], None, id="defaults"),
    pytest.param(["--values", str(RUN_VALUES)], None, id="make-run"),
    pytest.param([], EVERYTHING, id="everything"),
    pytest.param(
        [],
        {"edgeConfig": {"create": False}, "operator": {"webhook": {"enabled": False}}},
        id="own-edgeconfig-no-webhook",
    ),
    pytest.param([], {"operator": {"enabled": False}, "tls": {"enabled": False}}, id="no-operator"),
]


@pytest.mark.parametrize(("args", "values"), VALUE_SETS)
def test_helm_lint_strict_passes(chart_tools: ChartTools, args, values, tmp_path: Path) -> None:
    extra = list(args)
    if values is not None:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        extra += ["--values", str(path)]
    result = chart_tools.lint(*extra)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(("args", "values"), VALUE_SETS)
def test_rendered_manifests_fit_the_kubernetes_and_crd_schemas(
    chart_tools: ChartTools, args, values
) -> None:
    manifests = chart_tools.template(*args, values=values)
    result = chart_tools.kubeconform_run(manifests)
    assert result.returncode == 0, result.stdout + result.stderr
    count = len([d for d in yaml.safe_load_all(manifests) if d])
    assert f"Valid: {count}, Invalid: 0, Errors: 0, Skipped: 0" in result.stdout


def test_kubeconform_catches_a_misspelt_field_and_a_spec_the_crd_refuses(
    chart_tools: ChartTools,
) -> None:
    # Proof that the validation above can fail: the same output with two mistakes in it.
    manifests = chart_tools.template()
    broken = manifests.replace("readinessProbe:", "readinesProbe:", 1).replace(
        "longContextThresholdTokens:", "longContextThreshold:", 1
    )
    result = chart_tools.kubeconform_run(broken)
    assert result.returncode != 0
    assert "additional properties 'readinesProbe' not allowed" in result.stdout
    assert "additional properties 'longContextThreshold' not allowed" in result.stdout


@pytest.mark.parametrize(
    ("values", "says"),
    [
        pytest.param({"edge": {"replica": 2}}, "replica", id="typo-top"),
        pytest.param(
            {"operator": {"webhook": {"failurePolicy": "Fail"}}}, "failurePolicy", id="typo-nested"
        ),
        pytest.param({"edgeConfig": {"spec": {"modles": []}}}, "modles", id="typo-spec"),
        pytest.param({"nodes": [{"id": "node-1", "apikeys": []}]}, "apikeys", id="typo-node"),
        pytest.param({"edge": {"ports": {"openai": 0}}}, "openai", id="port-0"),
        pytest.param({"edge": {"ports": {"metrics": 70000}}}, "metrics", id="metrics-port"),
        pytest.param({"tls": {"enable": True}}, "enable", id="typo-tls"),
        pytest.param({"nodeDefaults": {"shutdownGrace": 10}}, "shutdownGrace", id="typo-grace"),
        pytest.param({"nodes": [{"id": "Node_1"}]}, "id", id="node-id-not-a-dns-label"),
    ],
)
def test_the_values_schema_refuses_what_it_does_not_know(
    chart_tools: ChartTools, values: dict[str, Any], says: str
) -> None:
    with pytest.raises(AssertionError) as failure:  # conftest's RenderFailed
        chart_tools.template(values=values)
    assert "values don't meet the specifications of the schema" in str(failure.value)
    assert says in str(failure.value)


def test_every_section_of_the_edgeconfig_spec_is_in_the_values_schema() -> None:
    """`edgeConfig.spec` refuses keys it does not list: a section the config model gained and
    the schema missed (`rollout` once did) would refuse every values file that sets it."""
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    spec = schema["properties"]["edgeConfig"]["properties"]["spec"]
    assert spec["additionalProperties"] is False
    sections = {camel_path(name) for name in EdgeConfig.model_fields}
    assert sections == set(spec["properties"])


def test_every_value_is_in_the_schema_and_documented(chart_values: dict[str, Any]) -> None:
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    readme = (CHART / "README.md").read_text()

    def walk(values: dict[str, Any], node: dict[str, Any], path: str) -> None:
        for key, value in values.items():
            assert key in node.get("properties", {}), f"{path}{key} is not in values.schema.json"
            child = node["properties"][key]
            if isinstance(value, dict) and child.get("additionalProperties") is False:
                walk(value, child, f"{path}{key}.")
            elif f"`{path}{key}`" not in readme:
                # A leaf (or an open object such as resources): the README's table names it.
                raise AssertionError(f"{path}{key} is not documented in the chart's README.md")

    assert schema["additionalProperties"] is False
    walk(chart_values, schema, "")


#: Template functions whose result is not a function of the values: drawn at random, read from
#: the cluster (empty under `helm template`), or the time of the render.
_IMPURE = re.compile(
    r"\b(randAlphaNum|randAlpha|randNumeric|randAscii|randBytes|randInt|uuidv4|genCA|"
    r"genPrivateKey|genSelfSignedCert|genSignedCert|derivePassword|lookup|now|date)\b"
)


@pytest.mark.parametrize(("args", "values"), VALUE_SETS)
def test_renders_are_pure(chart_tools: ChartTools, args, values) -> None:
    """What Argo CD does on every sync: render again and compare. Two renders are the same bytes,
    and nothing is a Secret: the operator makes the tokens in the cluster."""
    first = chart_tools.template(*args, values=values)
    second = chart_tools.template(*args, values=values)
    assert first == second
    kinds = {d["kind"] for d in yaml.safe_load_all(first) if d}
    assert "Secret" not in kinds


def test_no_template_calls_an_impure_function() -> None:
    used = {
        f"{path.relative_to(CHART)}: {match.group(1)}"
        for path in (CHART / "templates").rglob("*")
        if path.is_file()
        for match in _IMPURE.finditer(path.read_text())
    }
    assert used == set()


def test_helm_template_without_a_kube_version_renders(chart_tools: ChartTools) -> None:
    """Helm's default is v1.20; the chart sets no kubeVersion (the operator checks the cluster)."""
    default = chart_tools.template(kube_version=None)
    assert default == chart_tools.template()


def test_tokens_are_named_by_their_secrets_never_drawn_or_hashed(chart_tools: ChartTools) -> None:
    documents = chart_tools.documents("--values", str(RUN_VALUES))
    rendered = yaml.safe_dump_all(documents)
    assert "tokenHashSha256" not in rendered
    spec = by_kind(documents, "EdgeConfig")["edge"]["spec"]
    assert spec["edge"]["admin"] == {
        "listen": "0.0.0.0:9090",
        "tokenFile": "/etc/iop/admin/token",
        "tokenSecret": {"name": "edge-edge-admin", "key": "token", "generate": True},
    }
    for node in spec["nodes"]:
        assert node["tokenSecret"] == {
            "name": f"iop-node-{node['id']}",
            "key": "token",
            "generate": True,
        }
    for entry in spec["openai"]["principalTokens"]:
        assert entry["tokenSecret"] == {
            "name": "iop-api-keys",
            "key": entry["tokenRef"],
            "generate": True,
        }


def test_secrets_the_user_names_are_used_and_never_generated(chart_tools: ChartTools) -> None:
    values = {
        "edge": {"adminToken": {"existingSecret": "my-admin", "key": "bearer"}},
        "edgeConfig": {
            "spec": {
                "edge": {"id": "edge-a"},
                "openai": {
                    "principalTokens": [
                        {
                            "tokenRef": "app",
                            "principalRef": "team",
                            "tokenSecret": {"name": "my-keys", "key": "app"},
                        },
                        {"tokenRef": "hashed", "principalRef": "team", "tokenHashSha256": "a" * 64},
                    ]
                },
                "nodes": [{"id": "node-1", "tokenSecret": {"name": "my-node-1"}}],
            }
        },
        "nodes": [{"id": "node-1", "tokenSecret": {"name": "my-node-1"}}],
    }
    documents = chart_tools.documents(values=values)
    spec = next(iter(by_kind(documents, "EdgeConfig").values()))["spec"]
    mine = {"generate": False}
    assert spec["edge"]["admin"]["tokenSecret"] == {"name": "my-admin", "key": "bearer", **mine}
    app, hashed = spec["openai"]["principalTokens"]
    assert app["tokenSecret"] == {"name": "my-keys", "key": "app", **mine}
    assert hashed == {"tokenRef": "hashed", "principalRef": "team", "tokenHashSha256": "a" * 64}
    assert spec["nodes"][0]["tokenSecret"] == {"name": "my-node-1", "key": "token", **mine}
    edge = by_kind(documents, "Deployment")["iop-iop-edge-edge"]["spec"]["template"]["spec"]
    sources = edge["volumes"][0]["projected"]["sources"]
    assert sources[1]["secret"] == {
        "name": "my-admin",
        "items": [{"key": "bearer", "path": "admin/token"}],
    }
    node = by_kind(documents, "Deployment")["iop-iop-edge-node-node-1"]["spec"]["template"]
    token = next(v for v in node["spec"]["volumes"] if "secret" in v)
    assert token["secret"]["secretName"] == "my-node-1"
    # The operator may read exactly the Secrets the EdgeConfig and the workloads name.
    (role,) = by_kind(documents, "Role").values()
    (named,) = [r for r in role["rules"] if r["resources"] == ["secrets"] and "resourceNames" in r]
    assert set(named["resourceNames"]) == {
        "my-admin",
        "my-keys",
        "my-node-1",
        "iop-iop-edge-operator-webhook-tls",
        "iop-iop-edge-hub-tls",  # the hub's certificates: no Secret named, so the operator's
    }


def test_the_edgeconfig_from_values_is_a_valid_config_wired_to_the_chart(
    chart_tools: ChartTools,
) -> None:
    documents = chart_tools.documents("--values", str(RUN_VALUES))
    spec = by_kind(documents, "EdgeConfig")["edge"]["spec"]
    config = load_data(spec)  # what `iop config check` and the operator accept
    assert config.edge.listen == "0.0.0.0:7443"
    assert config.openai.listen == "0.0.0.0:8080"
    assert config.edge.admin.listen == "0.0.0.0:9090"
    assert config.edge.admin.token_file == "/etc/iop/admin/token"
    assert config.edge.metrics.listen == "0.0.0.0:9091"
    # The hub serves TLS by default, from the files the chart mounts.
    assert config.edge.tls is not None
    assert (config.edge.tls.cert_file, config.edge.tls.key_file) == (
        "/etc/iop/tls/tls.crt",
        "/etc/iop/tls/tls.key",
    )
    urls = {
        provider.id: provider.adapter.base_url
        for node in config.nodes
        for provider in node.providers
        if provider.adapter.type == "openai"
    }
    assert set(urls.values()) == {"http://iop-fake-upstream:8000/v1"}


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        pytest.param({}, "redis://iop-iop-edge-redis:6379", id="the-chart's-redis"),
        pytest.param(
            {"url": "rediss://cache.example:6380/2", "passwordEnv": "REDIS_PASSWORD"},
            "rediss://cache.example:6380/2",
            id="a-store-of-the-spec-wins",
        ),
    ],
)
def test_the_limit_store_option_runs_a_redis_for_the_edges(
    chart_tools: ChartTools, store: dict[str, Any], expected: str
) -> None:
    values: dict[str, Any] = {
        "limitStore": {"redis": {"enabled": True}},
        "edge": {"networkPolicy": {"enabled": True}},
    }
    if store:
        values["edgeConfig"] = {"spec": {"openai": {"limitStore": store}}}
    documents = chart_tools.documents(values=values)
    spec = by_kind(documents, "EdgeConfig")["iop-iop-edge"]["spec"]
    assert load_data(spec).openai.limit_store.url == expected
    redis = by_kind(documents, "Deployment")["iop-iop-edge-redis"]
    (container,) = _containers(redis)
    assert container["image"] == "docker.io/library/redis:7.2-alpine"
    assert "iop-iop-edge-redis" in by_kind(documents, "Service")
    policy = by_kind(documents, "NetworkPolicy")["iop-iop-edge-redis"]["spec"]
    (rule,) = policy["ingress"]
    edge = by_kind(documents, "Deployment")["iop-iop-edge-edge"]
    selector = rule["from"][0]["podSelector"]["matchLabels"]
    assert selector.items() <= edge["spec"]["template"]["metadata"]["labels"].items()


def test_the_make_run_values_describe_the_sample_config(chart_tools: ChartTools) -> None:
    # configs/helm-values.yaml is configs/edge.yaml in camelCase, but for the upstream URLs,
    # the listeners the chart wires and the tokens, which it names by their Secrets.
    original = load_data(yaml.safe_load((REPO / "configs" / "edge.yaml").read_text()))
    documents = chart_tools.documents("--values", str(RUN_VALUES))
    rendered = load_data(by_kind(documents, "EdgeConfig")["edge"]["spec"])
    assert [m.model_dump() for m in rendered.models] == [m.model_dump() for m in original.models]
    assert [(n.id, n.alias) for n in rendered.nodes] == [(n.id, n.alias) for n in original.nodes]
    for mine, theirs in zip(rendered.nodes, original.nodes, strict=True):
        for a, b in zip(mine.providers, theirs.providers, strict=True):
            assert a.model_dump(exclude={"adapter"}) == b.model_dump(exclude={"adapter"})
            assert a.adapter.type == b.adapter.type
    principals = [(t.token_ref, t.principal_ref) for t in rendered.openai.principal_tokens]
    assert principals == [(t.token_ref, t.principal_ref) for t in original.openai.principal_tokens]
    # Every node of the sample runs in the cluster.
    nodes = by_kind(documents, "Deployment")
    assert {f"iop-node-{n.id}" for n in original.nodes} <= set(nodes)


def test_the_chart_and_the_package_have_one_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    match = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert match is not None
    assert chart["appVersion"] == chart["version"] == match.group(1)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == "ghcr.io/iop-edge/iop-edge"
    assert values["image"]["tag"] == ""  # so the default is the appVersion


def test_the_image_defaults_to_the_app_version(chart_tools: ChartTools) -> None:
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    images = {
        container["image"]
        for document in chart_tools.documents(values=EVERYTHING)
        for container in _containers(document)
    }
    # Every pod runs the project's image, but the optional Redis of the limits (its own image).
    redis = yaml.safe_load((CHART / "values.yaml").read_text())["limitStore"]["redis"]["image"]
    assert images == {
        f"ghcr.io/iop-edge/iop-edge:{version}",
        f"{redis['repository']}:{redis['tag']}",
    }


def by_kind(documents: Sequence[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def _containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    if document["kind"] == "Deployment":
        return list(document["spec"]["template"]["spec"]["containers"])
    if document["kind"] == "Pod":
        return list(document["spec"]["containers"])
    return []
