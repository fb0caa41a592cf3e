"""What a reconcile pass decides: the actions the controller carries out, the
:class:`Decision`, and its :class:`ReconcileConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kelastic.operator import builders, netpol


@dataclass(frozen=True)
class Action:
    """Something the handlers do to the cluster. ``reason``/``message`` become its Event,
    of type Warning when ``warning`` (something went wrong), else Normal."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class CreateService(Action):
    manifest: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CreatePod(Action):
    manifest: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CreateSecret(Action):
    """Create the job's Secret (``manifest``, without its value: the executor adds a fresh one).

    A create that finds it (409) keeps it. Worker pods created in the same pass wait for it:
    when it fails they are not created (kelastic.operator.jobsecret).
    """

    manifest: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeletePod(Action):
    """Delete pod ``name``, only the incarnation ``uid``. ``grace_seconds`` 0 removes it from the
    API at once, without its kubelet's confirmation that its containers stopped (a force
    delete; for a pod whose node is lost); None keeps the pod's own grace period."""

    name: str = ""
    uid: str = ""
    grace_seconds: int | None = None


@dataclass(frozen=True)
class DeleteService(Action):
    name: str = ""


@dataclass(frozen=True)
class DeleteJob(Action):
    pass


@dataclass(frozen=True)
class PublishMembership(Action):
    """Tell the rendezvous which worker pods are alive and runnable now."""

    endpoint: str = ""
    run_id: str = ""
    nodes: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    #: Changes when the store restarts, so the handler republishes to the new one.
    store_id: str = ""


@dataclass(frozen=True)
class EnsureObject(Action):
    """Create ``manifest`` at the collection URL ``path`` unless it exists (409 is success).

    Returned on every pass; the controller creates each ``key`` once per operator run,
    so a pass costs no API call for an object already ensured.
    """

    path: str = ""
    manifest: Mapping[str, Any] = field(default_factory=dict)
    key: str = ""
    #: The worker pods need this object (a PodGroup they name, a NetworkPolicy that guards
    #: them): while it cannot be made, none is created.
    workers_wait: bool = False


@dataclass(frozen=True)
class Emit(Action):
    """An Event without a cluster change (a state transition or a failure)."""


@dataclass(frozen=True)
class ReconcileConfig:
    #: Fail the job when fewer than minReplicas workers ran for this long (seconds).
    min_replicas_timeout: float = 300.0
    #: After the first worker succeeded, how long the others get to finish (seconds).
    success_grace: float = 30.0
    #: A worker whose failure ends the job without naming a failed rank (its agent only
    #: saw the job closed by a peer) waits this long for a still-active peer to report
    #: the root cause, so the job's reason quotes it (seconds after the failure).
    root_cause_grace: float = 5.0
    build: builders.BuildConfig = field(default_factory=builders.BuildConfig)
    #: Whether a job of the kelastic backend may name a store of its own (``spec.rdzvEndpoint``)
    #: that the operator then connects to (kelastic.operator.reconcile.external_store).
    allow_external_stores: bool = False
    #: The jobs' NetworkPolicies (kelastic.operator.netpol); kelastic-operator turns them on.
    network_policy: netpol.NetworkPolicyConfig = field(default_factory=netpol.NetworkPolicyConfig)


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    status: dict[str, Any]
    #: Reconcile again after this many seconds at the latest (deadlines, TTL, grace).
    requeue_after: float | None = None
