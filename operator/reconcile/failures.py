"""Policy: recreate failed workers per ``restartPolicy`` and ``backoffLimit``, else fail
the job quoting its root cause.
"""

from __future__ import annotations

from collections.abc import Sequence

from kelastic.operator.observed import PodPhase, PodView, failure_order, failure_summary, names_failed_rank
from kelastic.operator.reconcile.context import ActiveJob, Next, Pass, seconds_since
from kelastic.operator.reconcile.finish import finish
from kelastic.operator.spec import RestartPolicy
from kelastic.operator.status import Phase

#: The reason a kubelet gives a container the kernel killed at its memory limit. The
#: kernel's OOM killer picks the container's largest process: a rank, most often, and not
#: the agent, which then exits with its own code, 1; the container still ends OOMKilled.
OOM_KILLED = "OOMKilled"


def retryable(pod: PodView, policy: RestartPolicy) -> bool:
    """Whether a failed worker pod is recreated (True) or fails the job (False)."""
    if policy is RestartPolicy.NEVER:
        return False
    if policy is RestartPolicy.ON_FAILURE:
        return True
    # ExitCode: no exit code (evicted, node lost), a signal or the OOM killer (whichever process
    # of the container it chose) is infrastructure, not the program's own verdict.
    if pod.exit_code is None or pod.signal or pod.reason == OOM_KILLED:
        return True
    return pod.exit_code >= 128 or pod.exit_code < 0


def describe_failure(pod: PodView) -> str:
    """``worker pod NAME (index I)``, how it ended, then the gist of its agent's last words.

    A container the kernel killed at its memory limit reads ``was OOM-killed (it exceeded
    its memory limit) and exited with code N``, whichever process the kernel chose."""
    parts = [f"worker pod {pod.name} (index {pod.index})"]
    if pod.reason == OOM_KILLED:
        parts.append("was OOM-killed (it exceeded its memory limit)")
        if pod.exit_code is not None:
            parts.append(f"and exited with code {pod.exit_code}")
    elif pod.signal:
        parts.append(f"was killed by signal {pod.signal}")
    elif pod.exit_code is not None:
        parts.append(f"exited with code {pod.exit_code}")
    else:
        parts.append("failed")
    if pod.reason and pod.reason != OOM_KILLED:
        parts.append(f"({pod.reason})")
    gist = failure_summary(pod.message)
    text = " ".join(parts)
    return f"{text}: {gist}" if gist else text


def root_cause(pod: PodView, failed: Sequence[PodView], grace: float) -> PodView:
    """The failure to quote when ``pod`` ends the job: ``pod``, unless it does not name a
    failed rank and another failure that does ended within ``grace`` seconds of it (the
    peer whose crash closed the job; its pod status may land a second later)."""
    if names_failed_rank(pod.message) or pod.finished_at is None:
        return pod
    near = [
        f
        for f in failed
        if names_failed_rank(f.message)
        and f.finished_at is not None
        and abs((f.finished_at - pod.finished_at).total_seconds()) <= grace
    ]
    return min(near, key=failure_order) if near else pod


def awaiting_root_cause(p: Pass, pod: PodView, wanted: Sequence[PodView]) -> bool:
    """Whether to hold off failing the job because of ``pod`` (and reconcile again soon).

    True while ``pod`` ended without naming a failed rank, another wanted worker is
    still active (its agent may be about to report the root cause) and ``pod`` ended
    less than ``root_cause_grace`` seconds ago. Bounded: a pod with no end time never
    waits.
    """
    if names_failed_rank(pod.message) or pod.finished_at is None:
        return False
    if not any(w.active and w.uid != pod.uid for w in wanted):
        return False
    left = p.config.root_cause_grace - seconds_since(p.now, pod.finished_at)
    if left <= 0:
        return False
    p.after(left)
    return True


def step(p: Pass, job: ActiveJob) -> Next:
    """Recreate failed workers while the restart policy and ``backoffLimit`` allow, else fail the job.

    Each failed pod counts against ``backoffLimit`` once (its uid is kept in
    ``countedFailures`` while the pod exists). Earliest failure first: when the job fails,
    its reason quotes the root cause, not a peer that merely stopped because of it.
    """
    spec = job.spec
    backoff = p.status.backoff_count or 0
    present_uids = {w.uid for w in job.workers}
    counted = [u for u in p.status.counted_failures or [] if u in present_uids]
    failed = sorted((w for w in job.wanted if w.phase is PodPhase.FAILED), key=failure_order)
    ending: tuple[PodView, str, str] | None = None  # the pod that ends the job, reason, message
    for pod in failed:
        what = describe_failure(root_cause(pod, failed, p.config.root_cause_grace))
        if not retryable(pod, spec.restart_policy):
            why = (
                "restartPolicy ExitCode treats exit codes 1-127 as permanent"
                if spec.restart_policy is RestartPolicy.EXIT_CODE
                else f"restartPolicy {spec.restart_policy.value} does not recreate failed workers"
            )
            ending = (pod, "WorkerFailed", f"{what}; {why}")
            break
        if pod.uid not in counted:
            if backoff >= spec.backoff_limit:
                ending = (
                    pod,
                    "BackoffLimitExceeded",
                    f"{what}; the job already recreated failed workers {backoff} times (spec.backoffLimit={spec.backoff_limit})",
                )
                break
            backoff += 1
            counted.append(pod.uid)
        job.recreating.append(pod)
        p.delete_pod(
            pod,
            "RecreateWorker",
            f"{what}; recreating it ({backoff}/{spec.backoff_limit} of spec.backoffLimit used)",
            warning=True,
        )
    p.status.counted_failures = counted
    p.status.backoff_count = backoff
    if ending is None:
        return Next.CONTINUE
    pod, reason, message = ending
    if not awaiting_root_cause(p, pod, job.wanted):
        finish(p, Phase.FAILED, reason, message, spec, job.workers)
    return Next.STOP
