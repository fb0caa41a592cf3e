"""The straggler rule of ``kelastic-agent --stragglers`` and of ``spec.stragglers`` (pure).

One type for both ends: the operator parses ``spec.stragglers`` into a :class:`StragglerRule`
and writes its :meth:`StragglerRule.to_text` as the agents' flag, which :func:`parse_rule`
reads back. What the rule decides is :mod:`kelastic.agent.straggler`'s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Policy", "StragglerRule", "parse_rule"]


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
