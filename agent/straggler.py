"""Stragglers: which member of a group is consistently slower than the others (pure).

In a synchronous group every member's step takes as long as the slowest member's: the
others wait for it in the collectives. So the step time does not tell who is slow; what
each member spent on its *own work* per step does (the step time less the seconds its
ranks waited on their peers, ``work_seconds`` of its goodput record,
:mod:`kelastic.agent.goodput`, fed by ``progress.waiting()``).

The rule, applied by :func:`judge` to the members' latest ``work_seconds`` (a median over
their last few step intervals) at each observation:

* a member's *ratio* is its work per step divided by the median of the other members';
  with fewer than two members reporting there is no ratio and nobody is suspected;
* the member with the largest ratio is *suspected* once its ratio reaches
  :attr:`StragglerRule.ratio`; it stays suspected while it remains the slowest at that
  ratio, and any observation below it (or another member slowest) ends the suspicion;
* a member suspected without interruption for :attr:`StragglerRule.window` seconds is the
  group's *straggler*; one slow step does not make one: the work figure is a median over
  several intervals, and the window asks for it to last;
* hysteresis: a straggler stays one until its ratio drops below
  :attr:`StragglerRule.clear_ratio` (half way between 1 and ``ratio``), so a member that
  hovers around the threshold is neither declared nor cleared on every observation.

What follows a straggler is the rule's :class:`Policy`: ``Report`` (job status, an Event,
a metric) or ``Replace`` (reported too, and when the job has a standby, the straggler
steps aside at the next checkpoint and the standby takes its place:
:mod:`kelastic.agent.straggler_watch`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from .stragglerrule import Policy, StragglerRule, parse_rule

__all__ = [
    "Policy",
    "StragglerRule",
    "StragglerState",
    "judge",
    "parse_rule",
    "ratios",
]


@dataclass(frozen=True)
class StragglerState:
    """What :func:`judge` carries from one observation to the next.

    ``suspect`` (since ``suspect_since``, seconds) is slowest at the rule's ratio now;
    ``straggler`` (declared at ``declared``) is the group's straggler; ``ratio``: the
    slowest member's ratio at the latest observation (None without one).
    """

    suspect: str | None = None
    suspect_since: float | None = None
    straggler: str | None = None
    declared: float | None = None
    ratio: float | None = None


def ratios(work: Mapping[str, float]) -> dict[str, float]:
    """Each member's work per step over the median of the others' (pure); empty below two members.

    Members with no figure or a figure of 0 or less are left out.
    """
    known = {name: w for name, w in work.items() if w is not None and w > 0}
    if len(known) < 2:
        return {}
    out: dict[str, float] = {}
    for name, w in known.items():
        others = statistics.median(v for n, v in known.items() if n != name)
        out[name] = w / others
    return out


def judge(
    state: StragglerState, work: Mapping[str, float], now: float, rule: StragglerRule
) -> StragglerState:
    """The state after observing the members' ``work`` (seconds per step) at ``now`` (see the module doc)."""
    by_member = ratios(work)
    if not by_member:
        return StragglerState()
    slowest = max(by_member, key=lambda n: (by_member[n], n))
    ratio = by_member[slowest]
    held = state.straggler
    if held is not None and by_member.get(held, 0.0) >= rule.clear_ratio:
        return StragglerState(held, state.suspect_since, held, state.declared, by_member[held])
    if ratio < rule.ratio:
        return StragglerState(ratio=ratio)
    since = state.suspect_since if state.suspect == slowest and state.suspect_since is not None else now
    if now - since >= rule.window:
        return StragglerState(slowest, since, slowest, now, ratio)
    return StragglerState(slowest, since, None, None, ratio)
