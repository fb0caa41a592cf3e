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

from .api import PContext, RankLogs
from .child import run_callable
from .spawner import run_on_forking_thread

__all__ = ["MultiprocessContext"]


class MultiprocessContext(PContext):
    """Each rank is a ``multiprocessing.Process`` (``spawn``, ``fork`` or ``forkserver``)
    running ``entrypoint(*args[rank])``; return values travel back pickled through a
    private temporary directory, removed on ``close``."""

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., Any],
        args: Mapping[int, tuple[Any, ...]],
        envs: Mapping[int, Mapping[str, str]],
        logs: Mapping[int, RankLogs],
        progbar_events: dict[str, Event] | None = None,
        start_method: str = "spawn",
        log_line_prefixes: Mapping[int, str] | None = None,
        filtered: Mapping[str, tuple[str, list[str]]] | None = None,
    ) -> None:
        super().__init__(name, entrypoint, args, envs, logs, progbar_events, log_line_prefixes, filtered)
        self.start_method = start_method
        self._procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self._ret_dir = tempfile.mkdtemp(prefix=f"kelastic-{name}-ret-")

    def _ret_path(self, rank: int) -> str:
        return os.path.join(self._ret_dir, f"{rank}.pkl")

    def _start(self) -> None:
        mp = multiprocessing.get_context(self.start_method)
        launcher_pid = os.getpid()
        direct_child = self.start_method != "forkserver"

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
                    ),
                )
                proc.start()
                self._procs[rank] = proc

        run_on_forking_thread(start_all)

    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self._procs.items() if p.pid is not None}

    def _exitcode(self, rank: int) -> int | None:
        proc = self._procs.get(rank)
        return None if proc is None else proc.exitcode

    def _sentinels(self) -> list[int]:
        return [p.sentinel for p in self._procs.values() if p.exitcode is None]

    def _return_values(self) -> dict[int, Any]:
        values: dict[int, Any] = {}
        for rank in range(self.nprocs):
            try:
                with open(self._ret_path(rank), "rb") as f:
                    values[rank] = pickle.load(f)
            except FileNotFoundError:
                values[rank] = None  # the callable left via os._exit(0)
        return values

    def _release(self) -> None:
        shutil.rmtree(self._ret_dir, ignore_errors=True)
