"""Policy: worker pods for indices [0, replicas + standbyReplicas); those above are deleted. A
worker of a job Kueue admitted runs where its share of the admission says
(``kelastic.operator.kueue.Placement``)."""

from __future__ import annotations

from kelastic.operator import builders, kueue
from kelastic.operator.observed import PodView
from kelastic.operator.reconcile.actions import CreatePod
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass


def step(p: Pass, job: ActiveJob) -> Next:
    """Worker pods for indices [0, replicas + standbyReplicas); those above go. A name still
    taken (terminating, failed) waits for the next pass. Every pod runs the same agent: the
    rendezvous makes ``replicas`` of them members and parks the others as standbys, so a lost
    member's replacement pod becomes the new standby."""
    spec = job.spec
    by_index: dict[int, list[PodView]] = {}
    for pod in job.workers:
        assert pod.index is not None
        by_index.setdefault(pod.index, []).append(pod)
    for index in range(spec.pods):
        if index in by_index:
            continue
        if job.endpoint is None:
            break  # the Service has no cluster IP yet; the next pass creates the workers
        manifest = builders.worker_pod(p.job, index, endpoint=job.endpoint, config=p.config.build)
        if p.observed.queue is not None:  # where Kueue admitted it: its flavors' nodes
            manifest = kueue.with_placement(manifest, p.observed.queue.placement_of(index))
        p.actions.append(
            CreatePod(
                reason="CreateWorker",
                message=f"creating worker pod {manifest['metadata']['name']}",
                manifest=manifest,
            )
        )
    for pod in sorted(job.workers, key=lambda w: -(w.index or 0)):
        if (
            pod.index is not None
            and pod.index >= spec.pods
            and not pod.terminating
            and pod not in job.recreating
        ):
            p.delete_pod(
                pod,
                "ScaleDown",
                f"deleting worker pod {pod.name}: spec.replicaSpecs.Worker.replicas is {spec.replicas}"
                + (f" and spec.standbyReplicas {spec.standby_replicas}" if spec.standby_replicas else ""),
            )
    return Next.CONTINUE
