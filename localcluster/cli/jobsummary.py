"""The per-job summary at the end of ``kelastic local run``: duration, restarts and their causes,
recoveries, and training speed at each world size.

The local cluster knows nothing of kelastic's code: it reads what any client can, the
ElasticJob's status (``phase``, ``worldSize``, ``restarts``, ``progress`` such as
``"120/500 (24%)"`` or ``"step 120"``) and the Events about the job. :class:`JobTimeline`
samples each job's status while ``run`` watches (about once a second); :func:`summarize`
turns the samples and Events into a :class:`JobSummary` (pure), :func:`render` into lines.

* **segments**: stretches of the run at one world size; each with its steps per second
  from its first step (or a restart from a checkpoint) to its last step change;
* **recoveries**: at each change of world size, the time from the last step change seen
  at the old size to the first step change at the new size (resuming from a checkpoint
  counts), which is what the change cost the training (detection, re-forming,
  restarting the workers); samples are a second apart, so this is exact to about 1 s;
* **causes**: the Events that explain restarts and replacements, counted by reason.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CAUSE_REASONS", "JobSample", "JobSummary", "JobTimeline", "Segment", "render", "summarize"]

#: Event reasons that explain a restart or a replaced pod, with how the summary words them.
CAUSE_REASONS: Mapping[str, str] = {
    "RecreateWorker": "worker failed and was recreated",
    "RecreateEvicted": "evicted worker recreated",
    "EvictionByEvictionAPI": "worker evicted (eviction API)",
    "PreemptionByScheduler": "worker preempted",
    "Evicted": "worker evicted by its node",
    "TerminationByKubelet": "worker ended by its node",
    "NoProgress": "ranks hung (no progress)",
    "StoreDied": "rendezvous store died and was recreated",
    "ScaleDown": "scaled down",
}

_STEP = re.compile(r"(?:step\s+)?(\d+)")


@dataclass(frozen=True)
class JobSample:
    """One look at a job's status at ``time`` (seconds, any monotonic origin)."""

    time: float
    phase: str | None
    world_size: int
    restarts: int
    step: int | None


@dataclass(frozen=True)
class Segment:
    """A stretch at one world size: ``start``..``end`` (seconds from the first sample)."""

    world_size: int
    start: float
    end: float
    steps_per_second: float | None


@dataclass(frozen=True)
class JobSummary:
    name: str
    phase: str | None
    duration: float
    restarts: int
    segments: tuple[Segment, ...]
    #: (world size before, after, seconds without a new step) at each change of world size.
    recoveries: tuple[tuple[int, int, float | None], ...]
    causes: tuple[tuple[str, int], ...] = field(default_factory=tuple)


def parse_step(progress: Any) -> int | None:
    """The step of a ``status.progress`` text (``"120/500 (24%)"``, ``"step 120"``), or None."""
    if not isinstance(progress, str):
        return None
    m = _STEP.match(progress.strip())
    return int(m.group(1)) if m else None


def sample_of(obj: Mapping[str, Any], now: float) -> JobSample:
    status = obj.get("status") or {}
    return JobSample(
        time=now,
        phase=status.get("phase"),
        world_size=int(status.get("worldSize") or 0),
        restarts=int(status.get("restarts") or 0),
        step=parse_step(status.get("progress")),
    )


def _rate(stepped: Sequence[JobSample], moves: Sequence[JobSample]) -> float | None:
    """Steps per second of a segment: from its first sample with a step (or the latest step
    going back, a restart from a checkpoint) to its last step change, so time spent waiting
    at the end of a size does not dilute its speed. ``stepped``: the segment's samples with a
    step; ``moves``: those whose step changed."""
    if not stepped or not moves:
        return None
    first = stepped[0]
    for m in moves:
        assert m.step is not None and first.step is not None
        if m.step < first.step:
            first = m
    last = moves[-1]
    if last.time <= first.time:
        return None
    assert first.step is not None and last.step is not None
    return max(0, last.step - first.step) / (last.time - first.time)


def _moves(samples: Sequence[JobSample]) -> list[JobSample]:
    """Samples whose step differs from the step seen before them: the training moved (a step
    back, to a checkpoint, is a move too: the workers run again)."""
    last: int | None = None
    out = []
    for s in samples:
        if s.step is not None and s.step != last:
            if last is not None:
                out.append(s)
            last = s.step
    return out


def summarize(
    name: str, samples: Sequence[JobSample], events: Iterable[Mapping[str, Any]] = ()
) -> JobSummary:
    """The summary of one job from its samples (in time order) and the Events about it."""
    t0 = samples[0].time if samples else 0.0
    runs: list[list[JobSample]] = []
    for s in samples:
        if s.world_size <= 0:
            continue
        if runs and runs[-1][-1].world_size == s.world_size:
            runs[-1].append(s)
        else:
            runs.append([s])
    moves = _moves(samples)
    segments = tuple(
        Segment(
            r[0].world_size,
            r[0].time - t0,
            r[-1].time - t0,
            _rate(
                [x for x in r if x.step is not None],
                [m for m in moves if r[0].time <= m.time <= r[-1].time and m.world_size == r[0].world_size],
            ),
        )
        for r in runs
    )
    recoveries = []
    for before, after in itertools.pairwise(runs):
        last_old = [m for m in moves if m.time <= before[-1].time]
        first_new = [m for m in moves if m.time >= after[0].time and m.world_size == after[0].world_size]
        gap = first_new[0].time - last_old[-1].time if last_old and first_new else None
        recoveries.append((before[0].world_size, after[0].world_size, gap))
    counts: Counter[str] = Counter()
    for e in events:
        if e.get("reason") in CAUSE_REASONS:  # an aggregated Event stands for ``count`` of them
            counts[str(e["reason"])] += max(1, int(e.get("count") or 1))
    return JobSummary(
        name=name,
        phase=samples[-1].phase if samples else None,
        duration=(samples[-1].time - t0) if samples else 0.0,
        restarts=max((s.restarts for s in samples), default=0),
        segments=segments,
        recoveries=tuple(recoveries),
        causes=tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def render(summary: JobSummary) -> list[str]:
    """Indented lines for the run's summary."""
    lines = [
        f"  job {summary.name}: {summary.phase or 'no phase'} after {summary.duration:.1f}s, "
        f"{summary.restarts} re-form(s)"
    ]
    if summary.causes:
        causes = ", ".join(f"{CAUSE_REASONS[r]} x{n}" for r, n in summary.causes)
        lines.append(f"    causes: {causes}")
    for seg in summary.segments:
        rate = (
            "no progress reported" if seg.steps_per_second is None else f"{seg.steps_per_second:.2f} steps/s"
        )
        lines.append(f"    world size {seg.world_size:>3} from {seg.start:6.1f}s to {seg.end:6.1f}s: {rate}")
    for old, new, gap in summary.recoveries:
        took = "no step seen on both sides" if gap is None else f"{gap:.1f}s from the last step to the next"
        lines.append(f"    recovery {old} -> {new}: {took}")
    return lines


class JobTimeline:
    """Samples of every watched ElasticJob's status (``observe``), by job name."""

    def __init__(self) -> None:
        self.samples: dict[str, list[JobSample]] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}

    def observe(self, obj: Mapping[str, Any], now: float) -> None:
        name = str((obj.get("metadata") or {}).get("name"))
        self.samples.setdefault(name, []).append(sample_of(obj, now))

    def set_events(self, name: str, events: Iterable[Mapping[str, Any]]) -> None:
        self.events[name] = [dict(e) for e in events]

    def lines(self) -> list[str]:
        out: list[str] = []
        for name, samples in self.samples.items():
            out += render(summarize(name, samples, self.events.get(name, ())))
        return out
