"""The figures the status shows every pass: the replica counts, and what the rendezvous
store reports (world size, standbys, progress, restarts, the memory checkpoints and their
restores, the goodput, the straggler).
"""

from __future__ import annotations

from collections.abc import Sequence

from kelastic.operator import checkpoint, goodput, straggler
from kelastic.operator.observed import PodPhase, PodView
from kelastic.operator.reconcile.actions import Emit
from kelastic.operator.reconcile.context import Pass
from kelastic.operator.status import Phase, progress_text


def replica_status(workers: Sequence[PodView], backoff_count: int) -> dict[str, int]:
    permanent_failed = sum(1 for w in workers if w.phase is PodPhase.FAILED)
    return {
        "active": sum(1 for w in workers if w.active),
        "ready": sum(1 for w in workers if w.active and w.ready),
        "succeeded": sum(1 for w in workers if w.phase is PodPhase.SUCCEEDED),
        "failed": backoff_count + permanent_failed,
    }


def rendezvous_figures(p: Pass) -> None:
    status = p.status
    rdzv = p.observed.rendezvous
    running = status.phase in (Phase.RUNNING.value, Phase.SCALING.value, Phase.RESTARTING.value)
    spec = p.job.spec
    if rdzv is not None and ((spec is not None and spec.standby_replicas) or rdzv.standbys):
        status.standbys = len(rdzv.standbys) if running else 0
    if rdzv is not None:
        status.world_size = rdzv.world_size if running else 0
        text = progress_text(rdzv.step, rdzv.total)
        if text is not None:
            status.progress = text
        figures, restored = checkpoint.checkpoint_status(status.checkpoint, rdzv.checkpoints)
        if figures is not None:
            status.checkpoint = figures
        if restored is not None:
            p.actions.append(Emit(reason=checkpoint.EVENT_RESTORED, message=restored))
        if running:
            figures_now = goodput.goodput_status(status.goodput, rdzv.goodputs, p.now.timestamp())
            if figures_now is not None:
                status.goodput = figures_now
            shown, event = straggler.straggler_status(status.straggler, rdzv.straggler)
            if shown is not None:
                status.straggler = shown
            if event is not None:
                p.actions.append(
                    Emit(reason=event[0], message=event[1], warning=event[0] == straggler.EVENT_STRAGGLER)
                )
    elif not running or status.world_size is None:
        status.world_size = 0
    # RE-FORMS counts re-forms of the worker group whatever their cause (a failure, a scale, a
    # lost or added pod): every rendezvous round after the first. The agents' failure restarts
    # and the recreated pods are a floor for when the store's rounds are unknown (or it restarted).
    agent_restarts = rdzv.restarts if rdzv is not None else 0
    rounds = rdzv.round - 1 if rdzv is not None else 0
    status.restarts = max(status.restarts or 0, (status.backoff_count or 0) + agent_restarts, rounds)
