"""kelastic's ElasticJob operator.

A pure core decides (``spec.parse_job`` → ``reconcile.reconcile`` → actions and
status); thin kopf handlers (``handlers``) observe the cluster, apply the actions
through the Kubernetes API and post Events; ``cli.main`` is ``kelastic-operator``.
Importing this package does not import kopf.
"""

from kelastic.operator.builders import BuildConfig
from kelastic.operator.observed import Observed, PodPhase, PodView, RendezvousView, ServiceView
from kelastic.operator.reconcile import Action, Decision, ReconcileConfig, reconcile
from kelastic.operator.spec import Job, JobSpec, SpecError, parse_job
from kelastic.operator.status import Phase

__all__ = [
    "Action",
    "BuildConfig",
    "Decision",
    "Job",
    "JobSpec",
    "Observed",
    "Phase",
    "PodPhase",
    "PodView",
    "ReconcileConfig",
    "RendezvousView",
    "ServiceView",
    "SpecError",
    "parse_job",
    "reconcile",
]
