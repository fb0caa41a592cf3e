"""The Helm chart, rendered and linted by the real Helm library (helm-python-sdk).

Renders run offline: no cluster is contacted. The e2e suite applies the same
rendered manifests to a cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk is a dev dependency: pip install -e '.[dev]'"
)

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kelastic"
CRD = REPO / "crds" / "elasticjob.yaml"
RELEASE = "kel"
NAMESPACE = "kelastic-system"


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart's templates produce for ``values``, in template order."""
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[dict[str, Any]] = []
    for path in sorted(manifests):
        if not path.endswith((".yaml", ".yml")):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(manifests[path]) if doc)
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_lint_is_clean_for_default_and_cluster_wide_values() -> None:
    for values in ({}, {"clusterWide": True}, {"watchNamespaces": ["team-a", "team-b"]}):
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert report["errors"] == [] and problems == [], (values, report)


#: The Roles of the release namespace that serve the operator itself, not the jobs it manages.
OWN_ROLE_SUFFIXES = ("-leader-election", "-namespace", "-key")


def operator_roles(objects: list[dict[str, Any]], kind: str = "Role") -> list[dict[str, Any]]:
    return [o for o in by_kind(objects, kind) if not o["metadata"]["name"].endswith(OWN_ROLE_SUFFIXES)]


def assert_least_privilege(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        # The operator never changes RBAC and never execs into pods.
        assert not {"roles", "rolebindings", "clusterroles", "pods/exec"} & set(rule["resources"])
        # It creates each job's Secret and never reads, lists, watches or changes one.
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["create"] and rule["resources"] == ["secrets"]


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) the rules allow."""
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


#: Exactly what the operator calls on the objects it manages (kopf's list+watch included).
#: A rule missing here is a 403 on a real cluster; an extra one is more power than needed.
OPERATOR_RULES = {
    *{("kelastic.dev", "elasticjobs", v) for v in ("get", "list", "watch", "delete")},
    ("kelastic.dev", "elasticjobs/status", "patch"),
    # blockOwnerDeletion on the pods' ownerReference needs this (OwnerReferencesPermissionEnforcement).
    ("kelastic.dev", "elasticjobs/finalizers", "update"),
    *{("", r, v) for r in ("pods", "services") for v in ("list", "watch", "create", "delete")},
    ("", "pods/log", "get"),
    # each job's Secret (its agents' key), created before its first worker pod
    ("", "secrets", "create"),
    ("", "events", "create"),
    ("", "events", "patch"),
    # gang scheduling: each job's PodGroup (Volcano, scheduler-plugins, kube-scheduler)
    *{
        (g, "podgroups", v)
        for g in ("scheduling.volcano.sh", "scheduling.x-k8s.io", "scheduling.k8s.io")
        for v in ("create", "patch")
    },
    # the store's NetworkPolicy of each job (networkPolicy.enabled, default true)
    ("networking.k8s.io", "networkpolicies", "create"),
    ("networking.k8s.io", "networkpolicies", "patch"),
}


def test_default_render_is_namespaced_least_privilege() -> None:
    objects = render()
    kinds = sorted(o["kind"] for o in objects)
    # the Service exposes the operator's /metrics (metrics.enabled, default true); a Role and its
    # binding let the operator read its own Namespace and a NetworkPolicy guards its pod
    # (networkPolicy.enabled, default true); another, its master key; a ClusterRole and its
    # binding let it read Nodes (rbac.readNodes, default true)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "NetworkPolicy",
        *["Role"] * 4,
        *["RoleBinding"] * 4,
        "Service",
        "ServiceAccount",
    ]
    (role,) = operator_roles(objects)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert_least_privilege(role["rules"])
    assert granted(role["rules"]) == OPERATOR_RULES
    (sa,) = by_kind(objects, "ServiceAccount")
    for binding in by_kind(objects, "RoleBinding"):
        assert (
            binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] == binding["metadata"]["name"]
        )
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
        ]
    assert f"--namespace={NAMESPACE}" in operator_container(objects)["args"]


def test_chart_requires_kubernetes_1_30() -> None:
    """The oldest API server kelastic supports is v1.30, the first to enforce the CRD's rules
    (``optionalOldSelf`` is the newest field they use)."""
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        assert chart.metadata["kubeVersion"] == ">=1.30.0-0"


def test_leader_election_may_touch_only_its_own_lease() -> None:
    for values in ({}, {"clusterWide": True}, {"watchNamespaces": ["team-a"]}):
        objects = render(values)
        (election,) = [
            r for r in by_kind(objects, "Role") if r["metadata"]["name"].endswith("-leader-election")
        ]
        assert election["metadata"]["namespace"] == NAMESPACE
        lease_name = f"{RELEASE}-kelastic"
        assert election["rules"] == [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [lease_name],
                "verbs": ["get", "update"],
            },
        ]
        args = operator_container(objects)["args"]
        assert f"--lease-name={lease_name}" in args and f"--lease-namespace={NAMESPACE}" in args


def test_watch_namespaces_get_one_role_each_bound_to_the_release_service_account() -> None:
    objects = render({"watchNamespaces": ["team-a", "team-b"]})
    assert sorted(r["metadata"]["namespace"] for r in operator_roles(objects)) == ["team-a", "team-b"]
    bindings = operator_roles(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["subjects"][0]["namespace"] == NAMESPACE for b in bindings)
    args = operator_container(objects)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


def test_cluster_wide_render_uses_a_cluster_role_and_watches_all_namespaces() -> None:
    objects = render({"clusterWide": True})
    assert operator_roles(objects) == [] and operator_roles(objects, "RoleBinding") == []
    (role,) = [r for r in by_kind(objects, "ClusterRole") if not r["metadata"]["name"].endswith("-nodes")]
    assert_least_privilege(role["rules"])
    (binding,) = [
        b for b in by_kind(objects, "ClusterRoleBinding") if not b["metadata"]["name"].endswith("-nodes")
    ]
    assert "namespace" not in role["metadata"]
    assert (
        binding["roleRef"]["kind"] == "ClusterRole" and binding["roleRef"]["name"] == role["metadata"]["name"]
    )
    # Cluster-wide the operator also follows the CRD (kopf's resource scanning); it never
    # lists namespaces, as it watches all of them at once.
    assert granted(role["rules"]) == OPERATOR_RULES | {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
    args = operator_container(objects)["args"]
    assert "--all-namespaces" in args and not any(a.startswith("--namespace") for a in args)


def test_operator_deployment_runs_non_root_with_probes_resources_and_values() -> None:
    objects = render(
        {
            "image": {"repository": "registry.example/kelastic", "tag": "1.2.3"},
            "operator": {"logLevel": "debug"},
        }
    )
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    container = operator_container(objects)
    assert container["image"] == "registry.example/kelastic:1.2.3"
    assert container["command"] == ["kelastic-operator"]
    assert "--log-level=debug" in container["args"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
        assert container[probe]["httpGet"]["port"] == "health"
    assert container["ports"][0]["containerPort"] == 8080
    assert "--liveness=http://$(POD_IP):8080/healthz" in container["args"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["serviceAccountName"] == by_kind(objects, "ServiceAccount")[0]["metadata"]["name"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_default_image_tag_is_the_app_version() -> None:
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        app_version = chart.metadata["appVersion"]
    assert operator_container(render())["image"] == f"kelastic:{app_version}"


def test_existing_service_account_must_be_named() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"serviceAccount\.name is required"):
        render({"serviceAccount": {"create": False}})
    objects = render({"serviceAccount": {"create": False, "name": "ops"}})
    assert by_kind(objects, "ServiceAccount") == []
    assert {b["subjects"][0]["name"] for b in by_kind(objects, "RoleBinding")} == {"ops"}


def test_chart_crd_is_the_repository_crd() -> None:
    """One source of truth: the chart ships crds/elasticjob.yaml itself (a symlink that Helm follows)."""
    link = CHART / "crds" / "elasticjob.yaml"
    assert link.is_symlink() and link.resolve() == CRD.resolve(), (
        "helm/kelastic/crds/elasticjob.yaml must link to crds/elasticjob.yaml"
    )
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        shipped = chart.crds
    assert [c["name"] for c in shipped] == ["crds/elasticjob.yaml"]
    assert shipped[0]["data"] == CRD.read_text()
    (crd,) = [d for d in yaml.safe_load_all(shipped[0]["data"]) if d]
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "kelastic.dev"


def test_packaged_chart_carries_the_crd_contents(tmp_path: Path) -> None:
    helm.disable_logging()
    archive = helm.package(CHART, destination=tmp_path)
    with helm.Chart.load(archive) as chart:
        assert chart.crds[0]["data"] == CRD.read_text()


def test_notes_name_the_watched_namespaces() -> None:
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        notes = chart.render({"watchNamespaces": ["team-a"]}, name=RELEASE, namespace=NAMESPACE)[
            "kelastic/templates/NOTES.txt"
        ]
    assert "- team-a" in notes and f"deployment/{RELEASE}-kelastic" in notes
    assert "kubectl -n team-a apply -f examples/elasticjob.yaml" in notes


def test_notes_say_that_other_namespaces_are_not_served_and_how_to_serve_them() -> None:
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        namespaced = chart.render(
            {"watchNamespaces": ["team-a", "team-b"]}, name=RELEASE, namespace=NAMESPACE
        )
        cluster_wide = chart.render({"clusterWide": True}, name=RELEASE, namespace=NAMESPACE)
    notes = namespaced["kelastic/templates/NOTES.txt"]
    assert "any other namespace are NOT served" in notes
    assert f"helm upgrade {RELEASE} <chart> -n {NAMESPACE} --reuse-values" in notes
    assert "--set 'watchNamespaces={team-a,team-b,NEW}'" in notes and "clusterWide=true" in notes
    assert "NOT served" not in cluster_wide["kelastic/templates/NOTES.txt"]


def test_operator_cli_accepts_the_rendered_arguments() -> None:
    """The Deployment's args are kelastic-operator's flags, with the watched namespaces."""
    from kelastic.operator.cli import build_parser

    cases = [
        ({}, [NAMESPACE], False),
        ({"watchNamespaces": ["a", "b"]}, ["a", "b"], False),
        ({"clusterWide": True}, [], True),
    ]
    for values, namespaces, cluster_wide in cases:
        container = operator_container(render({**values, "operator": {"logLevel": "warning"}}))
        assert container["command"] == ["kelastic-operator"]
        parsed = build_parser().parse_args(container["args"])
        assert parsed.namespace == namespaces and parsed.all_namespaces is cluster_wide
        assert parsed.log_level == "warning" and parsed.liveness == "http://$(POD_IP):8080/healthz"
        assert parsed.lease_namespace == NAMESPACE and not parsed.standalone


def test_kueue_enabled_grants_exactly_what_the_queue_needs() -> None:
    """kueue.enabled: the operator runs with --kueue, may manage Workloads in the namespaces it
    serves, and reads (only) WorkloadPriorityClasses and ResourceFlavors cluster-wide."""
    objects = render({"kueue": {"enabled": True}})
    assert "--kueue" in operator_container(objects)["args"]
    (role,) = operator_roles(objects)
    assert_least_privilege(role["rules"])
    workloads = {("kueue.x-k8s.io", "workloads", v) for v in ("list", "watch", "create", "delete")}
    assert granted(role["rules"]) == OPERATOR_RULES | workloads | {
        ("kueue.x-k8s.io", "workloads/status", "patch")
    }
    (reader,) = [r for r in by_kind(objects, "ClusterRole") if r["metadata"]["name"].endswith("-kueue")]
    assert granted(reader["rules"]) == {
        ("kueue.x-k8s.io", "workloadpriorityclasses", "get"),
        ("kueue.x-k8s.io", "resourceflavors", "get"),
    }
    assert "--kueue" not in operator_container(render())["args"]


def test_the_operator_reads_nodes_and_nothing_else_cluster_wide_unless_told_not_to() -> None:
    """rbac.readNodes (default): in every mode a ClusterRole grants get on nodes, bound to the
    operator's ServiceAccount (it force-deletes a pod evicted from a lost node only after
    reading that the node is NotReady); off, no such role. The operator's pods tolerate a
    lost node for operator.nodeLossToleration seconds."""
    for values in ({}, {"watchNamespaces": ["team-a"]}, {"clusterWide": True}):
        objects = render(values)
        (reader,) = [r for r in by_kind(objects, "ClusterRole") if r["metadata"]["name"].endswith("-nodes")]
        assert granted(reader["rules"]) == {("", "nodes", "get")}
        (binding,) = [
            b
            for b in by_kind(objects, "ClusterRoleBinding")
            if b["roleRef"]["name"] == reader["metadata"]["name"]
        ]
        (sa,) = by_kind(objects, "ServiceAccount")
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
        ]
        assert "--node-loss-toleration=5" in operator_container(objects)["args"]
    objects = render({"rbac": {"readNodes": False}, "operator": {"nodeLossToleration": 30}})
    assert not [r for r in by_kind(objects, "ClusterRole") if r["metadata"]["name"].endswith("-nodes")]
    assert "--node-loss-toleration=30" in operator_container(objects)["args"]
