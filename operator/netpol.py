"""The NetworkPolicies that keep a job's network to the job (pure builders).

Every ElasticJob gets two ``networking.k8s.io/v1`` NetworkPolicies, owned by the job (the
garbage collector removes them with it), both of ingress only:

* ``<job>-workers`` selects the job's worker pods and admits
  - the job's own worker pods (same namespace, labels ``kelastic.dev/job-name=<job>`` and
    ``kelastic.dev/role=worker``) on every port: the checkpoint service, the peer links,
    the workers' TCPStore, gloo and NCCL all listen on ephemeral ports;
  - the operator (below), and the peers of :attr:`NetworkPolicyConfig.metrics_from` (a
    Prometheus that scrapes the agents), on the agents' health port only.
* ``<job>-rendezvous`` selects the job's store pod (only when the operator runs it: a job
  with ``spec.rdzvEndpoint`` has none) and admits the job's workers and the operator on the
  store port: the operator publishes the membership and reads progress there.

The operator is admitted by its namespace and its pod labels together: a namespace selector
on ``kubernetes.io/metadata.name=<its namespace>``, which Kubernetes sets on every namespace
since 1.21, AND the labels of its pods (the chart passes its selector labels). Whether the
operator's namespace has that label is found once at start-up by reading the namespace
(:func:`namespace_check`); where it has none (an older cluster), the policies admit pods
with the operator's labels from any namespace, and the operator says so in its log with the
``kubectl label`` that restores the narrower rule. Without the operator's namespace and
labels (an operator that runs outside the cluster) no operator is admitted.

Nothing else reaches the job: another job's pods, other namespaces, any other pod of the
cluster are refused. A cluster enforces NetworkPolicies only with a CNI that implements them
(Calico, Cilium, …); elsewhere the objects are stored and have no effect, so creating them
is harmless. Traffic from the node itself (the kubelet's probes) is always allowed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from kelastic.agent import contract
from kelastic.operator.builders import owner_reference, store_pod_name
from kelastic.operator.spec import Job

__all__ = [
    "NAMESPACE_NAME_LABEL",
    "NetworkPolicyConfig",
    "namespace_check",
    "network_policy_name",
    "network_policy_path",
    "operator_peer",
    "parse_labels",
    "parse_peers",
    "store_network_policy",
    "workers_network_policy",
    "workers_network_policy_name",
]

API_VERSION = "networking.k8s.io/v1"
#: The label the API server puts on every namespace (Kubernetes 1.21 and later): its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
#: What a NetworkPolicyPeer may hold.
_PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})


@dataclass(frozen=True)
class NetworkPolicyConfig:
    """Whether the operator creates the jobs' NetworkPolicies, and whom they admit besides the job.

    ``kelastic-operator`` creates them unless ``--no-network-policy`` (the chart's
    ``networkPolicy.enabled: false``); this value's own default is off, for callers of the
    pure core that set up no policy.
    """

    enabled: bool = False
    #: Labels of the operator's pods; with ``operator_namespace``, the operator is admitted.
    operator_labels: Mapping[str, str] = field(default_factory=dict)
    #: The operator's namespace; None when it runs outside the cluster (then it is not admitted).
    operator_namespace: str | None = None
    #: Whether that namespace carries ``kubernetes.io/metadata.name`` (:func:`namespace_check`);
    #: without it the operator's labels are admitted from any namespace.
    namespace_labelled: bool = True
    #: NetworkPolicyPeers admitted to the agents' health port (``/metrics``), e.g. a Prometheus.
    metrics_from: tuple[Mapping[str, Any], ...] = ()


def network_policy_name(job_name: str) -> str:
    """The store's policy: ``<job>-rendezvous``, the store pod's name."""
    return store_pod_name(job_name)


def workers_network_policy_name(job_name: str) -> str:
    return f"{job_name}-workers"


def network_policy_path(namespace: str) -> str:
    """The collection URL of NetworkPolicies in ``namespace``."""
    return f"/apis/{API_VERSION}/namespaces/{quote(namespace)}/networkpolicies"


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` (a label selector of equalities only) as a dict; ValueError naming the bad part."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {part!r} in {text!r}")
        labels[key.strip()] = value.strip()
    return labels


def parse_peers(text: str) -> tuple[dict[str, Any], ...]:
    """A JSON list of NetworkPolicyPeers (``podSelector``, ``namespaceSelector``, ``ipBlock``);
    ValueError saying what is wrong. An empty text is no peer."""
    if not text.strip():
        return ()
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(p, dict) and p for p in value):
        raise ValueError('expected a JSON list of peers such as [{"namespaceSelector": {...}}]')
    for peer in value:
        unknown = sorted(set(peer) - _PEER_KEYS)
        if unknown:
            raise ValueError(f"a peer holds only podSelector, namespaceSelector or ipBlock, not {unknown}")
    return tuple(value)


def namespace_check(
    namespace: str, labels: Mapping[str, str] | None, error: str | None = None
) -> tuple[bool, str]:
    """Whether the operator's ``namespace`` (whose labels were read, or None with the read's
    ``error``) can be selected by name, and the log line that says what the policies do."""
    if labels is None:
        return True, (
            f"could not read namespace {namespace} ({error}): the NetworkPolicies select it by its label "
            f"{NAMESPACE_NAME_LABEL}, which Kubernetes 1.21 and later sets on every namespace; on an older "
            f"cluster, label it: kubectl label namespace {namespace} {NAMESPACE_NAME_LABEL}={namespace}"
        )
    if labels.get(NAMESPACE_NAME_LABEL) == namespace:
        return True, f"the NetworkPolicies admit the operator's pods from namespace {namespace} only"
    return False, (
        f"namespace {namespace} has no label {NAMESPACE_NAME_LABEL}={namespace} (Kubernetes sets it from "
        "1.21 on): the NetworkPolicies admit pods with the operator's labels from ANY namespace. To admit "
        f"this namespace only: kubectl label namespace {namespace} {NAMESPACE_NAME_LABEL}={namespace}, then "
        "restart the operator"
    )


def operator_peer(config: NetworkPolicyConfig) -> dict[str, Any] | None:
    """The operator as a NetworkPolicyPeer (its namespace AND its pod labels), None if unknown."""
    if not config.operator_labels or not config.operator_namespace:
        return None
    namespaces: dict[str, Any] = (
        {"matchLabels": {NAMESPACE_NAME_LABEL: config.operator_namespace}}
        if config.namespace_labelled
        else {}
    )
    return {"namespaceSelector": namespaces, "podSelector": {"matchLabels": dict(config.operator_labels)}}


def _pods(job: Job, role: str) -> dict[str, Any]:
    return {"matchLabels": {contract.LABEL_JOB_NAME: job.meta.name, contract.LABEL_ROLE: role}}


def _policy(job: Job, name: str, role: str, ingress: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": {
            "name": name,
            "namespace": job.meta.namespace,
            "labels": {contract.LABEL_JOB_NAME: job.meta.name, contract.LABEL_ROLE: role},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {"podSelector": _pods(job, role), "policyTypes": ["Ingress"], "ingress": list(ingress)},
    }


def store_network_policy(job: Job, *, port: int, config: NetworkPolicyConfig) -> dict[str, Any]:
    """``<job>-rendezvous``: the job's workers and the operator reach the store port (module docstring)."""
    peers: list[dict[str, Any]] = [{"podSelector": _pods(job, contract.ROLE_WORKER)}]
    operator = operator_peer(config)
    if operator is not None:
        peers.append(operator)
    rule = {"from": peers, "ports": [{"protocol": "TCP", "port": port}]}
    return _policy(job, network_policy_name(job.meta.name), contract.ROLE_RENDEZVOUS, [rule])


def workers_network_policy(
    job: Job, *, health_port: int | None, config: NetworkPolicyConfig
) -> dict[str, Any]:
    """``<job>-workers``: the job's workers reach each other on every port; the operator and
    ``config.metrics_from`` reach the health port (module docstring)."""
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": _pods(job, contract.ROLE_WORKER)}]}]
    operator = operator_peer(config)
    health_peers = [*([operator] if operator is not None else []), *(dict(p) for p in config.metrics_from)]
    if health_port is not None and health_peers:
        ingress.append({"from": health_peers, "ports": [{"protocol": "TCP", "port": health_port}]})
    return _policy(job, workers_network_policy_name(job.meta.name), contract.ROLE_WORKER, ingress)
