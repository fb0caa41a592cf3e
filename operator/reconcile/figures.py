"""The figures the status shows every pass: the replica counts, and what the rendezvous
store reports (world size, standbys, progress, restarts, the memory checkpoints and their
restores, the goodput, the straggler, why the group last restarted after a failure).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from kelastic.operator import checkpoint, goodput, straggler
from kelastic.operator.observed import PodPhase, PodView
from kelastic.operator.reconcile.actions import Emit
from kelastic.operator.reconcile.context import Pass
from kelastic.operator.spec import parse_time
from kelastic.operator.status import Phase, progress_text

#: The Warning Event of a worker group restarted after a failure, with its agent's reason
#: (``kelastic.agent.oom`` names a rank killed at its container's memory limit: "OOM-killed").
EVENT_RESTARTED = "WorkersRestarted"


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
        latest, said = failure_restarts(status.last_failure, rdzv.failures)
        if latest is not None:
            status.last_failure = latest
        p.actions.extend(Emit(reason=EVENT_RESTARTED, message=m, warning=True) for m in said)
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


def failure_restarts(
    last: Mapping[str, Any] | None, failures: Sequence[tuple[str, str, float]]
) -> tuple[dict[str, Any] | None, list[str]]:
    """The agents' restarts after a failure newer than ``last`` (``status.lastFailure``):
    the new ``lastFailure`` (None when nothing is new) and one Event message each (pure).

    ``lastFailure`` is ``{node, reason, time}``, ``time`` when the group re-formed (RFC 3339,
    ms), so an operator that restarts or takes over never says a restart twice."""
    since = parse_time((last or {}).get("time"))
    floor = since.timestamp() + 0.001 if since is not None else None  # the stored time is cut to ms
    fresh = sorted((f for f in failures if floor is None or f[2] > floor), key=lambda f: f[2])
    if not fresh:
        return None, []
    node, reason, at = fresh[-1]
    when = datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {"node": node, "reason": reason, "time": when}, [
        f"{n} restarted its workers: {r}" for n, r, _ in fresh
    ]
