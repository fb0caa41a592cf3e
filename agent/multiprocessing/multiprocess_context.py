"""Ranks that run a Python callable (``start_processes`` with a callable entrypoint)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Mapping
from threading import Event
from typing import Any

from .child import run_callable
from .errors import RunProcsResult
from .handshake import FinishHandshake
from .logs_specs import LogsSpecs
from .pcontext import START_METHODS, PContext
from .spawner import run_on_forking_thread

__all__ = ["MultiprocessContext"]


class MultiprocessContext(PContext):
    """Each rank is a ``multiprocessing.Process`` (``spawn``, ``fork`` or ``forkserver``)
    running ``entrypoint(*args[rank])``; return values travel back pickled through a
    private temporary directory, removed on ``close``.

    A rank whose function returned stays alive until it is released (:mod:`.handshake`):
    when every local rank has returned, or, with ``hold=True``, when :meth:`release` is
    called. ``wait`` reports the run once the released ranks have exited.

    The constructor is torch's (``start_method`` and ``logs_specs`` after ``envs``);
    ``progbar_events`` and ``hold`` are kelastic's. ``numa_options`` must be None.
    """

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any],
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        start_method: str,
        logs_specs: LogsSpecs,
        log_line_prefixes: Mapping[int, str] | None = None,
        numa_options: object | None = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
        *,
        progbar_events: dict[str, Event] | None = None,
        hold: bool = False,
    ) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}; got {start_method!r}")
        super().__init__(
            name,
            entrypoint,
            args,
            envs,
            logs_specs,
            log_line_prefixes,
            numa_options,
            duplicate_stdout_filters,
            duplicate_stderr_filters,
            progbar_events=progbar_events,
        )
        self.start_method = start_method
        self._procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self._ret_dir = tempfile.mkdtemp(prefix=f"kelastic-{name}-ret-")
        self._hold = hold
        self._handshake = FinishHandshake(
            multiprocessing.get_context(start_method), self.nprocs, forked=start_method == "fork"
        )
        self._returned: set[int] = set()

    def _ret_path(self, rank: int) -> str:
        return os.path.join(self._ret_dir, f"{rank}.pkl")

    def _start(self) -> None:
        mp = multiprocessing.get_context(self.start_method)
        launcher_pid = os.getpid()
        direct_child = self.start_method != "forkserver"
        ends = self._handshake.rank_ends()

        def start_all() -> None:
            for rank in range(self.nprocs):
                logs = self.logs[rank]
                # typeshed gives get_context(str) the BaseContext type, which declares no
                # Process; every concrete context (spawn, fork, forkserver) has one.
                proc = mp.Process(  # type: ignore[attr-defined]
                    target=run_callable,
                    name=f"{self.name}{rank}",
                    args=(
                        rank,
                        self.entrypoint,
                        tuple(self.args[rank]),
                        dict(self.envs[rank]),
                        logs.stdout,
                        logs.stderr,
                        self._ret_path(rank),
                        launcher_pid,
                        direct_child,
                        ends,
                    ),
                )
                proc.start()
                self._procs[rank] = proc

        try:
            run_on_forking_thread(start_all)
        finally:
            self._handshake.started()

    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self._procs.items() if p.pid is not None}

    def _exitcode(self, rank: int) -> int | None:
        proc = self._procs.get(rank)
        return None if proc is None else proc.exitcode

    def _exit_fds(self) -> list[int]:
        # A fork server writes a rank's status to its sentinel once it reaped it; a forked
        # or spawned rank's sentinel reads EOF when it (and whatever inherited it) exited.
        return [p.sentinel for p in self._procs.values() if p.exitcode is None]

    def _sentinels(self) -> list[int]:
        fds = self._exit_fds()
        reports = self._handshake.fileno()
        if reports is not None and not self._handshake.released:
            fds.append(reports)
        return fds

    def _return_values(self) -> dict[int, Any]:
        values: dict[int, Any] = {}
        for rank in range(self.nprocs):
            try:
                with open(self._ret_path(rank), "rb") as f:
                    values[rank] = pickle.load(f)
            except FileNotFoundError:
                values[rank] = None  # the callable left via os._exit(0)
        return values

    # -- the finish handshake ---------------------------------------------------------------
    def _poll_returned(self) -> None:
        if self._handshake.released:
            return
        self._handshake.drain()
        for rank in range(self.nprocs):
            # The value is stored (atomically) before the rank reports; a rank that left
            # through os._exit(0) never reports and counts as returned None.
            if rank not in self._returned and (
                os.path.exists(self._ret_path(rank)) or self._exitcode(rank) == 0
            ):
                self._returned.add(rank)
        if not self._hold and len(self._returned) == self.nprocs:
            self._handshake.release()

    #: As torch's: a callable the launcher stopped because another rank failed did not fail.
    REPORTS_STOPPED = False

    def _waiting_ranks(self) -> set[int]:
        if self._handshake.released:
            return set()
        return {r for r in self._returned if self._exitcode(r) is None}

    def returned(self) -> RunProcsResult | None:
        if not self._started or self._closed or self._result is not None:
            return None
        self._poll_returned()
        if len(self._returned) < self.nprocs or any(
            code not in (None, 0) for code in (self._exitcode(r) for r in range(self.nprocs))
        ):
            return None
        return RunProcsResult(
            return_values=self._return_values(), stdouts=dict(self.stdouts), stderrs=dict(self.stderrs)
        )

    def release(self) -> None:
        self._handshake.release()

    def _release(self) -> None:
        self._handshake.close()
        shutil.rmtree(self._ret_dir, ignore_errors=True)
