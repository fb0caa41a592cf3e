"""The operator connects only to the rendezvous stores it runs, unless it is told otherwise.

A job of the ``kelastic`` backend that names a store of its own (``spec.rdzvEndpoint``) would
have the operator connect to whatever HOST:PORT its author wrote, with the operator's network
reach (the NetworkPolicies of every job admit the operator), publish there and read from
there. Unless ``ReconcileConfig.allow_external_stores`` (``kelastic-operator
--allow-external-stores``, the chart's ``operator.allowExternalStores``), such a job is
refused like an invalid spec: the ``Invalid`` condition and an Event say why and how to allow
it. With any other backend the operator never connects to the endpoint (only the job's own
workers use it), so it is not refused.
"""

from __future__ import annotations

from dataclasses import replace

from kelastic.operator.builders import uses_control
from kelastic.operator.reconcile.actions import ReconcileConfig
from kelastic.operator.spec import Job, SpecError

__all__ = ["admitted"]


def admitted(job: Job, config: ReconcileConfig) -> Job:
    """``job``, or ``job`` made invalid (``spec`` None, the error set) when it names a store of its
    own that this operator would connect to and may not. Pure; a job already invalid passes as it is."""
    spec = job.spec
    if spec is None or config.allow_external_stores or not spec.rdzv_endpoint or not uses_control(spec):
        return job
    error = SpecError(
        "spec.rdzvEndpoint",
        f"names a rendezvous store the operator did not create ({spec.rdzv_endpoint}); this operator connects "
        "only to the stores it runs for its jobs (the kelastic backend publishes the membership and reads "
        "progress there). Remove spec.rdzvEndpoint and the operator runs the job's store, or have the "
        "operator's administrator allow external stores (the chart's operator.allowExternalStores: true, "
        "kelastic-operator --allow-external-stores)",
    )
    return replace(job, spec=None, error=error)
