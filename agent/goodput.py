"""What a node saw of the job's goodput, for its progress record (pure bookkeeping).

The agent feeds a :class:`GoodputLedger` with its local ranks' progress reports
(:class:`kelastic.agent.progress.ProgressReport`: the step, when it was reached, the
seconds the rank waited on saves, and the first step its process reported) and tells
it when it restarts its workers. The ledger keeps:

* the node's current step and when its slowest rank reached it;
* ``step_seconds``: the node's fault-free step time, the median over recent intervals
  between two reports of one attempt of ``(time - save stall) / steps`` (a save or a
  restart inside an interval does not lengthen it);
* ``work_seconds``: the node's own work per step, the median over its last few intervals
  of the current attempt of ``(time - save stall - waits on peers) / steps``, where the
  waits are what its ranks reported with ``progress.waited``/``progress.waiting`` (the
  least of its ranks'): in a synchronous group every member's step takes as long as the
  slowest member's, so this is what tells a straggler (:mod:`kelastic.agent.straggler`);
  without reported waits it equals the step time;
* ``stall``: the seconds its workers waited on saves, summed over its attempts (each
  attempt's figure is its slowest rank's);
* ``resumes``: for each restart of its workers, where the group stopped (the last step
  its ranks reported before and when) and where it went on (the first step the new
  workers reported and when). A node that joined a running job has no stop to tell:
  its first attempt accounts nothing, the group's older members do.

``record()`` is the JSON object the agent publishes under ``"goodput"`` in its
progress record (with ``time``, when it was made: the node had done ``step`` steps then); the operator (``kelastic.operator.goodput``) turns the members'
records into the job's ``status.goodput``. The definitions are in docs/operations.md.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from .progress import ProgressReport

__all__ = ["GoodputLedger", "Point", "Resume"]

#: Step intervals the step time is the median of.
SAMPLES = 64
#: Step intervals the work per step is the median of: few, so a member that slows down
#: shows within a few intervals.
WORK_SAMPLES = 3
#: Restarts kept in the record: the operator reads it every few seconds and dedupes, so a
#: few restarts in a row between two reads are all seen.
RESUMES = 8


@dataclass(frozen=True)
class Point:
    """A step the node's slowest rank reached, when (epoch seconds), its attempt's stall so
    far, and the least any of its ranks waited on peers so far."""

    step: int
    time: float
    stall: float
    wait: float = 0.0


@dataclass(frozen=True)
class Resume:
    """One restart as this node saw it: the group stopped after ``stopped_step`` (reported at
    ``stopped_time``) and went on with ``first_step`` (reported at ``first_time``)."""

    stopped_step: int
    stopped_time: float
    first_step: int
    first_time: float

    def to_json(self) -> list[float]:
        return [self.stopped_step, round(self.stopped_time, 3), self.first_step, round(self.first_time, 3)]


def node_point(reports: Mapping[int, ProgressReport]) -> Point | None:
    """The node's slowest rank's step, when it reached it, and the slowest rank's stall (pure)."""
    if not reports:
        return None
    step = min(r.step for r in reports.values())
    reached = max(r.time for r in reports.values() if r.step == step)
    return Point(step, reached, max(r.stall for r in reports.values()), min(r.wait for r in reports.values()))


def node_first(reports: Mapping[int, ProgressReport]) -> tuple[int, float] | None:
    """The attempt's first step: the latest of its ranks' first reports (they step together)."""
    firsts = [r.first for r in reports.values() if r.first is not None]
    if not firsts:
        return None
    return min(s for s, _ in firsts), max(t for _, t in firsts)


class GoodputLedger:
    """One node's goodput bookkeeping over its attempts (see the module docstring); not thread-safe."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.time() if started is None else started
        self._current: Point | None = None
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        self._work: deque[float] = deque(maxlen=WORK_SAMPLES)  # the current attempt's
        self._stall_before = 0.0  # the finished attempts' stall
        self._stop: Point | None = None  # where the group stopped, until the next attempt reports
        self._resumes: deque[Resume] = deque(maxlen=RESUMES)

    def observe(self, reports: Mapping[int, ProgressReport]) -> None:
        """The current attempt's reports, as read now."""
        point = node_point(reports)
        if point is None:
            return
        last = self._current
        if last is not None and point.step > last.step and point.time > last.time:
            busy = (point.time - last.time) - max(0.0, point.stall - last.stall)
            if busy > 0:
                self._samples.append(busy / (point.step - last.step))
                work = busy - max(0.0, point.wait - last.wait)
                self._work.append(max(0.0, work) / (point.step - last.step))
        self._current = point
        if self._stop is not None:
            first = node_first(reports)
            if first is not None:
                stop = self._stop
                self._resumes.append(Resume(stop.step, stop.time, first[0], first[1]))
                self._stop = None

    def restarted(self, final: Mapping[int, ProgressReport]) -> None:
        """The workers are restarted; ``final``: the ended attempt's reports as they were left."""
        self.observe(final)
        if self._current is not None:
            self._stall_before += self._current.stall
            self._stop = Point(self._current.step, self._current.time, 0.0)
        self._current = None
        self._work.clear()  # another group, maybe other peers to wait for

    @property
    def step_seconds(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None

    @property
    def work_seconds(self) -> float | None:
        return statistics.median(self._work) if self._work else None

    @property
    def stall(self) -> float:
        return self._stall_before + (self._current.stall if self._current is not None else 0.0)

    def record(self) -> dict[str, object]:
        """The ``"goodput"`` object of the node's progress record."""
        seconds = self.step_seconds
        current = self._current
        return {
            "time": round(time.time(), 3),
            "started": round(self.started, 3),
            "step": current.step if current is not None else None,
            "step_time": round(current.time, 3) if current is not None else None,
            "step_seconds": round(seconds, 6) if seconds is not None else None,
            "work_seconds": round(self.work_seconds, 6) if self.work_seconds is not None else None,
            "stall": round(self.stall, 6),
            "resumes": [r.to_json() for r in self._resumes],
        }
