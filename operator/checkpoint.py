"""The job's memory checkpoint in its status, from what the agents report (pure functions).

Each agent publishes, with its progress record in the rendezvous store, its node's view
of the memory checkpoint (``kelastic.agent.rendezvous.control.publish_progress``): the
newest complete checkpoint it knows and its latest restore. :func:`report` reads one such
record, tolerating any key missing or malformed (older agents publish none);
:func:`checkpoint_status` turns the current members' reports into ``status.checkpoint``
and, once per restore, the text of a ``CheckpointRestored`` Event.

Once per restore, across operator restarts: every member of a round restores and keeps
reporting its latest restore for as long as it runs, so a restore is marked in the status
(``restoredTime``, when it ended) and a report of the same checkpoint ending within
:data:`SAME_RESTORE_WINDOW` of the mark is the same restore. Reports that arrive after the
Event (a slower pod) still update ``restoredFrom`` and ``restoredSeconds``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kelastic.operator.spec import parse_time

__all__ = [
    "EVENT_RESTORED",
    "SAME_RESTORE_WINDOW",
    "STATUS_FIELD",
    "CheckpointReport",
    "Restore",
    "Source",
    "checkpoint_status",
    "nonnegative",
    "report",
    "time_mark",
]

#: The ElasticJob status field this module writes.
STATUS_FIELD = "checkpoint"
#: The reason of the Event posted once per restore.
EVENT_RESTORED = "CheckpointRestored"
#: Restores of one checkpoint reported ending this close together (seconds) are one restore:
#: the pods of a round load together, the ones reading a peer's or the durable copy a little later.
SAME_RESTORE_WINDOW = 10.0


class Source(str, enum.Enum):
    """Where a pod read the checkpoint it restored, nearest first."""

    MEMORY = "memory"  # its own agent's memory
    REPLICA = "replica"  # a peer's copy of its part
    DURABLE = "durable"  # spec.checkpoint.persist.path

    @property
    def rank(self) -> int:
        return list(Source).index(self)

    def phrase(self) -> str:
        return {
            Source.MEMORY: "from memory",
            Source.REPLICA: "from a peer's replica",
            Source.DURABLE: "from the durable copy",
        }[self]


@dataclass(frozen=True)
class Restore:
    """One pod's latest restore: checkpoint ``id`` read from ``source`` in ``seconds``, ended at ``time``."""

    id: int
    source: Source
    seconds: float
    time: float  # seconds since the epoch


@dataclass(frozen=True)
class CheckpointReport:
    """One pod's view of the checkpoint (its agent's record); None fields were not reported."""

    node: str
    latest: int | None = None
    step: int | None = None
    restored: Restore | None = None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def nonnegative(value: Any) -> float | None:
    """``value`` as a float when it is a non-negative number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value)


def report(node: str, record: Mapping[str, Any]) -> CheckpointReport:
    """Read one agent's checkpoint record; a missing or malformed key reads as not reported."""
    restored: Restore | None = None
    raw = record.get("restored")
    if isinstance(raw, Mapping):
        rid, seconds, ended = (
            _int(raw.get("id")),
            nonnegative(raw.get("seconds")),
            nonnegative(raw.get("time")),
        )
        try:
            source = Source(raw.get("source"))
        except ValueError:
            source = None
        if rid is not None and source is not None and seconds is not None and ended is not None:
            restored = Restore(rid, source, seconds, ended)
    return CheckpointReport(node, _int(record.get("latest")), _int(record.get("step")), restored)


def time_mark(when: float) -> str:
    """Epoch seconds as RFC 3339 with milliseconds, in UTC (``Z``)."""
    return (
        datetime.fromtimestamp(when, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def _message(restores: Sequence[Restore], step: int | None) -> str:
    """``restored checkpoint 12 (step 340) from a peer's replica in 0.4 s`` (several sources named)."""
    first = restores[0]
    at_step = f" (step {step})" if step is not None else ""
    seconds = max(r.seconds for r in restores)
    sources = sorted({r.source for r in restores}, key=lambda s: s.rank)
    if len(sources) == 1:
        where = sources[0].phrase()
    else:
        counts = [f"{sum(1 for r in restores if r.source is s)} {s.phrase()}" for s in sources]
        where = f"on {len(restores)} pods: {', '.join(counts)},"
    return f"restored checkpoint {first.id}{at_step} {where} in {seconds:.1f} s"


def checkpoint_status(
    prior: Mapping[str, Any] | None, reports: Iterable[CheckpointReport]
) -> tuple[dict[str, Any] | None, str | None]:
    """``status.checkpoint`` from the members' reports, and an Event message for a new restore.

    ``prior`` is the job's ``status.checkpoint`` as written (None: never). Returns
    ``(None, None)`` when no member reported a checkpoint record (an older agent, or none
    yet): the status keeps what it had. ``latest`` is the newest id any member knows,
    ``step`` the step reported with it. A restore newer than ``prior``'s ``restoredTime``
    (see the module doc) sets ``restoredId``, ``restoredFrom`` (the farthest source of its
    pods), ``restoredSeconds`` (the slowest pod) and ``restoredTime``, and returns the
    Event's message; a late report of the marked restore updates them without a message.
    """
    reports = list(reports)
    if not reports:
        return None, None
    out: dict[str, Any] = dict(prior or {})
    known = [r for r in reports if r.latest is not None]
    if known:
        newest = max(known, key=lambda r: (r.latest, r.step is not None))
        out["latest"] = newest.latest
        if newest.step is not None:
            out["step"] = newest.step
        else:
            out.pop("step", None)
    when = parse_time(out.get("restoredTime"))
    mark = when.timestamp() if when is not None else None
    marked_id = out.get("restoredId")
    restores = [r.restored for r in reports if r.restored is not None]

    def same_as_marked(r: Restore) -> bool:
        return mark is not None and r.id == marked_id and abs(r.time - mark) <= SAME_RESTORE_WINDOW

    fresh = [r for r in restores if (mark is None or r.time > mark) and not same_as_marked(r)]
    message: str | None = None
    if fresh:
        latest = max(fresh, key=lambda r: r.time)
        group = [r for r in fresh if r.id == latest.id and latest.time - r.time <= SAME_RESTORE_WINDOW]
        group.sort(key=lambda r: r.time)
        step = out.get("step") if out.get("latest") == latest.id else None
        message = _message(group, step)
        out["restoredId"] = latest.id
        out["restoredTime"] = time_mark(latest.time)
    else:
        group = [r for r in restores if same_as_marked(r)]
    if group:
        farthest = max(group, key=lambda r: r.source.rank).source
        before = out.get("restoredFrom")
        if message is None and before in {s.value for s in Source}:
            farthest = max(farthest, Source(before), key=lambda s: s.rank)
        out["restoredFrom"] = farthest.value
        slowest = max(r.seconds for r in group)
        if message is None and isinstance(out.get("restoredSeconds"), int | float):
            slowest = max(slowest, float(out["restoredSeconds"]))
        out["restoredSeconds"] = round(slowest, 3)
    return out, message
