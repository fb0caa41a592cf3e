"""The agents' side of stragglers: rank 0 judges the group, a straggler steps aside for a standby.

Every agent publishes its node's goodput record (``work_seconds``: its own work per
step, :mod:`kelastic.agent.goodput`) to the rendezvous store. On its healthy monitor
ticks, at most once per ``period``:

* the agent of group rank 0 reads the group's status (members, standbys, goodput
  records), applies :func:`kelastic.agent.straggler.judge`, and publishes the verdict
  (``control.publish_straggler``: the straggler, its ratio, since when, the policy and the
  action) when there is one, and once more with no node when its straggler recovers.
  ``action`` is ``replace`` when the policy is ``Replace`` and a standby is parked, else
  ``report``. It runs in every ``kelastic-agent`` with the kelastic backend, operator or not;
  the operator only reads the record (job status, an Event);
* every agent reads the verdict; the one it names with ``replace`` in its own round waits
  for the group's next checkpoint commit (its own keeper sees the commit as the others
  do), then :meth:`StragglerWatch.tick` returns the reason to step aside: the agent calls
  the handler's ``step_aside()`` (fate ``left``: the others re-form at once with the
  standby in its place and restore the checkpoint just committed), records ``replaced``,
  stops its workers and re-joins as a standby. Without a memory checkpoint it steps aside
  at once; a commit that does not come within :data:`COMMIT_WAIT` seconds does not hold it.

Both records carry the job's MAC (``job_key``, as the progress reports do): the leader
judges from the goodput records the job signed only, and every agent takes only a verdict the
job signed, and none older than one it already took (a verdict replayed from earlier in the
round). So a stranger with access to the store cannot get a member swapped out.

Best effort like the progress publisher: a store that cannot be reached pauses the watch,
never the agent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kelastic.agent.progress_publisher import record_signer
from kelastic.agent.straggler import Policy, StragglerRule, StragglerState, judge

__all__ = ["COMMIT_WAIT", "StragglerWatch"]

_log = logging.getLogger(__name__)

#: The most a straggler waits for the next checkpoint commit before it steps aside anyway.
COMMIT_WAIT = 60.0
#: After the store could not be reached, the watch pauses this long (seconds).
PAUSE_AFTER_ERROR = 5.0
#: A goodput record older than this (seconds) is left out of the judgement: its node stopped.
STALE_RECORD = 15.0


class Commits(Protocol):
    """The node's checkpoint memory (``CheckpointKeeper``): the newest commit, and waiting for the next."""

    def cadence(self) -> tuple[int | None, float | None, float | None]: ...

    def wait_committed(self, after: int, timeout: float) -> bool: ...


def _connect(endpoint: str) -> Any:
    from kelastic.agent.rendezvous import control  # torch.distributed: only when watching

    return control.connect(endpoint, timeout=1.0)


def work_figures(goodputs: Mapping[str, Mapping[str, object]], now: float) -> dict[str, float]:
    """The members' ``work_seconds`` from their goodput records, fresh ones only (pure)."""
    out: dict[str, float] = {}
    for node, record in goodputs.items():
        work, made = record.get("work_seconds"), record.get("time")
        if isinstance(work, int | float) and isinstance(made, int | float) and now - made <= STALE_RECORD:
            out[node] = float(work)
    return out


def _time_of(verdict: Mapping[str, object] | None) -> float | None:
    made = None if verdict is None else verdict.get("time")
    return float(made) if isinstance(made, int | float) and not isinstance(made, bool) else None


class StragglerWatch:
    """One agent's part (see the module docstring); called from the agent's monitor loop only."""

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        node: str,
        rule: StragglerRule,
        *,
        commits: Commits | None = None,
        period: float = 1.0,
        connect: Callable[[str], Any] = _connect,
        clock: Callable[[], float] = time.time,
        job_key: bytes | None = None,
    ) -> None:
        self.endpoint, self.run_id, self.node, self.rule = endpoint, run_id, node, rule
        self._job_key = job_key
        self._signer: Any = None  # made with the first connection (it imports the rendezvous)
        self._commits = commits
        self._period = period
        self._connect = connect
        self._clock = clock
        self._store: Any = None
        self._next = 0.0
        self._round: int | None = None
        self._state = StragglerState()
        self._published: tuple[object, ...] | None = None
        self._verdict: Mapping[str, object] | None = None
        #: When the newest verdict taken was made: an older one is a verdict written back.
        self._latest = 0.0
        #: Waiting for a commit after this checkpoint (and until when) before stepping aside.
        self._aside: tuple[int, float] | None = None

    @property
    def verdict(self) -> Mapping[str, object] | None:
        """The group's latest straggler verdict this agent read (None: none)."""
        return self._verdict

    def tick(self, *, leader: bool, round_: int | None) -> str | None:
        """Judge (``leader``) and read the verdict when due; the reason to step aside now, or None.

        ``round_``: the round this node is a member of.
        """
        now = self._clock()
        if self._aside is None and now < self._next:
            return None
        if now >= self._next:
            self._next = now + self._period
            try:
                self._observe(leader, round_, now)
            except Exception as e:  # best effort: the store may be restarting
                self._store = None
                self._next = now + PAUSE_AFTER_ERROR
                _log.warning("straggler watch: could not reach the store at %s: %s", self.endpoint, e)
                return None
        return self._stepping_aside(round_)

    def _observe(self, leader: bool, round_: int | None, now: float) -> None:
        from kelastic.agent.rendezvous import control

        self._connected()
        if not leader:
            self._round = None
            self._take(control.read_straggler(self._store, self.run_id, self._signer))
            return
        status = control.read_status(self._store, self.run_id, self._signer)
        if status.round != self._round:
            self._round, self._state, self._published = status.round, StragglerState(), None
        self._state = judge(self._state, work_figures(dict(status.goodputs), now), now, self.rule)
        self._take(status.straggler)
        record = self._record(status.round, bool(status.standbys) or status.parked > 0)
        if record is not None:
            control.publish_straggler(self._store, self.run_id, record, self._signer)
            self._take(record)

    def _connected(self) -> None:
        if self._store is None:
            self._store = self._connect(self.endpoint)
        if self._signer is None:
            self._signer = record_signer(self._job_key)

    def _take(self, verdict: Mapping[str, object] | None) -> None:
        """Take ``verdict`` unless it is older than one taken before (a signed verdict written back)."""
        made = _time_of(verdict)
        if verdict is not None and (made is None or made < self._latest):
            return
        self._verdict = verdict
        self._latest = max(self._latest, made or 0.0)

    def _record(self, round_: int, standby: bool) -> dict[str, object] | None:
        """The verdict to publish now, or None (nothing new to say)."""
        st = self._state
        if st.straggler is None:
            if self._published is None or self._published[0] is None:
                return None
            self._published = (None,)
            return {"node": None, "round": round_, "policy": self.rule.policy.value, "time": self._clock()}
        action = "replace" if self.rule.policy is Policy.REPLACE and standby else "report"
        key = (st.straggler, action)
        if self._published == key:
            return None
        self._published = key
        _log.warning(
            "straggler: %s works %.1fx as long per step as the group's other members since %.0fs ago (%s)",
            st.straggler,
            st.ratio or 0.0,
            self._clock() - (st.suspect_since or self._clock()),
            "it steps aside for a standby at the next checkpoint" if action == "replace" else "reported",
        )
        return {
            "node": st.straggler,
            "round": round_,
            "ratio": round(st.ratio or 0.0, 3),
            "since": st.suspect_since,
            "declared": st.declared,
            "policy": self.rule.policy.value,
            "action": action,
            "time": self._clock(),
        }

    def _stepping_aside(self, round_: int | None) -> str | None:
        v = self._verdict
        named = (
            v is not None
            and v.get("node") == self.node
            and v.get("action") == "replace"
            and v.get("round") == round_
        )
        if not named:
            self._aside = None
            return None
        assert v is not None
        reason = f"{self.node} is a straggler (its work per step {v.get('ratio')}x the others')"
        if self._commits is None:
            return f"{reason}: it steps aside for a standby"
        if self._aside is None:
            latest, _, _ = self._commits.cadence()
            self._aside = (-1 if latest is None else latest, time.monotonic() + COMMIT_WAIT)
            _log.info(
                "straggler: %s steps aside after the next checkpoint (the newest is %s)", self.node, latest
            )
        after, deadline = self._aside
        if self._commits.wait_committed(after, min(0.5, max(0.0, deadline - time.monotonic()))):
            self._aside = None
            return f"{reason}: it steps aside for a standby at the checkpoint after {after}"
        if time.monotonic() >= deadline:
            self._aside = None
            return f"{reason}: it steps aside for a standby (no checkpoint after {after} within {COMMIT_WAIT:g}s)"
        return None

    def replaced(self, round_: int | None) -> None:
        """This node stepped aside from ``round_``: record ``replaced`` (best effort)."""
        from kelastic.agent.rendezvous import control

        v = dict(self._verdict or {})
        v.update(node=self.node, round=round_, action="replaced", time=self._clock())
        self._verdict = v
        try:
            self._connected()
            control.publish_straggler(self._store, self.run_id, v, self._signer)
        except Exception as e:  # the operator then sees the swap from the membership alone
            self._store = None
            _log.warning("straggler watch: could not record the swap: %s", e)

    def close(self) -> None:
        self._store = None
