"""The chart's metrics objects (the operator's metrics port and Service, the ServiceMonitor, the dashboard)."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any

import pytest

chart_test = runpy.run_path(str(Path(__file__).with_name("test_pkg_chart.py")))
render, by_kind, operator_container = (
    chart_test["render"],
    chart_test["by_kind"],
    chart_test["operator_container"],
)
helm, CHART, NAMESPACE, RELEASE = (
    chart_test["helm"],
    chart_test["CHART"],
    chart_test["NAMESPACE"],
    chart_test["RELEASE"],
)

DASHBOARD = CHART / "dashboards" / "kelastic.json"


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def test_operator_serves_metrics_behind_a_service_by_default() -> None:
    from kelastic.operator.cli import build_parser

    objects = render()
    container = operator_container(objects)
    args = build_parser().parse_args(container["args"])
    assert args.metrics_port == 9090 and args.metrics_address == "$(POD_IP)"
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    service = named(objects, "Service", f"{RELEASE}-kelastic-metrics")
    (deployment,) = by_kind(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert not by_kind(objects, "ServiceMonitor") and not by_kind(objects, "ConfigMap")


def test_metrics_can_be_turned_off() -> None:
    objects = render({"metrics": {"enabled": False}})
    assert not any(a.startswith("--metrics") for a in operator_container(objects)["args"])
    assert not [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-metrics")]


def test_service_monitor_selects_the_metrics_service() -> None:
    objects = render({"metrics": {"serviceMonitor": True, "serviceMonitorLabels": {"release": "prom"}}})
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    service = named(objects, "Service", f"{RELEASE}-kelastic-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # the operator's own Service (none today) or any other must not match: the label is the metrics one
    assert monitor["spec"]["selector"]["matchLabels"]["kelastic.dev/metrics"] == "operator"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]


def test_lint_is_clean_with_every_metrics_object() -> None:
    values = {"metrics": {"serviceMonitor": True, "grafanaDashboard": True}}
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


def _series_served() -> set[str]:
    """Every series name the operator and the agent serve (histograms by their base name)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kelastic.agent.telemetry import AgentTelemetry
    from kelastic.operator.metrics import OperatorMetrics

    names: set[str] = set()
    for family in text_string_to_metric_families(AgentTelemetry().render()):
        # gauges without a value yet (no progress reported) have no sample: take the family's name
        names |= {s.name for s in family.samples} | {family.name}
    m = OperatorMetrics()
    m.job_observed(
        ("ns", "j"),
        "Running",
        world_size=1,
        restarts=0,
        standbys=1,
        goodput={"ratio": 0.9, "elapsedSeconds": 10.0, "restartSeconds": 1.0, "saveStallSeconds": 0.0},
    )
    m.action_applied("RecreateWorker")
    m.api_error(500)
    for family in m.registry.collect():
        names |= {s.name for s in family.samples}
    return names


def test_dashboard_shows_jobs_world_size_restarts_and_recovery_from_served_series() -> None:
    objects = render({"metrics": {"grafanaDashboard": True}})
    (config_map,) = by_kind(objects, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["kelastic.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("jobs", "world size", "restarts", "recovery", "goodput", "standbys"):
        assert topic in titles
    used = {m for e in exprs for m in re.findall(r"\b(kelastic_[a-z_]+)", e)}
    missing = used - _series_served()
    assert not missing, f"the dashboard queries series nobody serves: {sorted(missing)}"
    assert {"kelastic_jobs", "kelastic_job_world_size", "kelastic_job_restarts"} <= used
    assert "kelastic_recovery_seconds_bucket" in used
    assert {"kelastic_job_goodput_ratio", "kelastic_job_goodput_seconds", "kelastic_job_standbys"} <= used


@pytest.mark.parametrize("value", [True, False])
def test_dashboard_config_map_follows_its_value(value: bool) -> None:
    assert len(by_kind(render({"metrics": {"grafanaDashboard": value}}), "ConfigMap")) == int(value)
