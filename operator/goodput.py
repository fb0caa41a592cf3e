"""The job's goodput in its status, from the goodput records its agents publish (pure functions).

Each agent publishes, with its progress record in the rendezvous store, what its node
saw (``kelastic.agent.goodput``): its step and when it reached it, its fault-free step
time, the seconds its workers waited on saves, and its latest restarts (where the group
stopped, where it went on). :func:`report` reads one such record, tolerating any key
missing or malformed; :func:`goodput_status` folds the current members' reports into
``status.goodput``, pass after pass. The definition (docs/operations.md):

* the accounting starts at the first step the operator sees (``since``, ``firstStep``);
* ``keptSteps``: the highest step the job reached since, minus ``firstStep`` (a step
  lost to a restore and done again counts once, when it is done past the highest);
* ``stepSeconds``: the fault-free step time, the median of the members' own (each the
  median of their recent step intervals without save stalls);
* ``productiveSeconds = keptSteps x stepSeconds``; ``elapsedSeconds``: from ``since`` to
  when the slowest member reported its step (its record's ``time``: it had done that many
  steps then), or to :data:`STALE_AFTER` seconds ago when no member reported for that long
  (a restart under way, a hung job: the clock runs on);
  ``ratio = productiveSeconds / elapsedSeconds``, shown as ``percent``;
* where the rest went: ``restartSeconds`` (per restart, from the last step before it
  to the first step after, less that step's own time), ``redoneSteps`` and
  ``redoneSeconds`` (steps done again after restores), ``saveStallSeconds`` (what the
  workers waited on saves). What these do not explain (slow steps) is the rest of
  ``elapsedSeconds - productiveSeconds``.

What must survive an operator restart is in the status itself: the counters, the last
restart counted (``lastResume``: every member reports the same restart, and keeps
reporting it) and each node's stall as last read (``nodes``: when its agent started, RFC 3339,
and its stall), so a stall is counted once. Every time in the status is an RFC 3339 string.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kelastic.operator.checkpoint import nonnegative, time_mark
from kelastic.operator.spec import parse_time

__all__ = [
    "SAME_RESUME_WINDOW",
    "STALE_AFTER",
    "STATUS_FIELD",
    "GoodputReport",
    "Resume",
    "goodput_status",
    "report",
]

#: The ElasticJob status field this module writes.
STATUS_FIELD = "goodput"
#: With no member's record newer than this (seconds), the elapsed time runs on with the clock.
STALE_AFTER = 15.0
#: Restarts reported resuming this close together (seconds) are one restart: the members
#: of a group take their first step together, and restarts are seconds apart.
SAME_RESUME_WINDOW = 1.0


@dataclass(frozen=True)
class Resume:
    """One restart as a node saw it: stopped after ``stopped_step`` at ``stopped_time``, went on
    with ``first_step`` at ``first_time`` (epoch seconds)."""

    stopped_step: int
    stopped_time: float
    first_step: int
    first_time: float


@dataclass(frozen=True)
class GoodputReport:
    """One member's goodput record with its step; None fields were not reported."""

    node: str
    step: int | None = None
    step_time: float | None = None
    #: When the record was made (epoch seconds): the node had done ``step`` steps then.
    time: float | None = None
    step_seconds: float | None = None
    stall: float = 0.0
    started: float | None = None
    resumes: tuple[Resume, ...] = ()


def _resume(raw: Any) -> Resume | None:
    if not isinstance(raw, list | tuple) or len(raw) != 4:
        return None
    values = [nonnegative(v) for v in raw]
    if any(v is None for v in values):
        return None
    a, b, c, d = (v for v in values if v is not None)
    return Resume(int(a), b, int(c), d)


def report(node: str, record: Mapping[str, Any]) -> GoodputReport:
    """Read one agent's goodput record; a missing or malformed key reads as not reported."""
    raw = record.get("resumes")
    resumes = tuple(r for r in (_resume(x) for x in raw) if r is not None) if isinstance(raw, list) else ()
    seconds = nonnegative(record.get("step_seconds"))
    step = nonnegative(record.get("step"))
    return GoodputReport(
        node=node,
        step=int(step) if step is not None else None,
        step_time=nonnegative(record.get("step_time")),
        time=nonnegative(record.get("time")),
        step_seconds=seconds if seconds else None,
        stall=nonnegative(record.get("stall")) or 0.0,
        started=nonnegative(record.get("started")),
        resumes=resumes,
    )


def _epoch(text: Any) -> float | None:
    when = parse_time(text) if isinstance(text, str) else None
    return when.timestamp() if when is not None else None


def _node_mark(rep: GoodputReport) -> dict[str, Any]:
    """What ``status.goodput.nodes`` keeps of a node: when its agent started and its stall."""
    mark: dict[str, Any] = {"stall": rep.stall}
    if rep.started is not None:
        mark["started"] = time_mark(rep.started)
    return mark


def _as_rfc3339(mark: Any) -> Any:
    """A node's mark with ``started`` as RFC 3339 (an earlier operator wrote epoch seconds)."""
    started = mark.get("started") if isinstance(mark, Mapping) else None
    if isinstance(started, int | float) and not isinstance(started, bool):
        return {**mark, "started": time_mark(float(started))}
    return mark


def _same_start(marked: Any, started: float | None) -> bool:
    """Whether the mark's ``started`` (RFC 3339, as :func:`time_mark` wrote it) is ``started``."""
    if started is None:
        return marked is None
    return isinstance(marked, str) and marked == time_mark(started)


def _new_resumes(reports: Sequence[GoodputReport], after: float) -> list[Resume]:
    """The restarts not counted yet, one per restart (the earliest report of each), oldest first."""
    fresh = sorted(
        (r for rep in reports for r in rep.resumes if r.first_time > after + SAME_RESUME_WINDOW),
        key=lambda r: r.first_time,
    )
    out: list[Resume] = []
    for r in fresh:
        if not out or r.first_time - out[-1].first_time > SAME_RESUME_WINDOW:
            out.append(r)
    return out


def goodput_status(
    prior: Mapping[str, Any] | None, reports: Sequence[GoodputReport], now: float
) -> dict[str, Any] | None:
    """``status.goodput`` after ``prior`` (the status as written; None: never), from the
    current members' reports, at ``now`` (epoch seconds). None while nothing was ever
    reported; ``prior`` unchanged (but ``elapsedSeconds`` and the ratio) while no member
    reports a step."""
    out: dict[str, Any] = dict(prior or {})
    stepped = [r for r in reports if r.step is not None and r.step_time is not None]
    since = _epoch(out.get("since"))
    nodes = {node: _as_rfc3339(mark) for node, mark in (out.get("nodes") or {}).items()}
    if since is None:
        if not stepped:
            return None
        slowest = min(stepped, key=lambda r: (r.step, r.step_time))
        assert slowest.step is not None and slowest.step_time is not None
        since = slowest.step_time
        out.update(
            since=time_mark(since),
            firstStep=slowest.step,
            highStep=slowest.step,
            restarts=0,
            restartSeconds=0.0,
            redoneSteps=0,
            saveStallSeconds=0.0,
            lastResume=time_mark(since),
        )
        # What the nodes stalled before the accounting began is not the job's to count.
        nodes = {r.node: _node_mark(r) for r in reports}
    seconds = [r.step_seconds for r in reports if r.step_seconds is not None]
    if seconds:
        out["stepSeconds"] = round(statistics.median(seconds), 6)
    step_seconds = out.get("stepSeconds")
    if stepped:
        out["highStep"] = max(int(out.get("highStep", 0)), min(r.step for r in stepped if r.step is not None))
    last = _epoch(out.get("lastResume")) or since
    for r in _new_resumes(reports, last):
        # The step the group stopped at was reached, whether or not a read saw it.
        out["highStep"] = max(int(out["highStep"]), r.stopped_step)
        out["restarts"] = int(out.get("restarts", 0)) + 1
        gap = r.first_time - r.stopped_time - (step_seconds or 0.0)
        out["restartSeconds"] = round(float(out.get("restartSeconds", 0.0)) + max(0.0, gap), 3)
        out["redoneSteps"] = int(out.get("redoneSteps", 0)) + max(0, r.stopped_step - r.first_step + 1)
        out["lastResume"] = time_mark(r.first_time)
    stall = float(out.get("saveStallSeconds", 0.0))
    for rep in reports:
        mark = nodes.get(rep.node)
        if isinstance(mark, Mapping) and _same_start(mark.get("started"), rep.started):
            stall += max(0.0, rep.stall - float(mark.get("stall") or 0.0))
        elif rep.started is not None and rep.started >= since:
            stall += rep.stall  # an agent that started since: all its stall is the job's
        nodes[rep.node] = _node_mark(rep)
    out["saveStallSeconds"] = round(stall, 3)
    out["nodes"] = nodes
    # Up to when the figures hold: the slowest member's record, unless every record is stale.
    as_of = now - STALE_AFTER
    if stepped:
        slowest = min(stepped, key=lambda r: (r.step, -(r.time or r.step_time or 0.0)))
        as_of = max(as_of, slowest.time or slowest.step_time or as_of)
    elapsed = max(float(out.get("elapsedSeconds", 0.0)), min(now, as_of) - since)
    kept = int(out["highStep"]) - int(out["firstStep"])
    out["elapsedSeconds"] = round(elapsed, 3)
    out["keptSteps"] = kept
    if step_seconds:
        productive = kept * float(step_seconds)
        out["productiveSeconds"] = round(productive, 3)
        out["redoneSeconds"] = round(int(out["redoneSteps"]) * float(step_seconds), 3)
        if kept > 0 and elapsed > 0:
            ratio = min(1.0, productive / elapsed)
            out["ratio"] = round(ratio, 4)
            out["percent"] = f"{100 * ratio:.1f}%"
    return out
