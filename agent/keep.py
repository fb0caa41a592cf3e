"""A re-form that keeps the node's workers: they park while the next group forms.

Workers that run under :func:`kelastic.inprocess.run` and all still live when their node
re-forms (a peer was lost, a standby took a place, nodes joined) are not stopped:
:class:`KeptWorkers` asks each to leave its process group and park (the hand-off files of
:mod:`kelastic.agent.handoff`, and the signal the worker named), and waits in a thread of
its own, beside the node's join, until all parked. It has the interface of
:class:`~kelastic.agent.reform.OverlappedStop`, which the agent uses otherwise: the agent
waits for it (:meth:`KeptWorkers.wait`) before it changes the checkpoint ring and hands the
workers their new ranks (:func:`hand_over`), so the old group's last saves replicate on the
old ring, as when the workers stop.

A worker that does not park within ``timeout`` (stuck in a collective with a frozen peer,
blocked in the script's own code) is not waited for: the node's workers are stopped as at
any re-form (``stop``), :attr:`KeptWorkers.kept` is False and new workers are started.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from kelastic.agent import handoff
from kelastic.agent.handoff import Action, Request, Stage, parked, read_report, write_request

_log = logging.getLogger(__name__)

__all__ = ["KEEP_TIMEOUT", "RELEASE_WAIT", "Keeper", "KeptWorkers", "alive", "hand_over"]

#: Seconds the workers get to park before the agent stops them instead.
KEEP_TIMEOUT = 5.0
#: Seconds the agent waits for workers started early (a standby's, spares) to reach
#: kelastic.inprocess.run when their group is known, before it starts new ones instead.
EARLY_PARK_WAIT = 300.0
#: Seconds between the lines that say the agent still waits for them, and between its looks.
EARLY_PROGRESS_EVERY = 10.0
EARLY_POLL = 0.02
#: Seconds between looks at the workers' reports while they park.
POLL = 0.002
#: Seconds the workers parked on a failure of their own get to end with it when stopped.
RELEASE_WAIT = 2.0


class KeptWorkers:
    """One re-form's parking of the node's workers; see the module docstring.

    ``folders`` are the workers' hand-off directories by local rank, ``pids`` their
    processes, ``gen`` the generation they are asked to reach. ``stop`` stops the workers
    (the fallback); ``done(seconds, ended)`` is called by the first :meth:`wait`, as
    :class:`~kelastic.agent.reform.OverlappedStop` does, once they parked or were stopped.
    """

    def __init__(
        self,
        folders: Mapping[int, Path],
        pids: Mapping[int, int],
        gen: int,
        stop: Callable[[], None],
        done: Callable[[float, float], None],
        timeout: float = KEEP_TIMEOUT,
    ) -> None:
        self._folders = dict(folders)
        self._pids = dict(pids)
        self.gen = gen
        self._stop = stop
        self._done: Callable[[float, float], None] | None = done
        self._timeout = timeout
        self._began = time.monotonic()
        self._seconds = 0.0
        self._ended = 0.0
        self._error: BaseException | None = None
        #: True once every worker parked; False when they were stopped instead.
        self.kept = False
        for folder in self._folders.values():
            write_request(folder, Request(gen, Action.REFORM))
        self._interrupt()
        self._thread = threading.Thread(target=self._run, name="kelastic-park-workers", daemon=True)
        self._thread.start()

    def _interrupt(self) -> None:
        """Send each running worker the signal it named, so that it leaves its step now."""
        for local_rank, folder in self._folders.items():
            report = read_report(folder)
            if report is None or report.stage is not Stage.RUNNING or not report.signal:
                continue
            if report.pid != self._pids.get(local_rank):
                continue
            try:
                os.kill(report.pid, signal.Signals(report.signal))
            except (ProcessLookupError, ValueError):
                pass  # gone: the wait below sees it never parks

    def _alive(self) -> bool:
        return all(alive(pid) for pid in self._pids.values())

    def _run(self) -> None:
        deadline = self._began + self._timeout
        try:
            while True:
                reports = {lr: read_report(folder) for lr, folder in self._folders.items()}
                if parked(reports, len(self._folders), self.gen - 1):
                    self.kept = True
                    break
                if time.monotonic() >= deadline or not self._alive():
                    self._stop()
                    break
                time.sleep(POLL)
        except BaseException as exc:  # re-raised on the agent's thread by wait()
            self._error = exc
        self._seconds = time.monotonic() - self._began
        self._ended = time.time()

    @property
    def overlapped(self) -> bool:
        """Whether the parking runs beside the join (always)."""
        return True

    def wait(self) -> None:
        """Block until the workers parked or were stopped; re-raise the stop's exception (once)."""
        self._thread.join()
        done, self._done = self._done, None
        error, self._error = self._error, None
        if done is not None:
            done(self._seconds, self._ended)
        if error is not None:
            raise error


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited child that was not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def hand_over(folders: Mapping[int, Path], gen: int, envs: Mapping[int, Mapping[str, str]]) -> None:
    """Give each parked worker the next group's variables: it joins that group as generation ``gen``."""
    for local_rank, folder in folders.items():
        write_request(folder, Request(gen, Action.GO, dict(envs[local_rank])))


class Keeper:
    """A node's side of the hand-off for its running workers: their hand-off directories by
    local rank (:attr:`folders`) and the generation they are in (:attr:`gen`: 0 when started,
    one more at every re-form that kept them)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.folders: dict[int, Path] = {}
        self.gen = 0
        #: the workers were started before the node had a group (:meth:`started_early`)
        self.early = False

    def started(self, attempt_dir: Path, local_ranks: int) -> dict[int, dict[str, str]]:
        """New worker processes are about to start for ``attempt_dir``: their (empty) hand-off
        directories beside it, and the variable each worker gets naming its own."""
        self.early = False
        if not self.enabled:
            self.folders = {}
            return {lr: {} for lr in range(local_ranks)}
        # Beside the attempt's directory: start_processes wants that one empty.
        base = attempt_dir.with_name(f"handoff_{attempt_dir.name}")
        self.folders = {lr: base / str(lr) for lr in range(local_ranks)}
        self.gen = 0
        for folder in self.folders.values():
            if (why := handoff.make_private(folder)) is not None:
                # A request names the group the worker joins: no one else may write one.
                _log.error(
                    "the workers' hand-off folder %s; these workers are restarted at each re-form, "
                    "not kept (give the agent a --log-dir of its own)",
                    why,
                )
                self.folders = {}
                return {lr: {} for lr in range(local_ranks)}
        return {lr: {handoff.ENV_HANDOFF_DIR: str(folder)} for lr, folder in self.folders.items()}

    def started_early(self, attempt_dir: Path, local_ranks: int) -> dict[int, dict[str, str]]:
        """As :meth:`started`, for workers started before the node has a group (a standby's):
        they park before their first group and wait for :meth:`take_early`. Empty (start
        none) when their hand-off folders could not be made private."""
        envs = self.started(attempt_dir, local_ranks)
        if not self.folders:  # no private hand-off folder: nothing to hand them their group by
            return {}
        for env in envs.values():
            env[handoff.ENV_HANDOFF_PARKED] = "1"
        self.early = self.enabled
        return envs

    def take_early(
        self, pids: Mapping[int, int], envs: Mapping[int, Mapping[str, str]], wait: float = EARLY_PARK_WAIT
    ) -> bool:
        """Hand the workers started early their first group (``envs``) once every one of them
        is parked waiting for it: one still on its way there (importing, building the model)
        is waited for, up to ``wait`` seconds, since a new process would have that way to go
        too. False (and they are no longer counted on) when one ended or the wait ran out."""
        early, self.early = self.early, False
        if not early:
            return False
        began = told = time.monotonic()
        while True:
            if not all(alive(p) for p in pids.values()):
                return False
            reports = {lr: read_report(f) for lr, f in self.folders.items()}
            if parked(reports, len(self.folders), 0):
                break
            now = time.monotonic()
            if now - began >= wait:
                _log.warning("workers started early did not reach kelastic.inprocess.run in %.0f s", wait)
                return False
            if now - told >= EARLY_PROGRESS_EVERY:
                told = now
                _log.info(
                    "waiting for the workers started early to reach kelastic.inprocess.run (%.0f s)",
                    now - began,
                )
            time.sleep(EARLY_POLL)
        if any(r is None or r.pid != pids.get(lr) for lr, r in reports.items()):
            return False
        self.gen = 1
        hand_over(self.folders, self.gen, envs)
        return True

    def begin(
        self, pids: Mapping[int, int], stop: Callable[[], None], done: Callable[[float, float], None]
    ) -> KeptWorkers | None:
        """Park the workers ``pids`` for the next generation when all can be kept
        (:func:`~kelastic.agent.handoff.keepable`); None when they are to be stopped."""
        reports = {lr: read_report(folder) for lr, folder in self.folders.items()}
        if not (all(alive(pid) for pid in pids.values()) and handoff.keepable(reports, pids, self.gen)):
            return None
        return KeptWorkers(self.folders, pids, self.gen + 1, stop, done)

    def hand_over(self, kept: KeptWorkers, envs: Mapping[int, Mapping[str, str]]) -> None:
        """The parked workers join the new group (``envs``: each one's variables)."""
        self.gen = kept.gen
        hand_over(self.folders, self.gen, envs)

    def parked_failures(self, pids: Mapping[int, int]) -> dict[int, tuple[int, str]]:
        """Workers whose training raised and that parked: ``local rank -> (pid, exception)``."""
        failures = {}
        for lr, folder in self.folders.items():
            report = read_report(folder)
            if (
                report is not None
                and handoff.failed_on_its_own(report, self.gen)
                and report.pid == pids.get(lr)
            ):
                failures[lr] = (report.pid, report.reason)
        return failures

    def release(self, pids: Mapping[int, int]) -> None:
        """Before the workers are stopped: those parked on a failure of their own end with it
        (their traceback goes to their error file) rather than by the stop's signal; waits
        up to :data:`RELEASE_WAIT` s for them."""
        parked_pids = {lr: pid for lr, (pid, _) in self.parked_failures(pids).items()}
        for lr in parked_pids:
            write_request(self.folders[lr], Request(self.gen + 1, Action.EXIT))
        deadline = time.monotonic() + RELEASE_WAIT
        while parked_pids and time.monotonic() < deadline and any(alive(p) for p in parked_pids.values()):
            time.sleep(0.01)
