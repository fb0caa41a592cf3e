"""The NetworkPolicy that keeps a job's rendezvous store to the job (pure builders).

Every ElasticJob whose store the operator runs gets one ``networking.k8s.io/v1``
NetworkPolicy, ``<job>-rendezvous``, owned by the job (the garbage collector
removes it with the job). It selects the job's store pod and admits, on the
store port only:

* the job's own worker pods (same namespace, labels ``kelastic.dev/job-name=<job>``
  and ``kelastic.dev/role=worker``);
* the operator's pods, in any namespace, by the labels given in
  :attr:`NetworkPolicyConfig.operator_labels` (the chart passes its selector
  labels): the operator publishes membership and reads progress through the store.
  A namespace selector is not used because Kubernetes v1.20 gives namespaces no
  name label to select on.

Nothing else reaches the store: another job's workers or any other pod in the
cluster are refused. On a cluster without a NetworkPolicy provider (a CNI that
enforces them) the object is stored and has no effect, so creating it is harmless.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from kelastic.agent import contract
from kelastic.operator.builders import owner_reference, store_pod_name
from kelastic.operator.spec import Job

__all__ = [
    "NetworkPolicyConfig",
    "network_policy_name",
    "network_policy_path",
    "parse_labels",
    "store_network_policy",
]

API_VERSION = "networking.k8s.io/v1"


@dataclass(frozen=True)
class NetworkPolicyConfig:
    """Whether the operator creates the store's NetworkPolicy, and who besides the job may reach it."""

    enabled: bool = False
    #: Labels of the operator's pods (any namespace), admitted to every store.
    operator_labels: Mapping[str, str] = field(default_factory=dict)


def network_policy_name(job_name: str) -> str:
    return store_pod_name(job_name)


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


def store_network_policy(job: Job, *, port: int, config: NetworkPolicyConfig) -> dict[str, Any]:
    """The store's NetworkPolicy of ``job`` (see the module docstring)."""
    name = job.meta.name
    peers: list[dict[str, Any]] = [
        {
            "podSelector": {
                "matchLabels": {contract.LABEL_JOB_NAME: name, contract.LABEL_ROLE: contract.ROLE_WORKER}
            }
        }
    ]
    if config.operator_labels:
        peers.append({"namespaceSelector": {}, "podSelector": {"matchLabels": dict(config.operator_labels)}})
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(name),
            "namespace": job.meta.namespace,
            "labels": {contract.LABEL_JOB_NAME: name, contract.LABEL_ROLE: contract.ROLE_RENDEZVOUS},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "podSelector": {
                "matchLabels": {contract.LABEL_JOB_NAME: name, contract.LABEL_ROLE: contract.ROLE_RENDEZVOUS}
            },
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }
