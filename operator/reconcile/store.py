"""Policy: create or repair the rendezvous store's pod and Service; learn its endpoint and
identity.
"""

from __future__ import annotations

from kelastic.agent import contract
from kelastic.operator import builders
from kelastic.operator.observed import PodPhase
from kelastic.operator.reconcile.actions import CreatePod, CreateService
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass, store_pods, store_service
from kelastic.operator.spec import JobSpec


def step(p: Pass, job: ActiveJob) -> Next:
    """Create or repair the rendezvous store; learn its endpoint and identity."""
    job.endpoint, job.store_id = ensure_store(p, job.spec)
    return Next.CONTINUE


def ensure_store(p: Pass, spec: JobSpec) -> tuple[str | None, str | None]:
    """Create or repair the store pod and Service. Returns (endpoint, store identity) or Nones."""
    if spec.rdzv_endpoint:
        p.status.rdzv_endpoint = spec.rdzv_endpoint
        return spec.rdzv_endpoint, spec.rdzv_endpoint
    build = p.config.build
    endpoint: str | None = None
    svc = store_service(p)
    if svc is None:
        manifest = builders.store_service(p.job, config=build)
        p.actions.append(
            CreateService(
                reason="CreateStoreService",
                message=f"creating rendezvous Service {manifest['metadata']['name']}",
                manifest=manifest,
            )
        )
    elif svc.cluster_ip and not svc.terminating and svc.owner_uid in (p.job.meta.uid, None):
        endpoint = contract.format_endpoint(svc.cluster_ip, build.rdzv_port)  # [v6]:port
        p.status.rdzv_endpoint = endpoint
    # else: the name is still held (being deleted, or left by an earlier job of the same
    # name that the garbage collector has not removed yet): wait for it to go.

    store_id: str | None = None
    alive = False
    for pod in store_pods(p):
        if pod.terminating:
            alive = True  # wait until it is gone; its name is still taken
            continue
        if pod.phase in (PodPhase.FAILED, PodPhase.SUCCEEDED):
            p.delete_pod(
                pod,
                "StoreDied",
                f"rendezvous store pod {pod.name} ended ({pod.phase.value}); recreating it",
                warning=True,
            )
            alive = True
            continue
        alive = True
        if pod.phase is PodPhase.RUNNING:
            store_id = pod.uid
    if not alive:
        manifest = builders.store_pod(p.job, config=build)
        p.actions.append(
            CreatePod(
                reason="CreateStore",
                message=f"creating rendezvous store pod {manifest['metadata']['name']}",
                manifest=manifest,
            )
        )
    return endpoint, store_id
