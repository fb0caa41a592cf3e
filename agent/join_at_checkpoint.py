"""Holding a restart for joining nodes until the group's next checkpoint is committed.

When nodes wait to join a group that saves memory checkpoints at a steady pace, the group
keeps training and re-forms right after its next checkpoint, so that the grown group
restores it and redoes no step (:func:`~kelastic.agent.restart_policy.defer_join` decides
whether and how long). :class:`JoinAtCheckpoint` is that wait as the agent's monitor loop
applies it, one tick at a time.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from kelastic.agent import restart_policy
from kelastic.agent.restart_policy import Action, JoinDeferral, Verdict

__all__ = ["CheckpointCommits", "JoinAtCheckpoint"]

_log = logging.getLogger(__name__)


class CheckpointCommits(Protocol):
    """The node's checkpoint memory as the restart loop sees it (kelastic's
    :class:`~kelastic.agent.checkpoint.keeper.CheckpointKeeper`)."""

    def cadence(self) -> tuple[int | None, float | None, float | None]:
        """The newest committed checkpoint, seconds since its commit, seconds between the
        two latest commits (None where unknown)."""
        ...

    def wait_committed(self, after: int, timeout: float) -> bool:
        """Block up to ``timeout`` s until a checkpoint newer than ``after`` is committed."""
        ...


class JoinAtCheckpoint:
    """The deferral in progress, if any: what it waits for and until when.

    :meth:`hold` is called on every healthy tick whose verdict is a restart for joining
    nodes; :meth:`active` tells the loop a deferral was under way when the workers failed
    (a peer that re-formed first stopped them), :meth:`cancel` forgets it.
    """

    def __init__(self, commits: CheckpointCommits) -> None:
        self._commits = commits
        self._deferral: tuple[JoinDeferral, float] | None = None

    @property
    def active(self) -> bool:
        return self._deferral is not None

    def cancel(self) -> None:
        self._deferral = None

    def hold(self, verdict: Verdict, tick: float, *, role: str, workers_started: float) -> Verdict:
        """Return ``verdict`` (restart now) when the job's save pace does not allow a wait,
        or once the checkpoint came or the wait ran out; else CONTINUE, after waiting up to
        ``tick`` seconds for the commit. Every agent of the group sees the same commit within
        milliseconds, so they re-form together. ``workers_started`` (``time.monotonic()``)
        is when the current workers started: workers (re)started since the last commit count
        their saves from their start."""
        if self._deferral is None:
            latest, age, interval = self._commits.cadence()
            if age is not None:
                age = min(age, time.monotonic() - workers_started)
            deferral = restart_policy.defer_join(latest, age, interval)
            if deferral is None:
                return verdict
            self._deferral = (deferral, time.monotonic() + deferral.within)
            # The reason is in the "restarting workers" line that follows.
            _log.debug("[%s] deferred restart: %s", role, verdict.reason)
            _log.info(
                "[%s] restarting after the next checkpoint (newest %d, within %.1fs)",
                role,
                deferral.after,
                deferral.within,
            )
        deferral, deadline = self._deferral
        remaining = deadline - time.monotonic()
        if self._commits.wait_committed(deferral.after, min(tick, max(0.0, remaining))):
            self._deferral = None
            return Verdict(verdict.action, f"{verdict.reason}; at the checkpoint after {deferral.after}")
        if remaining <= tick:
            self._deferral = None
            return Verdict(
                verdict.action, f"{verdict.reason}; no checkpoint after {deferral.after} came in time"
            )
        return Verdict(Action.CONTINUE, "")
