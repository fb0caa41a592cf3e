"""The ``PContext`` contract shared by both kinds of rank, and what checks and lays out its ranks.

:class:`PContext` is the base of :class:`~.multiprocess_context.MultiprocessContext`
(callables) and :class:`~.subprocess_context.SubprocessContext` (binaries);
:func:`~.api.start_processes` picks one of them. Both import this module, and
:mod:`.api` imports both: the contract lives below the two kinds of rank.
"""

from __future__ import annotations

import abc
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from threading import Event
from typing import IO, Any

from .errors import ERROR_FILE_ENV, ProcessFailure, RunProcsResult
from .exitwait import ExitWatch
from .logs_specs import LogsDest, LogsSpecs
from .proctree import descendants, is_alive, signal_trees
from .signals import install_signal_handlers, restore_signal_handlers
from .tail_log import TailLog
from .watchdog import guard, unguard

__all__ = [
    "FAILURE_GRACE",
    "START_METHODS",
    "EntrypointNotFoundError",
    "PContext",
    "RankLogs",
    "RankMismatchError",
    "check_numa_options",
    "logs_from_dest",
    "validate_rank_keys",
]

logger = logging.getLogger(__name__)

START_METHODS = ("spawn", "fork", "forkserver")

#: Seconds a context lets its other ranks end on their own after the first rank failed,
#: before it stops them. Ranks that fail at the same moment (a bad batch every rank
#: read, an out-of-memory on every rank) are then each reported with their own exit
#: code and error file, not with the SIGTERM the launcher would have sent them while
#: they were already on their way out; ranks still running after it are stopped (and
#: reported as stopped if they are binaries, as torch does). The wait ends as soon as no
#: rank that could end is left.
FAILURE_GRACE = 1.0


class RankMismatchError(ValueError, RuntimeError):
    """``args``/``envs`` not keyed by local ranks ``0..n-1``: the ``RuntimeError`` torch raises,
    and the ``ValueError`` kelastic always raised."""


class EntrypointNotFoundError(FileNotFoundError, ValueError):
    """The entrypoint binary is not there or not executable: the ``FileNotFoundError`` torch
    raises, and the ``ValueError`` kelastic always raised."""


@dataclass(frozen=True)
class RankLogs:
    """Where one rank's streams and error file go. Empty path = stream not redirected."""

    stdout: str
    stderr: str
    error_file: str
    tee_stdout: bool
    tee_stderr: bool


def validate_rank_keys(args: Mapping[int, Any], envs: Mapping[int, Any]) -> int:
    """Check that ``args`` and ``envs`` are both keyed by exactly ``0..n-1``; return ``n``.

    ``n`` is ``len(args)``. Raises ``ValueError`` naming the missing and extra ranks.
    """
    nprocs = len(args)
    expected = set(range(nprocs))
    problems = []
    for label, mapping in (("args", args), ("envs", envs)):
        missing = sorted(expected - set(mapping))
        extra = sorted(set(mapping) - expected, key=repr)
        if missing:
            problems.append(f"{label} is missing local ranks {missing}")
        if extra:
            problems.append(f"{label} has extra keys {extra}")
    if problems:
        raise RankMismatchError(
            f"args and envs must both be keyed by local ranks 0..{nprocs - 1} ({nprocs} ranks, from len(args)): "
            + "; ".join(problems)
        )
    for rank, env in envs.items():
        bad = sorted(repr(k) for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str))
        if bad:
            raise RankMismatchError(
                f"envs[{rank}] must map str to str; these entries are not: {', '.join(bad)}"
            )
    return nprocs


def logs_from_dest(dest: LogsDest, nprocs: int) -> dict[int, RankLogs]:
    """Per-rank :class:`RankLogs` of what a ``LogsSpecs.reify`` decided (pure).

    ``os.devnull`` as an error file means none; a stream teed to ``os.devnull`` is not shown.
    """
    logs = {}
    for rank in range(nprocs):
        error_file = dest.error_files.get(rank, "")
        logs[rank] = RankLogs(
            stdout=dest.stdouts.get(rank, ""),
            stderr=dest.stderrs.get(rank, ""),
            error_file="" if error_file == os.devnull else error_file,
            tee_stdout=dest.tee_stdouts.get(rank, os.devnull) not in ("", os.devnull),
            tee_stderr=dest.tee_stderrs.get(rank, os.devnull) not in ("", os.devnull),
        )
    return logs


def _failure(rank: int, pid: int, exitcode: int, error_file: str) -> ProcessFailure:
    """The failure of a rank that ended with ``exitcode``; an error file that cannot be read
    (see the module docstring) is named in the message instead of raised."""
    try:
        return ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file=error_file)
    except (OSError, ValueError, TypeError) as exc:  # MalformedErrorFileError is a ValueError too
        logger.warning("local_rank %s (pid %s): cannot read its error file: %s", rank, pid, exc)
        return ProcessFailure(
            local_rank=rank,
            pid=pid,
            exitcode=exitcode,
            error_file=error_file,
            error_file_data={"message": f"the rank's error file {error_file} could not be read: {exc}"},
        )


def check_numa_options(numa_options: object | None) -> None:
    """``ValueError`` unless ``numa_options`` is None: kelastic does not bind ranks to NUMA nodes."""
    if numa_options is not None:
        raise ValueError(
            "numa_options is not supported by kelastic: pass None (ranks are not bound to NUMA nodes)"
        )


def _contains_any(needles: list[str]) -> Callable[[str], bool]:
    """A line filter: True for a line that contains one of ``needles``."""
    wanted = tuple(needles)
    return lambda line: any(n in line for n in wanted)


class PContext(abc.ABC):
    """A group of local ranks started together: ``start``, ``wait``, ``pids``, ``close``.

    Guarantees: ``close`` (idempotent) leaves no process of any rank's tree alive and no
    zombie of ours; if the launching process is killed outright, the ranks die of their
    parent-death signal and the watchdog (:mod:`.watchdog`) kills their process groups
    and known descendants; when a rank fails, ``wait`` gives the others
    :data:`FAILURE_GRACE` seconds to end on their own, so that ranks failing at the same
    moment each report their own exit code and error file, then stops the rest
    (SIGTERM), reporting the binaries it stopped (as torch does; see the module docstring).
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any] | str,
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: Mapping[int, str] | None = None,
        numa_options: object | None = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
        *,
        progbar_events: dict[str, Event] | None = None,
    ) -> None:
        """The arguments of torch's contexts (its ``SubprocessContext``'s, in that order):
        ``logs_specs`` decides where logs go (its ``reify`` is called here, once);
        ``numa_options`` must be None; ``progbar_events`` is kelastic's (see
        :func:`start_processes`)."""
        check_numa_options(numa_options)
        validate_rank_keys(args, envs)
        envs_out = {rank: dict(env) for rank, env in envs.items()}
        dest = logs_specs.reify(envs_out)
        logs = logs_from_dest(dest, len(args))
        filtered = {
            "stdout": (dest.filtered_stdout, list(duplicate_stdout_filters or [])),
            "stderr": (dest.filtered_stderr, list(duplicate_stderr_filters or [])),
        }
        self.name = name
        self.entrypoint = entrypoint
        self.args = dict(args)
        self.envs = {rank: {**env, ERROR_FILE_ENV: logs[rank].error_file} for rank, env in envs_out.items()}
        self.logs = dict(logs)
        #: ``{local_rank: path}`` of each rank's stdout/stderr log (``""``: not redirected)
        #: and error file, as torch's ``PContext`` has them.
        self.stdouts = {r: lg.stdout for r, lg in self.logs.items()}
        self.stderrs = {r: lg.stderr for r, lg in self.logs.items()}
        self.error_files = {r: lg.error_file for r, lg in self.logs.items()}
        self.nprocs = len(args)
        self.progbar_events = progbar_events
        self._tails: list[TailLog] = []
        self._filtered_files: list[IO[str]] = []
        self._prev_handlers: dict[signal.Signals, Any] | None = None
        self._result: RunProcsResult | None = None
        self._failures: dict[int, ProcessFailure] = {}
        self._failed_since: float | None = None  # time.monotonic() of the first failure seen
        #: Seconds the other ranks get to end on their own after a failure (see
        #: :data:`FAILURE_GRACE`; ``start_processes(failure_grace=)`` sets it).
        self.failure_grace = FAILURE_GRACE
        self._started = False
        self._closed = False
        out = {r: lg.stdout for r, lg in logs.items() if lg.tee_stdout}
        err = {r: lg.stderr for r, lg in logs.items() if lg.tee_stderr}
        for files, console, stream in ((out, sys.stdout, "stdout"), (err, sys.stderr, "stderr")):
            if not files:
                continue
            self._tails.append(
                TailLog(
                    name, files, console, progbar_events=progbar_events, log_line_prefixes=log_line_prefixes
                )
            )
            path, needles = filtered.get(stream, ("", []))
            if needles:
                # torch's duplicate_*_filters: the teed lines that contain any needle, of all
                # ranks, copied to one file.
                dst = open(path, "w", errors="replace", buffering=1)  # noqa: SIM115 - closed in close()
                self._filtered_files.append(dst)
                self._tails.append(
                    TailLog(
                        name,
                        files,
                        dst,
                        log_line_prefixes=log_line_prefixes,
                        log_line_filter=_contains_any(needles),
                    )
                )

    # -- what each kind of rank provides -------------------------------------------------
    @abc.abstractmethod
    def _start(self) -> None:
        """Start every rank."""

    @abc.abstractmethod
    def _exitcode(self, rank: int) -> int | None:
        """Exit code of ``rank`` (reaping it), or None while it runs. Negative = signal."""

    @abc.abstractmethod
    def _sentinels(self) -> list[int]:
        """File descriptors that become readable when a rank exits."""

    @abc.abstractmethod
    def _return_values(self) -> dict[int, Any]:
        """Per-rank return values once every rank exited with code 0."""

    @abc.abstractmethod
    def pids(self) -> dict[int, int]:
        """``{local_rank: pid}`` of the rank processes."""

    def _release(self) -> None:  # noqa: B027 - optional hook
        """Free per-context resources after every rank is gone."""

    def _poll_returned(self) -> None:  # noqa: B027 - optional hook
        """Take note of ranks that handed back their value (callables); release them when due."""

    def _waiting_ranks(self) -> set[int]:
        """Ranks that returned and wait for their release (they will not end on their own)."""
        return set()

    #: Whether ranks the launcher stopped because another failed are reported (torch: binaries).
    REPORTS_STOPPED = True

    def returned(self) -> RunProcsResult | None:
        """With ``hold``: once every rank returned its value (and none failed), the result
        of the run, its ranks still alive until :meth:`release`; else None (always None
        for binaries, which return nothing)."""
        return None

    def release(self) -> None:  # noqa: B027 - binaries are never held
        """Let every rank that returned exit (idempotent); ``wait`` then reports the run."""

    # -- the contract ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the ranks and the console tailers; in the main thread, install handlers
        that turn SIGTERM/SIGINT/SIGHUP/SIGQUIT into ``SignalException``."""
        if self._started:
            raise RuntimeError(f"process context {self.name!r} was already started")
        self._started = True
        self._prev_handlers = install_signal_handlers()
        try:
            self._start()
        finally:
            guard(self.pids().values())
        for tail in self._tails:
            tail.start()

    def _note_failures(self) -> dict[int, int | None]:
        """Exit codes of every rank; a rank seen failing for the first time gets its
        :class:`ProcessFailure` now, so that its time is when it was seen."""
        codes = {rank: self._exitcode(rank) for rank in range(self.nprocs)}
        pids = self.pids()
        for rank, code in codes.items():
            if code is not None and code != 0 and rank not in self._failures:
                self._failures[rank] = _failure(rank, pids[rank], code, self.logs[rank].error_file)
                if self._failed_since is None:
                    self._failed_since = time.monotonic()
        return codes

    def _outcome(self) -> RunProcsResult | None:
        """The run's result once it is decided (see :meth:`wait`), else None."""
        codes = self._note_failures()
        stdouts = {r: lg.stdout for r, lg in self.logs.items()}
        stderrs = {r: lg.stderr for r, lg in self.logs.items()}
        if self._failures:
            running = {r for r, c in codes.items() if c is None} - self._waiting_ranks()
            if running and self._grace_left() > 0:
                return None  # a rank that failed at the same moment may still be ending
            return RunProcsResult(failures=dict(self._failures), stdouts=stdouts, stderrs=stderrs)
        if all(c == 0 for c in codes.values()):
            return RunProcsResult(return_values=self._return_values(), stdouts=stdouts, stderrs=stderrs)
        return None

    def _grace_left(self) -> float:
        if self._failed_since is None:
            return self.failure_grace
        return self._failed_since + self.failure_grace - time.monotonic()

    def _add_stopped_ranks(self, result: RunProcsResult) -> None:
        """After a failure and ``close()``: report the ranks the launcher stopped too (their
        exit codes are the signal that stopped them, e.g. -15), as torch does for binaries
        (:attr:`REPORTS_STOPPED`). They are seen after the failure that caused them, so they
        are never the root cause."""
        if not self.REPORTS_STOPPED:
            return
        self._note_failures()
        for rank, failure in self._failures.items():
            result.failures.setdefault(rank, failure)

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait for the run to finish: every rank succeeded, or one failed.

        ``timeout`` 0 polls once; negative waits forever; otherwise up to ``timeout`` s.
        Returns None if still running. When a rank fails, the others get up to
        :data:`FAILURE_GRACE` s to end on their own (ranks that failed at the same moment
        report their own exit code and error file), then the rest are stopped
        (``close()``); the result lists the ranks that failed (and the binaries it stopped,
        see the module docstring); a rank that returned is never among them. Wakes
        as soon as a rank exits or returns; ``period`` only bounds how long one sleep may be.
        """
        if not self._started:
            raise RuntimeError(f"process context {self.name!r} was not started; call start() first")
        if self._result is not None:
            return self._result
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            if self._closed:
                return None  # closed by the caller while running: nothing more will finish
            self._poll_returned()
            result = self._outcome()
            if result is not None:
                self.close()
                if result.failures:
                    self._add_stopped_ranks(result)
                self._result = result
                return result
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            nap = max(period, 0.01) if remaining is None else min(max(period, 0.01), remaining)
            if self._failed_since is not None:
                nap = min(nap, max(self._grace_left(), 0.01))
            try:
                select.select(self._sentinels(), [], [], nap)
            except (OSError, ValueError):
                time.sleep(min(nap, 0.05))

    def close(self, death_sig: signal.Signals | int = signal.SIGTERM, timeout: float = 30) -> None:
        """Stop every rank and its whole process tree; idempotent.

        Sends ``death_sig`` to each rank's process group and every descendant, all ranks
        at once (a rank's own handler of the signal runs, side by side with its peers'),
        waits up to ``timeout`` s for them to exit, then SIGKILLs whatever is left (always:
        also what ignored ``death_sig`` or started since), reaps the ranks, and drains the
        console tailers (every line the ranks wrote is printed before this returns). The
        wait ends as soon as the last of them exited: it wakes on their exits
        (:mod:`.exitwait`), with no poll period of its own. Callable from any thread.
        """
        if self._closed:
            return
        # _closed is set only at the end: if a signal interrupts this (SignalException in
        # the main thread), calling close() again redoes the termination.
        if self._started:
            self._terminate(int(death_sig), timeout)
            unguard(self.pids().values())
        for tail in self._tails:
            tail.stop()
        for dst in self._filtered_files:
            dst.close()
        restore_signal_handlers(self._prev_handlers)
        self._release()
        self._closed = True

    def _live_ranks(self) -> list[int]:
        return [pid for rank, pid in self.pids().items() if self._exitcode(rank) is None]

    def _exit_fds(self) -> list[int]:
        """Descriptors that become readable when a live rank's exit status can be read."""
        return self._sentinels()

    def _terminate(self, sig: int, timeout: float) -> None:
        """``sig`` to every rank's tree, up to ``timeout`` s for them to exit, then SIGKILL to
        what is left; returns once every rank is reaped (or 10 s after the SIGKILL).

        All ranks are signalled at once and waited for together; the waits wake when a
        rank or a descendant exits (:class:`~.exitwait.ExitWatch`), not on a poll period.
        """
        leaders = list(self.pids().values())
        live = self._live_ranks()
        tree = descendants(live) | set(live) if live else set()
        signal_trees(leaders, tree, sig)
        with ExitWatch(tree, is_alive) as watch:

            def gone() -> bool:
                return not self._live_ranks() and not any(is_alive(p) for p in tree)

            if (
                not watch.wait(gone, self._exit_fds, time.monotonic() + max(timeout, 0))
                and self._live_ranks()
            ):
                logger.warning(
                    "%s: ranks with pids %s did not exit within %.1f s of %s; sending SIGKILL",
                    self.name,
                    self._live_ranks(),
                    timeout,
                    signal.Signals(sig).name,
                )
            # Always finish with SIGKILL on what remains of the trees (including processes
            # started after the first scan and ones that ignored death_sig).
            left = self._live_ranks() + [p for p in tree if is_alive(p)]
            tree |= descendants(left) if left else set()
            signal_trees(leaders, [p for p in tree if is_alive(p)] + self._live_ranks(), signal.SIGKILL)
            watch.add(tree)
            if not watch.wait(lambda: not self._live_ranks(), self._exit_fds, time.monotonic() + 10):
                logger.error("%s: ranks %s still alive 10 s after SIGKILL", self.name, self._live_ranks())
