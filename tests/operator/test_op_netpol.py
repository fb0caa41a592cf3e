"""The store's NetworkPolicy: the object, its selectors, when the reconcile asks for it, how it is created."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kelastic.agent import contract
from kelastic.operator.builders import BuildConfig, store_pod, worker_pod
from kelastic.operator.kube import Kube
from kelastic.operator.netpol import (
    NetworkPolicyConfig,
    network_policy_path,
    parse_labels,
    store_network_policy,
)
from kelastic.operator.reconcile import EnsureObject, ReconcileConfig, reconcile
from kelastic.operator.spec import parse_job

OPERATOR = {"app.kubernetes.io/name": "kelastic", "app.kubernetes.io/component": "operator"}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_policy_admits_only_the_jobs_workers_and_the_operator_on_the_store_port(kit: SimpleNamespace) -> None:
    job = parse_job(kit.job_body("a"))
    other = parse_job(kit.job_body("b"))
    policy = store_network_policy(job, port=29400, config=NetworkPolicyConfig(True, OPERATOR))
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    meta = policy["metadata"]
    assert (meta["name"], meta["namespace"]) == ("a-rendezvous", "ns")
    (owner,) = meta["ownerReferences"]
    assert owner["uid"] == "uid-a" and owner["kind"] == "ElasticJob" and owner["controller"] is True
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 29400}]
    workers_peer, operator_peer = rule["from"]
    assert operator_peer == {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR}}

    # the selectors against the labels the operator really puts on the pods
    cfg = BuildConfig()
    own_store = store_pod(job, config=cfg)["metadata"]["labels"]
    own_worker = worker_pod(job, 0, endpoint="h:1", config=cfg)["metadata"]["labels"]
    other_store = store_pod(other, config=cfg)["metadata"]["labels"]
    other_worker = worker_pod(other, 0, endpoint="h:1", config=cfg)["metadata"]["labels"]
    target = spec["podSelector"]["matchLabels"]
    assert selects(target, own_store)
    assert not selects(target, own_worker) and not selects(target, other_store)
    admitted = workers_peer["podSelector"]["matchLabels"]
    assert "namespaceSelector" not in workers_peer  # the job's own namespace only
    assert selects(admitted, own_worker)
    assert not selects(admitted, other_worker) and not selects(admitted, own_store)


def test_without_operator_labels_only_the_workers_are_admitted(kit: SimpleNamespace) -> None:
    policy = store_network_policy(parse_job(kit.job_body()), port=1234, config=NetworkPolicyConfig(True))
    (rule,) = policy["spec"]["ingress"]
    assert len(rule["from"]) == 1 and rule["ports"][0]["port"] == 1234


def test_parse_labels() -> None:
    assert parse_labels("") == {}
    assert parse_labels("a=1, b.io/c=x") == {"a": "1", "b.io/c": "x"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_labels("a=1,b")


def _ensure_actions(kit: SimpleNamespace, config: ReconcileConfig, **spec: object) -> list[EnsureObject]:
    job = parse_job(kit.job_body(**spec))
    decision = reconcile(job, kit.observed(kit.store(), kit.worker(0), kit.worker(1), kit.worker(2)), config)
    return [a for a in decision.actions if isinstance(a, EnsureObject)]


def test_reconcile_asks_for_the_policy_only_when_enabled_and_the_operator_runs_the_store(
    kit: SimpleNamespace,
) -> None:
    assert _ensure_actions(kit, ReconcileConfig()) == []
    on = ReconcileConfig(network_policy=NetworkPolicyConfig(True, OPERATOR))
    (action,) = _ensure_actions(kit, on)
    assert (
        action.path == network_policy_path("ns") == "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies"
    )
    assert action.key == "uid-demo/networkpolicy" and action.reason == "CreateNetworkPolicy"
    assert action.manifest["metadata"]["name"] == "demo-rendezvous"
    # a store of the user's own (spec.rdzvEndpoint) is not the operator's to lock
    assert _ensure_actions(kit, on, rdzvEndpoint="store.example:29400") == []


def test_the_emulator_serves_network_policies_as_the_api_does(kube: Kube, kit: SimpleNamespace) -> None:
    manifest = store_network_policy(
        parse_job(kit.job_body()), port=29400, config=NetworkPolicyConfig(True, OPERATOR)
    )
    manifest["metadata"].pop("ownerReferences")  # no ElasticJob exists on this bare API server
    kube.request(
        "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns"}}
    )
    created = kube.request("POST", network_policy_path("ns"), manifest)
    assert created["spec"]["podSelector"] == manifest["spec"]["podSelector"]
    assert created["metadata"]["uid"]
    with pytest.raises(Exception, match="already exists"):
        kube.request("POST", network_policy_path("ns"), manifest)
    assert contract.LABEL_JOB_NAME in created["metadata"]["labels"]
