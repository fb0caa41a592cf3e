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

import enum
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "Policy",
    "StragglerRule",
    "StragglerState",
    "judge",
    "parse_rule",
    "ratios",
]


class Policy(enum.Enum):
    """What kelastic does about a straggler (``spec.stragglers.policy``)."""

    REPORT = "Report"
    REPLACE = "Replace"


@dataclass(frozen=True)
class StragglerRule:
    """The threshold (``ratio``, > 1) and the ``window`` (seconds) of :func:`judge`, and the policy."""

    policy: Policy = Policy.REPORT
    ratio: float = 1.5
    window: float = 10.0

    def __post_init__(self) -> None:
        if not self.ratio > 1.0:
            raise ValueError(f"a straggler's ratio must be above 1 (got {self.ratio:g})")
        if not self.window >= 0.0:
            raise ValueError(f"a straggler's window must be 0 seconds or more (got {self.window:g})")

    @property
    def clear_ratio(self) -> float:
        """Below this ratio a straggler is one no longer (half way between 1 and ``ratio``)."""
        return 1.0 + (self.ratio - 1.0) / 2.0

    def to_text(self) -> str:
        """The ``--stragglers`` form, e.g. ``policy=Replace,ratio=1.5,window=10``."""
        return f"policy={self.policy.value},ratio={self.ratio:g},window={self.window:g}"


def parse_rule(text: str) -> StragglerRule:
    """Parse ``policy=Report|Replace,ratio=R,window=SECONDS`` (any subset; the rest default).

    Raises ValueError naming what is wrong and what is accepted.
    """
    fields: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("policy", "ratio", "window"):
            raise ValueError(
                f"bad straggler setting {part!r} in {text!r}: expected policy=Report|Replace, ratio=R, window=SECONDS"
            )
        fields[key.strip()] = value.strip()
    policies = {p.value.lower(): p for p in Policy}
    policy = fields.get("policy", Policy.REPORT.value)
    if policy.lower() not in policies:
        raise ValueError(f"bad straggler policy {policy!r}: expected Report or Replace")
    try:
        return StragglerRule(
            policy=policies[policy.lower()],
            ratio=float(fields.get("ratio", StragglerRule.ratio)),
            window=float(fields.get("window", StragglerRule.window)),
        )
    except ValueError as e:
        raise ValueError(f"bad straggler settings {text!r}: {e}") from e


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
