"""What the chart sets up for a job's security: the NetworkPolicies' settings (on by default, the operator
admitted by its namespace and pod labels), the permissions they and the job's Secret need, external
stores (refused unless allowed), and the switches that turn them off or widen them. Rendered and linted
with the real Helm library."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

chart_test = runpy.run_path(str(Path(__file__).with_name("test_pkg_chart.py")))
render, by_kind, operator_container, operator_roles, granted = (
    chart_test["render"],
    chart_test["by_kind"],
    chart_test["operator_container"],
    chart_test["operator_roles"],
    chart_test["granted"],
)
helm, CHART, NAMESPACE = chart_test["helm"], chart_test["CHART"], chart_test["NAMESPACE"]
PROMETHEUS = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def operator_args(objects: list[dict[str, Any]]) -> Any:
    from kelastic.operator.cli import build_parser

    return build_parser().parse_args(operator_container(objects)["args"])


def own_namespace_role(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in by_kind(objects, "Role") if o["metadata"]["name"].endswith("-namespace")]


def test_network_policies_are_on_by_default_and_admit_the_charts_own_operator_pods() -> None:
    from kelastic.operator.netpol import NetworkPolicyConfig, operator_peer, parse_labels

    objects = render()
    args = operator_args(objects)
    assert args.network_policy and args.operator_namespace == NAMESPACE
    (deployment,) = by_kind(objects, "Deployment")
    labels = parse_labels(args.operator_pod_labels)
    # exactly the selector labels of the operator's pods, which its pod template carries
    assert labels == deployment["spec"]["selector"]["matchLabels"]
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert deployment["metadata"]["namespace"] == NAMESPACE
    peer = operator_peer(NetworkPolicyConfig(True, labels, args.operator_namespace))
    assert peer == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
        "podSelector": {"matchLabels": labels},
    }
    assert args.network_policy_metrics_from == ""


def test_the_operator_may_create_policies_and_secrets_and_read_only_its_own_namespace() -> None:
    for values in ({}, {"watchNamespaces": ["team-a", "team-b"]}, {"clusterWide": True}):
        objects = render(values)
        roles = operator_roles(objects) or [
            r for r in by_kind(objects, "ClusterRole") if not r["metadata"]["name"].endswith("-nodes")
        ]
        for role in roles:
            rules = granted(role["rules"])
            assert {("networking.k8s.io", "networkpolicies", v) for v in ("create", "patch")} <= rules
            assert {r for r in rules if r[1] == "secrets"} == {("", "secrets", "create")}
            assert not [r for r in rules if r[1] == "namespaces"]
        (own,) = own_namespace_role(objects)
        assert own["metadata"]["namespace"] == NAMESPACE
        assert own["rules"] == [
            {"apiGroups": [""], "resources": ["namespaces"], "resourceNames": [NAMESPACE], "verbs": ["get"]}
        ]
        (binding,) = [
            b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"] == own["metadata"]["name"]
        ]
        (sa,) = by_kind(objects, "ServiceAccount")
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": own["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
        ]


def test_the_operator_reads_one_secret_its_master_key_in_its_own_namespace() -> None:
    for values in (
        {},
        {"watchNamespaces": ["team-a"]},
        {"clusterWide": True},
        {"networkPolicy": {"enabled": False}},
    ):
        objects = render(values)
        args = operator_args(objects)
        (key,) = [o for o in by_kind(objects, "Role") if o["metadata"]["name"].endswith("-key")]
        assert key["metadata"]["namespace"] == NAMESPACE and args.lease_namespace == NAMESPACE
        assert key["rules"] == [
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": [args.key_secret],
                "verbs": ["get"],
            },
        ]
        (binding,) = [
            b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"] == key["metadata"]["name"]
        ]
        (sa,) = by_kind(objects, "ServiceAccount")
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
        ]
        # Nothing else may read a Secret: every other rule on secrets is a create.
        for role in [*by_kind(objects, "Role"), *by_kind(objects, "ClusterRole")]:
            if role is not key:
                assert {r for r in granted(role["rules"]) if r[1] == "secrets"} <= {("", "secrets", "create")}


def test_network_policies_can_be_turned_off_with_their_permissions() -> None:
    objects = render({"networkPolicy": {"enabled": False}})
    args = operator_args(objects)
    assert not args.network_policy and "--no-network-policy" in operator_container(objects)["args"]
    rules = granted(operator_roles(objects)[0]["rules"])
    assert not [r for r in rules if r[1] == "networkpolicies"]
    assert own_namespace_role(objects) == []
    assert ("", "secrets", "create") in rules  # the job's secret does not depend on the policies


def test_metrics_scrapers_are_passed_to_the_operator_as_peers() -> None:
    from kelastic.operator.netpol import parse_peers

    objects = render({"networkPolicy": {"metricsFrom": PROMETHEUS}})
    assert parse_peers(operator_args(objects).network_policy_metrics_from) == tuple(PROMETHEUS)


def test_external_stores_are_refused_unless_the_chart_allows_them() -> None:
    assert not operator_args(render()).allow_external_stores
    assert operator_args(render({"operator": {"allowExternalStores": True}})).allow_external_stores


@pytest.mark.parametrize(
    "values",
    [
        {"networkPolicy": {"enabled": False}},
        {"networkPolicy": {"metricsFrom": PROMETHEUS}},
        {"operator": {"allowExternalStores": True}},
    ],
)
def test_lint_is_clean_with_the_security_values(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], (values, report)


def operator_policy(objects: list[dict[str, Any]]) -> dict[str, Any] | None:
    policies = by_kind(objects, "NetworkPolicy")
    assert len(policies) <= 1, policies
    return policies[0] if policies else None


def admitted(policy: dict[str, Any], port: int, source_ns_labels: dict[str, str]) -> bool:
    """Whether ``policy`` admits a pod (no labels) of a namespace with ``source_ns_labels`` on ``port``."""
    for rule in policy["spec"]["ingress"]:
        if not any(p["port"] == port and p["protocol"] == "TCP" for p in rule.get("ports", [])):
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            want = peer.get("namespaceSelector", {}).get("matchLabels")
            if want is not None and want.items() <= source_ns_labels.items() and "podSelector" not in peer:
                return True
    return False


def test_the_operator_pod_has_a_policy_health_from_anywhere_metrics_only_from_metrics_from() -> None:
    objects = render()
    policy = operator_policy(objects)
    assert policy is not None and policy["metadata"]["namespace"] == NAMESPACE
    (deployment,) = by_kind(objects, "Deployment")
    assert policy["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    anyone = {"kubernetes.io/metadata.name": "team-a"}
    assert admitted(policy, 8080, anyone) and admitted(policy, 8080, monitoring)
    assert not admitted(policy, 9090, monitoring) and not admitted(policy, 9090, anyone)
    scraped = operator_policy(render({"metrics": {"from": PROMETHEUS}}))
    assert scraped is not None
    assert admitted(scraped, 9090, monitoring) and not admitted(scraped, 9090, anyone)
    assert admitted(scraped, 8080, anyone)
    moved = operator_policy(
        render({"operator": {"healthPort": 8181}, "metrics": {"port": 9191, "from": PROMETHEUS}})
    )
    assert moved is not None and admitted(moved, 8181, anyone) and admitted(moved, 9191, monitoring)
    assert operator_policy(render({"networkPolicy": {"enabled": False}})) is None


def test_lint_is_clean_with_metrics_scrapers_of_the_operator() -> None:
    report = helm.lint(CHART, {"metrics": {"from": PROMETHEUS}}, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report
