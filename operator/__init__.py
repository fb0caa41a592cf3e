"""kelastic's ElasticJob operator.

A pure core decides (``spec.parse_job`` → ``reconcile.reconcile`` → actions and
status); thin kopf handlers (``handlers``) observe the cluster, apply the actions
through the Kubernetes API and post Events; ``cli.main`` is ``kelastic-operator``.
Importing this package does not import kopf.
"""

if __name__ == "operator":
    # This folder is ``kelastic.operator``. It is reachable as the top-level name
    # ``operator`` only when a checkout's root is on sys.path (``python -m pip`` or
    # ``python -m pytest`` run from the root of a checkout) and the standard
    # library's ``operator`` was not imported yet, as in a fresh virtualenv. Serve
    # the standard library's module under that name instead of shadowing it. Only
    # the frozen import machinery is used: importlib.util would import collections,
    # which needs ``operator`` itself.
    import os as _os
    import sys as _sys
    from importlib import _bootstrap as _bootstrap
    from importlib.machinery import SourceFileLoader as _SourceFileLoader

    _loader = _SourceFileLoader("operator", _os.path.join(_os.path.dirname(_os.__file__), "operator.py"))
    _spec = _bootstrap.spec_from_loader("operator", _loader)
    assert _spec is not None  # always a spec when a loader is given
    _stdlib_operator = _bootstrap.module_from_spec(_spec)
    _sys.modules["operator"] = _stdlib_operator
    _loader.exec_module(_stdlib_operator)
else:
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
