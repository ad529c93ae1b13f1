"""The chart's monitoring wiring: the Edge serves /metrics only on its own listener, reached
through a ClusterIP Service of its own (never the public OpenAI Service), scraped by annotations
or the ServiceMonitor, admitted by the NetworkPolicy only from the configured scrapers; and the
Grafana dashboard queries only metrics the Edge exports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from iop.edgeconfig.loading import load_data

if TYPE_CHECKING:
    from tests.chart.conftest import ChartTools

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "iop-edge"
DASHBOARD = CHART / "files" / "dashboards" / "iop-edge.json"
MONITORED = {"metrics": {"serviceMonitor": {"enabled": True}}}


def by_kind(documents: Sequence[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


@pytest.mark.parametrize(
    ("ports", "port"),
    [pytest.param({}, 9091, id="default"), pytest.param({"metrics": 9200}, 9200, id="9200")],
)
def test_metrics_have_a_listener_port_and_service_of_their_own(
    chart_tools: ChartTools, ports: dict[str, int], port: int
) -> None:
    documents = chart_tools.documents(values={**MONITORED, "edge": {"ports": ports}})

    spec = by_kind(documents, "EdgeConfig")["iop-iop-edge"]["spec"]
    assert load_data(spec).edge.metrics.listen == f"0.0.0.0:{port}"

    deployment = by_kind(documents, "Deployment")["iop-iop-edge-edge"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }

    services = by_kind(documents, "Service")
    metrics = services["iop-iop-edge-metrics"]
    assert metrics["spec"]["type"] == "ClusterIP"
    assert metrics["spec"]["ports"] == [
        {"name": "metrics", "port": port, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert metrics["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # The public Service carries the OpenAI API and nothing else.
    assert [p["targetPort"] for p in services["iop-iop-edge-openai"]["spec"]["ports"]] == ["http"]

    # Each ServiceMonitor selects one metrics Service, and only it, on its metrics port: the
    # Edge's and the operator's.
    monitors = by_kind(documents, "ServiceMonitor")
    for monitor_name, service_name in (
        ("iop-iop-edge-edge", "iop-iop-edge-metrics"),
        ("iop-iop-edge-operator", "iop-iop-edge-operator-metrics"),
    ):
        monitor = monitors[monitor_name]
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = [
            name
            for name, service in services.items()
            if selector.items() <= service["metadata"]["labels"].items()
        ]
        assert selected == [service_name]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "metrics"
        assert endpoint["path"] == "/metrics"


def test_a_load_balancer_never_carries_the_metrics(chart_tools: ChartTools) -> None:
    documents = chart_tools.documents(values={"edge": {"service": {"type": "LoadBalancer"}}})
    services = by_kind(documents, "Service")
    exposed = [
        s for s in services.values() if s["spec"].get("type") in ("LoadBalancer", "NodePort")
    ]
    assert [s["metadata"]["name"] for s in exposed] == ["iop-iop-edge-openai"]
    assert all(p["targetPort"] != "metrics" for s in exposed for p in s["spec"]["ports"])
    assert services["iop-iop-edge-metrics"]["spec"]["type"] == "ClusterIP"


def policy_rules(documents: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    policy = by_kind(documents, "NetworkPolicy")["iop-iop-edge-edge"]  # the Edge's
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules: list[dict[str, Any]] = policy["spec"]["ingress"]
    # A rule without ports would admit its peers to every port, the metrics one included.
    assert all(rule.get("ports") for rule in rules)
    return rules


def rules_for(rules: list[dict[str, Any]], port: str) -> list[dict[str, Any]]:
    return [rule for rule in rules if {"port": port, "protocol": "TCP"} in rule["ports"]]


MONITORING_NS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


@pytest.mark.parametrize(
    ("metrics_from", "admitted"),
    [
        pytest.param(None, [{"namespaceSelector": {}}], id="default-every-pod-in-the-cluster"),
        pytest.param([MONITORING_NS], [MONITORING_NS], id="only-prometheus"),
        pytest.param([], None, id="empty-nobody"),
    ],
)
def test_the_network_policy_admits_the_metrics_port_only_from_metrics_from(
    chart_tools: ChartTools,
    metrics_from: list[dict[str, Any]] | None,
    admitted: list[dict[str, Any]] | None,
) -> None:
    values = None
    if metrics_from is not None:
        values = {"edge": {"networkPolicy": {"metricsFrom": metrics_from}}}
    rules = policy_rules(chart_tools.documents(values=values))
    metrics = rules_for(rules, "metrics")
    if admitted is None:
        assert metrics == []  # no rule names the port: the policy admits nobody to it
    else:
        assert metrics == [{"ports": [{"port": "metrics", "protocol": "TCP"}], "from": admitted}]
    # The other ports keep their rules; none of them opens the metrics port.
    assert len(rules_for(rules, "http")) == len(rules_for(rules, "hub")) == 1
    assert len(rules_for(rules, "admin")) == 1


# -- the dashboard's queries ---------------------------------------------------------------------

#: PromQL words that look like names but are none: operators and modifiers.
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "start", "end"})


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects.

    `{__name__="x"}` names `x`. Strings, label matchers (`{...}`), ranges (`[...]`) and grouping
    clauses (`by (...)`, `on (...)`, ...) are removed first, so labels and their values never
    count; a name followed by `(` is a function or an aggregation; Grafana's `$variables` are
    skipped.
    """
    names = set(re.findall(r'__name__\s*=\s*"([^"]+)"', expr))
    expr = re.sub(r'"(?:\\.|[^"\\])*"' + r"|'(?:\\.|[^'\\])*'", '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\b(?:group_left|group_right)\b", " ", expr)
    for match in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("("):
            continue
        if match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panel targets, nested rows, template
    variables (`label_values(METRIC, LABEL)` is Grafana's; its first argument is PromQL)."""

    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                yield node["expr"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    yield from walk(dashboard.get("panels", []))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        function = re.fullmatch(r"\s*label_values\((?:(.+),)?\s*\w+\s*\)\s*", text)
        if function is not None:
            if function.group(1):
                yield function.group(1)
        else:
            yield re.sub(r"^\s*query_result\((.*)\)\s*$", r"\1", text)


def exported_metric_names() -> set[str]:
    """Every sample name the Edge's and the operator's registries expose, from each family's
    type (a counter `x` is scraped as `x_total`, a histogram as `x_bucket`, `x_count`, `x_sum`),
    so a family counts before anything was observed. The limiter registers its own on the
    Edge's registry, and so do the revisions (`RolloutCollector`), as `EdgeServer` does."""
    from iop.edge.limits.limiter import Limiter
    from iop.edge.pool.dispatching import Dispatcher
    from iop.edge.pool.metering import Metrics
    from iop.edge.pool.snapshots import PoolSnapshot
    from iop.edge.refresh import Refresher, RolloutCollector
    from iop.operator.metrics import OperatorMetrics

    config = load_data(yaml.safe_load((REPO / "configs" / "edge.yaml").read_text()))
    dispatcher = Dispatcher(PoolSnapshot.build(config))
    metrics = Metrics(dispatcher)
    Limiter(dispatcher, config, registry=metrics.registry)
    rollouts = Refresher(dispatcher, outcomes=metrics.outcomes).rollouts
    metrics.registry.register(RolloutCollector(rollouts))
    registries = [metrics.registry, OperatorMetrics().registry]
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
    }
    names = set()
    for family in (f for registry in registries for f in registry.collect()):
        assert family.type in suffixes, f"{family.name}: a {family.type} (add its sample names)"
        names |= {family.name + suffix for suffix in suffixes[family.type]}
    return names


def test_the_promql_parser_finds_metric_names_and_nothing_else() -> None:
    # Proof that the dashboard check below can fail: names in every position PromQL allows.
    expr = (
        'sum by (le, model) (rate(iop_edge_x_bucket{status=~"[45]..",pod!="a b"}[$__rate_interval]'
        " offset 5m)) / on (pod) group_left (node) max without (job) (up == bool 1)"
        ' or iop_edge_y > 0.5e3 unless {__name__="w", job=~".+"} and histogram_quantile(0.95, z)'
    )
    assert promql_metric_names(expr) == {"iop_edge_x_bucket", "up", "iop_edge_y", "w", "z"}
    dashboard = {
        "panels": [{"type": "row", "panels": [{"targets": [{"expr": "rate(a_total[5m])"}]}]}],
        "templating": {
            "list": [
                {"type": "query", "query": {"query": "label_values(b_info, namespace)"}},
                {"type": "query", "query": "label_values(namespace)"},
                {"type": "custom", "query": "x,y"},
            ]
        },
    }
    assert set(dashboard_queries(dashboard)) == {"rate(a_total[5m])", "b_info"}


def test_the_dashboard_queries_only_metrics_the_edge_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for expr in dashboard_queries(dashboard) for name in promql_metric_names(expr)}
    assert queried, "the dashboard queries no metric"
    unknown = queried - exported_metric_names()
    assert not unknown, f"the dashboard queries metrics nothing exports: {sorted(unknown)}"
    for needed in (
        "iop_edge_requests_total",
        "iop_edge_request_duration_seconds_bucket",
        "iop_edge_time_to_first_token_seconds_bucket",
        "iop_edge_queue_depth",
        "iop_edge_queue_wait_seconds_bucket",
        "iop_edge_in_flight",
        "iop_edge_completion_tokens_total",
        "iop_edge_refreshes_total",
        "iop_edge_config_generation",
        "iop_operator_reconcile_total",
        "iop_operator_seconds_since_last_success",
        "iop_operator_leader",
        "iop_edge_limited_requests_total",
        "iop_edge_limit_budget_remaining_tokens",
        "iop_edge_revision",
        "iop_edge_revisions_ended_total",
    ):
        assert needed in queried, f"the dashboard has no panel on {needed}"


def test_docs_list_every_metric_the_edge_exports() -> None:
    # docs/edge.md and docs/operator.md are where the dashboard's reader looks a name up.
    documented = {
        name
        for doc in ("edge.md", "operator.md")
        for name in re.findall(r"`(iop_(?:edge|operator)_\w+)", (REPO / "docs" / doc).read_text())
    }
    families = {
        re.sub(r"_(total|bucket)$", "", name)
        for name in exported_metric_names()
        if not name.endswith(("_created", "_count", "_sum"))
    }
    undocumented = {
        family
        for family in families
        if family not in documented and f"{family}_total" not in documented
    }
    assert not undocumented, f"docs/edge.md does not list {sorted(undocumented)}"


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def test_tracing_is_off_by_default_and_sets_the_sdks_variables_on_edge_and_nodes(
    chart_tools: ChartTools,
) -> None:
    deployments = by_kind(chart_tools.documents(), "Deployment")
    for name in ("iop-iop-edge-edge", "iop-iop-edge-node-node-1"):
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        assert not [key for key in env_of(container) if key.startswith("OTEL_")]

    tracing = {"enabled": True, "endpoint": "http://collector.obs:4317", "samplerArg": "0.1"}
    deployments = by_kind(chart_tools.documents(values={"tracing": tracing}), "Deployment")
    for name, service in (
        ("iop-iop-edge-edge", "iop-edge"),
        ("iop-iop-edge-node-node-1", "iop-node"),
    ):
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        env = env_of(container)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.obs:4317"
        assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "true"
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
        assert env["OTEL_SERVICE_NAME"] == service


def test_the_values_schema_refuses_a_sampler_argument_out_of_range(chart_tools: ChartTools) -> None:
    with pytest.raises(AssertionError, match="samplerArg"):
        chart_tools.documents(values={"tracing": {"enabled": True, "samplerArg": "2"}})


def test_tracing_goes_to_the_charts_fake_collector_when_no_endpoint_is_named(
    chart_tools: ChartTools,
) -> None:
    values = {"tracing": {"enabled": True}, "fakeCollector": {"enabled": True}}
    documents = chart_tools.documents(values=values)
    (container,) = by_kind(documents, "Deployment")["iop-iop-edge-edge"]["spec"]["template"][
        "spec"
    ]["containers"]
    assert env_of(container)["OTEL_EXPORTER_OTLP_ENDPOINT"] == (
        "http://iop-iop-edge-fake-collector:4317"
    )
    service = by_kind(documents, "Service")["iop-iop-edge-fake-collector"]
    assert [port["port"] for port in service["spec"]["ports"]] == [4317, 4320]
    with pytest.raises(AssertionError, match=r"tracing\.endpoint"):
        chart_tools.documents(values={"tracing": {"enabled": True}})
