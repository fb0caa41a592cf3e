"""``status.straggler`` and the ``Straggler`` Events from the agents' straggler verdict (pure).

The agents judge stragglers themselves (``kelastic.agent.straggler``: the agent of group
rank 0 applies the rule and publishes its verdict in the rendezvous store,
``control.publish_straggler``); the operator only shows it. The verdict is a JSON object:
``node`` (the straggler's pod, or null once it recovered), ``ratio``, ``since`` (epoch
seconds), ``policy`` and ``action`` (``report``, ``replace``, ``replaced``). The status
keeps the latest one; an Event is emitted when its pod or action changes, so a verdict read
again on every pass, or by a restarted operator, is told once.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from kelastic.operator.spec import format_time

__all__ = ["EVENT_RECOVERED", "EVENT_REPLACED", "EVENT_STRAGGLER", "straggler_status"]

#: A pod is named a straggler (Warning).
EVENT_STRAGGLER = "Straggler"
#: The straggler stepped aside and a standby took its place.
EVENT_REPLACED = "StragglerReplaced"
#: The straggler's steps are back in line with the others'.
EVENT_RECOVERED = "StragglerRecovered"

_ACTIONS = ("report", "replace", "replaced")


def _message(node: str, ratio: object, since: str | None, action: str) -> tuple[str, str]:
    slow = f"pod {node}'s own work per step is {ratio}x the other members' median"
    if since is not None:
        slow += f" since {since}"
    if action == "replaced":
        return EVENT_REPLACED, f"{slow}: it stepped aside at a checkpoint and a standby took its place"
    if action == "replace":
        return EVENT_STRAGGLER, f"{slow}: it steps aside for a standby at the next checkpoint"
    return EVENT_STRAGGLER, f"{slow} (spec.stragglers policy Report, or no standby waits)"


def straggler_status(
    prior: Mapping[str, Any] | None, verdict: Mapping[str, object] | None
) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """``status.straggler`` for ``verdict`` (None: leave the status as it is), and the Event
    ``(reason, message)`` to emit when the verdict says something new (else None)."""
    if verdict is None:
        return None, None
    node, action = verdict.get("node"), verdict.get("action")
    before = (prior or {}).get("node"), (prior or {}).get("action")
    if not isinstance(node, str) or not node or action not in _ACTIONS:
        if before[0] is None or before[1] == "recovered":
            return None, None
        shown = {"node": before[0], "action": "recovered"}
        return shown, (EVENT_RECOVERED, f"pod {before[0]}'s steps are back in line with the other members'")
    assert isinstance(action, str)
    since_raw = verdict.get("since")
    since = (
        format_time(datetime.fromtimestamp(since_raw, tz=timezone.utc))
        if isinstance(since_raw, int | float) and not isinstance(since_raw, bool)
        else None
    )
    ratio = verdict.get("ratio")
    shown = {"node": node, "action": action, "policy": verdict.get("policy")}
    if isinstance(ratio, int | float) and not isinstance(ratio, bool):
        shown["ratio"] = float(ratio)
    if since is not None:
        shown["since"] = since
    shown = {k: v for k, v in shown.items() if v is not None}
    if before == (node, action):
        return shown, None
    return shown, _message(node, ratio, since, action)
