"""Hang detection: workers that stopped reporting progress while the group is up (pure).

With ``kelastic-agent --hang-timeout SECONDS`` (the ElasticJob's
``spec.hangTimeoutSeconds``) the agent judges its local ranks on every turn of
its monitor loop from their progress reports (``kelastic.agent.progress.update``):

* only ranks that reported progress in the current attempt are judged: a rank
  that never reported (a script that does not call ``update``, or one still
  loading its data) is never called hung;
* the node is hung when every judged rank's latest report is older than the
  timeout. A rank blocked in a collective blocks its peers in the same
  collective, so in a hung job every node sees this at about the same time.

A hung node's agent stops its workers and restarts the group, spending one of
``--max-restarts``; the verdict (which global ranks, for how long) is published
with the node's progress so the operator can name the stalled ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kelastic.agent.progress import ProgressReport

__all__ = ["HangVerdict", "judge"]


@dataclass(frozen=True)
class HangVerdict:
    """Local ranks without progress for ``seconds`` (the freshest of them), judged at ``at`` (epoch s)."""

    local_ranks: tuple[int, ...]
    seconds: float
    at: float

    def describe(self, global_ranks: Mapping[int, int], timeout: float) -> str:
        ranks = ", ".join(str(global_ranks.get(lr, lr)) for lr in self.local_ranks)
        return f"rank(s) {ranks} reported no progress for {self.seconds:.0f}s (hang timeout {timeout:g}s)"


def judge(reports: Mapping[int, ProgressReport], *, now: float, timeout: float) -> HangVerdict | None:
    """The verdict on ``reports`` (local rank → latest report of this attempt), or None when not hung."""
    if timeout <= 0 or not reports:
        return None
    ages = {lr: now - r.time for lr, r in reports.items()}
    freshest = min(ages.values())
    if freshest < timeout:
        return None
    return HangVerdict(local_ranks=tuple(sorted(reports)), seconds=freshest, at=now)
