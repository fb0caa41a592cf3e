"""Stalled ranks: what the agents' hang verdicts say about a job (pure).

With ``spec.hangTimeoutSeconds`` every agent judges its ranks (``kelastic.agent.hang``)
and publishes its verdict with its progress; the operator reads the current
members' verdicts from the store. Verdicts judged within ``hangTimeoutSeconds``
of the latest one belong to the same hang (every node of a hung job sees it at
about the same time). The job's ``Stalled`` condition names the ranks and nodes
of the latest hang while it is recent (:func:`remembered_for`), then turns False.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

__all__ = ["CONDITION_STALLED", "Stall", "remembered_for", "summarize"]

#: The ElasticJob condition naming the ranks of the latest hang.
CONDITION_STALLED = "Stalled"


@dataclass(frozen=True)
class Stall:
    """The latest hang of a job: its ranks and nodes, the longest silence, when it was judged."""

    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    seconds: float
    at: float

    def message(self, timeout: int) -> str:
        when = datetime.fromtimestamp(self.at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        ranks = ", ".join(str(r) for r in self.ranks)
        return (
            f"rank(s) {ranks} (on {', '.join(self.nodes)}) reported no progress for {self.seconds:.0f}s "
            f"(spec.hangTimeoutSeconds={timeout}); the agents restarted the worker group at {when}"
        )


def remembered_for(timeout: int) -> float:
    """How long after a hang the ``Stalled`` condition stays True (seconds)."""
    return max(60.0, 2.0 * timeout)


def summarize(hangs: Sequence[tuple[str, tuple[int, ...], float, float]], timeout: int) -> Stall | None:
    """The latest hang among verdicts ``(node, ranks, seconds, at)``, or None without any."""
    if not hangs:
        return None
    latest = max(at for *_, at in hangs)
    same = [h for h in hangs if latest - h[3] <= timeout]
    return Stall(
        ranks=tuple(sorted({r for _, ranks, _, _ in same for r in ranks})),
        nodes=tuple(sorted({node for node, *_ in same})),
        seconds=max(seconds for _, _, seconds, _ in same),
        at=latest,
    )
