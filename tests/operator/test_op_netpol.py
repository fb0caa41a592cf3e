"""The jobs' NetworkPolicies: the objects, what they admit (judged by the rules a CNI applies), when the
reconcile asks for them, the operator's namespace check, and how the API server stores them."""

from __future__ import annotations

import asyncio
import runpy
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent import contract
from kelastic.operator.builders import BuildConfig, store_pod, worker_pod
from kelastic.operator.executor import ActionExecutor
from kelastic.operator.jobcache import JobCache
from kelastic.operator.kube import Kube
from kelastic.operator.metrics import OperatorMetrics
from kelastic.operator.netpol import (
    NAMESPACE_NAME_LABEL,
    NetworkPolicyConfig,
    namespace_check,
    network_policy_path,
    operator_peer,
    parse_labels,
    parse_peers,
    store_network_policy,
    workers_network_policy,
)
from kelastic.operator.reconcile import EnsureObject, ReconcileConfig, reconcile
from kelastic.operator.spec import Job, parse_job

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("reconcile_harness.py"))))

OPERATOR = {"app.kubernetes.io/name": "kelastic", "app.kubernetes.io/component": "operator"}
OPERATOR_NS = "kelastic-system"
ON = NetworkPolicyConfig(True, OPERATOR, OPERATOR_NS)
PROMETHEUS = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "monitoring"}}}
CFG = BuildConfig()
STORE_PORT, HEALTH_PORT, CHECKPOINT_PORT = 29400, 8081, 41234


def namespace_labels(name: str, *, labelled: bool = True) -> dict[str, str]:
    return {NAMESPACE_NAME_LABEL: name} if labelled else {}


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector of matchLabels only (all the policies use), as the API defines it."""
    assert set(selector) <= {"matchLabels"}, selector
    return dict(selector.get("matchLabels") or {}).items() <= dict(labels).items()


def admits(
    policy: Mapping[str, Any],
    *,
    source: Mapping[str, str],
    source_ns: str,
    source_ns_labels: Mapping[str, str],
    port: int,
) -> bool:
    """Whether ``policy`` admits a TCP connection from a pod to ``port`` of a pod it selects.

    A peer with a podSelector alone means the policy's own namespace; with a namespaceSelector
    too, pods of the namespaces it selects; a rule without ports is every port.
    """
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if ports is not None and not any(p["port"] == port and p["protocol"] == "TCP" for p in ports):
            continue
        for peer in rule["from"]:
            if "namespaceSelector" in peer:
                in_ns = selects(peer["namespaceSelector"], source_ns_labels)
            else:
                in_ns = source_ns == policy["metadata"]["namespace"]
            if in_ns and selects(peer.get("podSelector", {}), source):
                return True
    return False


def pod_labels(job: Job) -> SimpleNamespace:
    return SimpleNamespace(
        worker=worker_pod(job, 0, endpoint="h:1", config=CFG)["metadata"]["labels"],
        store=store_pod(job, config=CFG)["metadata"]["labels"],
    )


def test_the_store_admits_only_the_jobs_workers_and_the_operator_on_its_port(kit: SimpleNamespace) -> None:
    job, other = parse_job(kit.job_body("a")), parse_job(kit.job_body("b"))
    own, theirs = pod_labels(job), pod_labels(other)
    policy = store_network_policy(job, port=STORE_PORT, config=ON)
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    meta = policy["metadata"]
    assert (meta["name"], meta["namespace"]) == ("a-rendezvous", "ns")
    (owner,) = meta["ownerReferences"]
    assert owner["uid"] == "uid-a" and owner["kind"] == "ElasticJob" and owner["controller"] is True
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    target = policy["spec"]["podSelector"]
    assert selects(target, own.store)
    assert not selects(target, own.worker) and not selects(target, theirs.store)

    def reach(
        source: Mapping[str, str], ns: str = "ns", port: int = STORE_PORT, labelled: bool = True
    ) -> bool:
        return admits(
            policy,
            source=source,
            source_ns=ns,
            source_ns_labels=namespace_labels(ns, labelled=labelled),
            port=port,
        )

    assert reach(own.worker)
    assert not reach(own.worker, port=HEALTH_PORT)  # the store port only
    assert not reach(theirs.worker) and not reach(own.store) and not reach({})
    assert not reach(own.worker, ns="elsewhere")  # a pod wearing the job's labels in another namespace
    assert reach(OPERATOR, ns=OPERATOR_NS)
    assert not reach(OPERATOR, ns="elsewhere")  # any pod can wear the operator's labels
    assert not reach({"app.kubernetes.io/name": "kelastic"}, ns=OPERATOR_NS)  # not the operator's pods


def test_workers_admit_the_jobs_workers_on_every_port_and_the_operator_on_the_health_port(
    kit: SimpleNamespace,
) -> None:
    job, other = parse_job(kit.job_body("a")), parse_job(kit.job_body("b"))
    own, theirs = pod_labels(job), pod_labels(other)
    config = NetworkPolicyConfig(True, OPERATOR, OPERATOR_NS, metrics_from=(PROMETHEUS,))
    policy = workers_network_policy(job, health_port=HEALTH_PORT, config=config)
    assert policy["metadata"]["name"] == "a-workers" and policy["spec"]["policyTypes"] == ["Ingress"]
    target = policy["spec"]["podSelector"]
    assert selects(target, own.worker)
    assert not selects(target, own.store) and not selects(target, theirs.worker)

    def reach(source: Mapping[str, str], port: int, ns: str = "ns") -> bool:
        return admits(policy, source=source, source_ns=ns, source_ns_labels=namespace_labels(ns), port=port)

    for port in (CHECKPOINT_PORT, HEALTH_PORT, 29500, 1):  # checkpoint service, probes, gloo, anything
        assert reach(own.worker, port)
        assert not reach(theirs.worker, port) and not reach(own.store, port) and not reach({}, port)
        assert not reach(own.worker, port, ns="elsewhere")
    assert reach(OPERATOR, HEALTH_PORT, ns=OPERATOR_NS)
    assert not reach(OPERATOR, CHECKPOINT_PORT, ns=OPERATOR_NS)  # the operator needs the health port only
    assert not reach(OPERATOR, HEALTH_PORT, ns="elsewhere")
    assert reach({"app": "prometheus"}, HEALTH_PORT, ns="monitoring")
    assert not reach({"app": "prometheus"}, CHECKPOINT_PORT, ns="monitoring")
    # without a health port (kelastic-operator --health-port 0) only the job's own workers get in
    closed = workers_network_policy(job, health_port=None, config=config)
    assert [rule["from"] for rule in closed["spec"]["ingress"]] == [[{"podSelector": target}]]


def test_where_the_operators_namespace_has_no_name_label_its_pods_are_admitted_from_any_namespace(
    kit: SimpleNamespace,
) -> None:
    job = parse_job(kit.job_body("a"))
    old = NetworkPolicyConfig(True, OPERATOR, OPERATOR_NS, namespace_labelled=False)
    assert operator_peer(old) == {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR}}
    policy = store_network_policy(job, port=STORE_PORT, config=old)
    for ns in (OPERATOR_NS, "elsewhere"):  # a v1.20 namespace has no name label to select on
        assert admits(policy, source=OPERATOR, source_ns=ns, source_ns_labels={}, port=STORE_PORT)
    assert not admits(policy, source={"x": "y"}, source_ns=OPERATOR_NS, source_ns_labels={}, port=STORE_PORT)


def test_an_operator_whose_pods_are_not_known_is_admitted_nowhere(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body("a"))
    for config in (
        NetworkPolicyConfig(True),
        NetworkPolicyConfig(True, OPERATOR, None),
        NetworkPolicyConfig(True, {}, OPERATOR_NS),
    ):
        assert operator_peer(config) is None
        (rule,) = store_network_policy(job, port=STORE_PORT, config=config)["spec"]["ingress"]
        assert len(rule["from"]) == 1
        assert (
            len(workers_network_policy(job, health_port=HEALTH_PORT, config=config)["spec"]["ingress"]) == 1
        )


def test_the_operators_namespace_check() -> None:
    labelled, line = namespace_check(OPERATOR_NS, {NAMESPACE_NAME_LABEL: OPERATOR_NS, "team": "ml"})
    assert labelled and "from namespace kelastic-system only" in line
    labelled, line = namespace_check(OPERATOR_NS, {"team": "ml"})
    assert not labelled and "ANY namespace" in line
    assert f"kubectl label namespace {OPERATOR_NS} {NAMESPACE_NAME_LABEL}={OPERATOR_NS}" in line
    # a label naming another namespace does not select this one
    assert not namespace_check(OPERATOR_NS, {NAMESPACE_NAME_LABEL: "other"})[0]
    # not readable (no permission): current clusters label every namespace; the line says how to on older ones
    labelled, line = namespace_check(OPERATOR_NS, None, "403 Forbidden")
    assert labelled and "403 Forbidden" in line and "kubectl label namespace" in line


def test_parse_labels_and_peers() -> None:
    assert parse_labels("") == {}
    assert parse_labels("a=1, b.io/c=x") == {"a": "1", "b.io/c": "x"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_labels("a=1,b")
    assert parse_peers("") == ()
    assert parse_peers('[{"namespaceSelector": {"matchLabels": {"a": "b"}}}]') == (
        {"namespaceSelector": {"matchLabels": {"a": "b"}}},
    )
    with pytest.raises(ValueError, match="not JSON"):
        parse_peers("[{")
    with pytest.raises(ValueError, match="JSON list of peers"):
        parse_peers('{"podSelector": {}}')
    with pytest.raises(ValueError, match=r"not \['ports'\]"):
        parse_peers('[{"ports": [1]}]')


def _ensure_actions(kit: SimpleNamespace, config: ReconcileConfig, **spec: object) -> list[EnsureObject]:
    job = parse_job(kit.job_body(**spec))
    decision = reconcile(job, kit.observed(kit.store(), kit.worker(0), kit.worker(1), kit.worker(2)), config)
    return [a for a in decision.actions if isinstance(a, EnsureObject)]


def test_reconcile_asks_for_both_policies_when_enabled(kit: SimpleNamespace) -> None:
    assert _ensure_actions(kit, ReconcileConfig()) == []
    on = ReconcileConfig(network_policy=ON)
    workers, store = _ensure_actions(kit, on)
    assert (
        workers.path
        == store.path
        == network_policy_path("ns")
        == "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies"
    )
    assert (workers.key, store.key) == ("uid-demo/networkpolicy-workers", "uid-demo/networkpolicy-store")
    assert workers.reason == store.reason == "CreateNetworkPolicy"
    assert (workers.manifest["metadata"]["name"], store.manifest["metadata"]["name"]) == (
        "demo-workers",
        "demo-rendezvous",
    )
    # the health port the workers' policy opens is the one the operator gives the agents
    health = workers.manifest["spec"]["ingress"][1]["ports"]
    assert health == [{"protocol": "TCP", "port": contract.DEFAULT_HEALTH_PORT}]


class OrderKube:
    """Records the order of what is created."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        self.created.append(f"{path.rsplit('/', 1)[-1]} {body['metadata']['name']}")
        return dict(body)

    def create(self, namespace: str, plural: str, manifest: dict[str, Any]) -> dict[str, Any]:
        self.created.append(f"{plural} {manifest['metadata']['name']}")
        return {**manifest, "metadata": {**manifest["metadata"], "uid": "u"}}


def test_the_first_pass_makes_the_policies_before_any_pod(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body())
    decision = reconcile(job, kit.observed(), ReconcileConfig(network_policy=ON))
    kube = OrderKube()

    async def io(fn: Any, *args: Any) -> Any:
        return fn(*args)

    class Events:
        def emit(self, *args: Any, **kw: Any) -> None:
            pass

    executor = ActionExecutor(
        kube, io, Events(), OperatorMetrics(), JobCache(), lambda key, action: None, lambda uid: "0" * 64
    )  # type: ignore[arg-type]
    asyncio.run(executor.apply(job, kit.job_body(), decision, [], []))
    first_pod = next(i for i, c in enumerate(kube.created) if c.startswith("pods "))
    policies = [c for c in kube.created[:first_pod] if c.startswith("networkpolicies ")]
    assert policies == ["networkpolicies demo-workers", "networkpolicies demo-rendezvous"], kube.created


def test_the_emulator_serves_network_policies_as_the_api_does(kube: Kube, kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body())
    kube.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}
    )
    for manifest in (
        store_network_policy(job, port=STORE_PORT, config=ON),
        workers_network_policy(job, health_port=HEALTH_PORT, config=ON),
    ):
        manifest["metadata"].pop("ownerReferences")  # no ElasticJob exists on this bare API server
        created = kube.request("POST", network_policy_path("ns"), manifest)
        assert created["spec"]["podSelector"] == manifest["spec"]["podSelector"]
        assert created["spec"]["ingress"] == manifest["spec"]["ingress"]
        assert created["metadata"]["uid"] and contract.LABEL_JOB_NAME in created["metadata"]["labels"]
        with pytest.raises(Exception, match="already exists"):
            kube.request("POST", network_policy_path("ns"), manifest)


class RefusingKube(OrderKube):
    """Refuses NetworkPolicies with ``status`` (None: makes them)."""

    def __init__(self, status: int | None) -> None:
        super().__init__()
        self.status = status

    def request(self, method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        from kelastic.operator.kube import ApiError

        if self.status is not None and "networkpolicies" in path:
            raise ApiError(self.status, "Forbidden", "networkpolicies is forbidden")
        return super().request(method, path, body, **kw)


def _apply(kit: SimpleNamespace, kube: OrderKube, executor: Any = None) -> tuple[Any, list[tuple[str, str]]]:
    job = parse_job(kit.job_body())
    decision = reconcile(job, kit.observed(kit.store()), ReconcileConfig(network_policy=ON))
    return harness.apply_decision(kube, job, kit.job_body(), decision, executor)


def test_workers_wait_for_network_policies_that_cannot_be_made(kit: SimpleNamespace) -> None:
    """Fail closed: a worker without its policy would take connections from any pod."""
    refused = RefusingKube(403)
    executor, posted = _apply(kit, refused)
    assert executor.failed and not [c for c in refused.created if c.startswith("pods ")]
    failures = [m for r, m in posted if r == "FailedCreate"]
    assert failures and all("worker pods wait for it" in m for m in failures), failures
    assert "NetworkPolicy demo-workers" in failures[0] and "forbidden" in failures[0]
    # Once the policies can be made, the next pass creates them and then the workers.
    refused.status = None
    executor._ensure_retry.clear()
    executor.failed.clear()
    executor, posted = _apply(kit, refused, executor)
    assert not executor.failed
    assert [c for c in refused.created if c.startswith("pods ")], refused.created
