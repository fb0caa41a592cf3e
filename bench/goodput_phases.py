"""Where the time between a fault and the first step after it goes (pure; bench_goodput prints it).

The bench's inputs are timestamped records from three sources, each a dict with ``t`` (epoch
seconds) and ``node``:

* the agents' events (``$KELASTIC_EVENTS_FILE``, one file per agent incarnation), renamed to
  ``e`` = the event's name without its ``kelastic.agent.`` prefix: ``fault_noticed`` (its
  workers failed, or its group lost a member), ``restart`` (the re-form starts: the workers
  are stopped), ``workers_stopped`` (``stopped_at``: when they were gone), ``rendezvous`` (ranks assigned; it carries the rendezvous phases
  ``rdzv_joined`` and ``rdzv_closed``), ``workers_started``;
* every rank's phases (the bench worker's ``phases.jsonl``): ``began`` (its main ran),
  ``pg`` (``init_process_group`` returned), ``restored`` (its state is restored), ``step``
  (its first step is complete).

:func:`breakdown` takes, for a fault at ``T``, each phase's first record per node after ``T``
(and before the next fault) and reports the phase's instant as milliseconds after ``T``: the
earliest node for what one node starts (noticed, re-form started, first step), the latest node
of the group that stepped after the fault for what the whole group waits on (workers stopped, joined, group decided, ranks, workers started, main,
process group, restore). The old workers stop while their node joins the next round
(``kelastic.agent.reform``), so "stopped" may come after "joined".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PHASES", "Phase", "breakdown", "table"]


@dataclass(frozen=True)
class Phase:
    """A column of the breakdown: its label, where its instant comes from, and whether the
    first node's (``first``) or the last node's instant counts."""

    label: str
    event: str
    field: str = "t"
    first: bool = False


PHASES: tuple[Phase, ...] = (
    Phase("noticed", "fault_noticed", first=True),
    Phase("re-form", "restart", first=True),
    Phase("stopped", "workers_stopped", "stopped_at"),
    Phase("joined", "rendezvous", "rdzv_joined"),
    Phase("decided", "rendezvous", "rdzv_closed"),
    Phase("ranks", "rendezvous"),
    Phase("started", "workers_started"),
    Phase("main", "began"),
    Phase("pg ready", "pg"),
    Phase("restored", "restored"),
    Phase("step", "step", first=True),
)


def _instants(
    records: Iterable[Mapping[str, Any]], phase: Phase, after: float, before: float
) -> dict[str, float]:
    """Each node's first instant of ``phase`` in (after, before)."""
    per_node: dict[str, float] = {}
    for rec in sorted(records, key=lambda r: float(r["t"])):
        if rec.get("e") != phase.event:
            continue
        value = rec.get(phase.field)
        if not isinstance(value, (int, float)) or not after < rec["t"] < before or value <= after:
            continue
        per_node.setdefault(str(rec.get("node", "?")), float(value))
    return per_node


def breakdown(
    records: Sequence[Mapping[str, Any]], faults: Sequence[float], end: float
) -> list[dict[str, float | None]]:
    """For each fault instant (sorted), each phase's label -> ms after the fault (None: not seen
    before the next fault, or before ``end`` for the last)."""
    rows = []
    for i, at in enumerate(faults):
        until = faults[i + 1] if i + 1 < len(faults) else end
        row: dict[str, float | None] = {}
        # The group the fault's re-form made: the nodes that stepped after it (a replacement
        # that starts its workers to wait as a standby is not waited on).
        group = set(_instants(records, PHASES[-1], at, until))
        for phase in PHASES:
            instants = _instants(records, phase, at, until)
            seen = [t for node, t in instants.items() if phase.first or not group or node in group]
            if seen:
                row[phase.label] = round(1000 * ((min(seen) if phase.first else max(seen)) - at))
            else:
                row[phase.label] = None
        rows.append(row)
    return rows


def table(kinds: Sequence[str], rows: Sequence[Mapping[str, float | None]]) -> list[str]:
    """The breakdown as text lines: a fault per row, ms after it per phase ('-': not seen)."""
    labels = [p.label for p in PHASES]
    width = max(9, *(len(label) + 1 for label in labels))
    lines = [f"{'fault':16s}" + "".join(f"{label:>{width}s}" for label in labels)]
    for i, (kind, row) in enumerate(zip(kinds, rows, strict=True)):
        cells = "".join(
            f"{'-' if row.get(label) is None else f'{row[label]:.0f}':>{width}s}" for label in labels
        )
        lines.append(f"{f'{i + 1} {kind}':16s}{cells}")
    return lines
