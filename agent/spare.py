"""Spare workers: the node's next worker processes, started ahead and parked.

A worker kept across a re-form (:mod:`kelastic.agent.keep`) costs no process start; a worker
that *crashed* (its process exited, was killed, ran out of memory) still does: its node
starts a new process, which imports torch and the script's modules and builds the model
before the group can go on. With ``KELASTIC_SPARE_WORKERS=1`` in the agent's environment,
an agent whose script imports ``kelastic.inprocess`` holds one more process per local rank,
started once the group has trained :data:`SPARE_AFTER` seconds, run up to
:func:`kelastic.inprocess.run` and parked there without a group (as a standby's workers wait,
:meth:`~kelastic.agent.keep.Keeper.started_early`). When the node's workers must be started
again, the spares take their place: the agent hands them the new group as it hands kept
workers theirs, and the next spares start once the group trains again.

What a caller may rely on:

* **Only what the script does before ``run()``** runs in a spare: its imports and what it
  builds. A spare that ends before it parks (a script that needs its rank at import) is not
  started again; the node starts its workers the usual way.
* **It costs** the memory of one more process per local rank (what the script allocates
  before ``run()``), and one process start's CPU, off the restart's path.
* **Nothing outlives the agent.** The spares are closed with the workers, and a spare that
  died is closed and forgotten at the next monitor tick.

The decision (:func:`due`) is pure; the processes are the agent's (it passes the start).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kelastic.agent.keep import Keeper
from kelastic.agent.multiprocessing import PContext

__all__ = ["ENV_SPARE_WORKERS", "SPARE_AFTER", "Spares", "due", "spares_enabled"]

_log = logging.getLogger(__name__)

#: Environment variable of the agent: ``1`` holds spare worker processes (see the module docstring).
ENV_SPARE_WORKERS = "KELASTIC_SPARE_WORKERS"
#: Seconds the group trains before the spares start: their start stays off the restore's CPU.
SPARE_AFTER = 5.0


def spares_enabled(env: Mapping[str, str]) -> bool:
    """Whether the agent holds spare workers (off unless ``KELASTIC_SPARE_WORKERS`` says so)."""
    return env.get(ENV_SPARE_WORKERS, "").strip().lower() in ("1", "true", "yes", "on")


def due(
    enabled: bool, held: bool, running_since: float | None, now: float, after: float = SPARE_AFTER
) -> bool:
    """Whether to start the spares now (pure): enabled, none held, and the current workers
    have run ``after`` seconds (``running_since``: when they started or were handed their
    group; None while none run)."""
    return enabled and not held and running_since is not None and now - running_since >= after


@dataclass
class _Held:
    pcontext: PContext
    keeper: Keeper
    folder: Path


class Spares:
    """The spares of one node's workers (:attr:`enabled`: see :func:`spares_enabled`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._held: _Held | None = None
        self._running_since: float | None = None
        self._count = 0
        self._token = uuid.uuid4().hex[:8]
        #: set once a spare ended before it parked: the script cannot wait for its group
        self._refused = False

    def running(self) -> None:
        """The node's workers run in a (new) group from now on."""
        self._running_since = time.monotonic()

    def stopped(self) -> None:
        """The node's workers stopped (a re-form, a failure): no spare starts meanwhile."""
        self._running_since = None

    def tick(
        self,
        root: Path,
        local_ranks: int,
        envs: Callable[[Path], dict[int, dict[str, str]]],
        spawn: Callable[[Mapping[int, dict[str, str]], Path], PContext],
    ) -> None:
        """On a monitor tick: forget spares that died; start new ones when :func:`due`, with
        their logs in a new folder under ``root``. ``envs(folder)`` gives their variables but
        the hand-off's, ``spawn(envs, folder)`` starts them."""
        held = self._held
        if held is not None and held.pcontext.wait(0) is not None:
            _log.warning(
                "a spare worker ended before it was needed (its output in %s says why); the node's "
                "workers start the usual way after a crash",
                held.folder,
            )
            self._refused = True
            self.close()
        now = time.monotonic()
        if self._refused or not due(self.enabled, self._held is not None, self._running_since, now):
            return
        self._count += 1
        # Never a folder an earlier agent of this log directory used: its hand-off files are stale.
        folder = root / f"spare_{self._token}_{self._count}"
        keeper = Keeper(enabled=True)
        extra = keeper.started_early(folder, local_ranks)
        if not extra:
            self._refused = True  # the keeper said why: no private hand-off folder
            return
        base = envs(folder)
        all_envs = {lr: base[lr] | extra[lr] for lr in range(local_ranks)}
        self._held = _Held(spawn(all_envs, folder), keeper, folder)
        _log.info("spare workers started (pids %s); they wait for the node's next start", self.pids())

    def pids(self) -> list[int]:
        return sorted(self._held.pcontext.pids().values()) if self._held is not None else []

    def take(self, envs: Mapping[int, Mapping[str, str]]) -> tuple[PContext, Keeper] | None:
        """The spares handed their group (``envs``: each local rank's variables), as the
        node's workers from now on; None (and they are closed) unless every one is alive
        and parked."""
        held, self._held = self._held, None
        if held is None:
            return None
        if held.keeper.take_early(held.pcontext.pids(), envs):
            return held.pcontext, held.keeper
        _log.warning("the spare workers were not parked (pids %s); starting new ones", held.pcontext.pids())
        held.pcontext.close()
        return None

    def close(self) -> None:
        """Stop the spares, if any (they hold no group: nothing to wait for)."""
        held, self._held = self._held, None
        if held is not None:
            held.pcontext.close()
