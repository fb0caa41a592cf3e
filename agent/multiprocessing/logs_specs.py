"""Where each rank's streams and error file go: torch 2.x's ``LogsSpecs`` API.

``start_processes(..., logs_specs=DefaultLogsSpecs(log_dir=..., redirects=..., tee=...))``
is the torch 2.x way to say where logs go; kelastic's ``log_dir``/``redirects``/``tee``
arguments are the other (see :func:`~.api.start_processes`). Any object with a
``reify(envs)`` method returning a :class:`LogsDest`-like object works, torch's own
``DefaultLogsSpecs`` included.

:class:`DefaultLogsSpecs` lays out, like torch's::

    <log_dir>/<run_id>_<random>/attempt_<restart_count>/<local_rank>/{stdout,stderr}.log, error.json
    <log_dir>/<run_id>_<random>/attempt_<restart_count>/filtered_{stdout,stderr}.log

where ``run_id`` and ``restart_count`` come from the ranks' ``TORCHELASTIC_RUN_ID`` and
``TORCHELASTIC_RESTART_COUNT``. ``log_dir`` may hold anything already (each spec makes a
new ``<run_id>_<random>`` directory in it); it is created if missing; a file there is a
``NotADirectoryError``; ``os.devnull`` discards every redirected stream and writes no
error file; ``None`` uses a new temporary directory.

:class:`AttemptDirLogsSpecs` is kelastic's own layout, what ``start_processes(log_dir=...,
redirects=..., tee=...)`` uses: the directory is that of one start of the ranks, new or
empty (one with content is refused, so logs and error files of two attempts never mix)::

    <log_dir>/<local_rank>/{stdout,stderr}.log, error.json
    <log_dir>/filtered_{stdout,stderr}.log
"""

from __future__ import annotations

import abc
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ERROR_FILE_ENV
from .std import Std, to_map

__all__ = ["AttemptDirLogsSpecs", "DefaultLogsSpecs", "LogDirIsAFileError", "LogsDest", "LogsSpecs"]


class LogDirIsAFileError(NotADirectoryError, ValueError):
    """``log_dir`` names a file. A ``NotADirectoryError`` as torch raises; also the
    ``ValueError`` kelastic's ``start_processes`` always raised for a bad ``log_dir``."""


@dataclass
class LogsDest:
    """Per local rank: where stdout/stderr go (``""`` = the launcher's console), which of
    them are tailed to the console, and the error file; plus the filtered-copy files."""

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""


class LogsSpecs(abc.ABC):
    """Says where the ranks' logs go; ``reify(envs)`` decides it for one start of the ranks.

    ``reify`` may add ``TORCHELASTIC_ERROR_FILE`` to each rank's env (it receives the
    dict that becomes the ranks' environment).
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | int | Mapping[int, Std | int] = Std.NONE,
        tee: Std | int | Mapping[int, Std | int] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abc.abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The destinations for ranks ``0..len(envs)-1``."""

    @property
    @abc.abstractmethod
    def root_log_dir(self) -> str: ...


class DefaultLogsSpecs(LogsSpecs):
    """The layout of the module docstring. ``local_ranks_filter``: only these local ranks are
    printed to the console; the others' teed streams go to their files only and their
    console streams to ``os.devnull``."""

    def __init__(self, log_dir: str | None = None, *args: Any, **kwargs: Any) -> None:
        """The arguments of :class:`LogsSpecs`; ``log_dir`` is created (or refused) here."""
        if log_dir != os.devnull:
            if not log_dir:
                log_dir = tempfile.mkdtemp(prefix="kelastic_")
            elif os.path.isfile(log_dir):
                raise LogDirIsAFileError(f"log_dir {log_dir} is a file; pass a directory")
            else:
                os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, *args, **kwargs)
        self._run_log_dir: str | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def _attempt_dir(self, run_id: str, restart_count: str) -> str:
        if self._run_log_dir is None:
            root = self._root_log_dir or tempfile.mkdtemp(prefix="kelastic_")
            os.makedirs(root, exist_ok=True)
            self._run_log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=root)
        attempt = os.path.join(self._run_log_dir, f"attempt_{restart_count}")
        # The same restart count again (a spec reused for a second start): start afresh,
        # so error files of the earlier start are never taken for this one's.
        shutil.rmtree(attempt, ignore_errors=True)
        os.makedirs(attempt)
        return attempt

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        first = envs.get(0, {})
        discard = self._root_log_dir == os.devnull
        attempt = (
            os.devnull
            if discard
            else self._attempt_dir(
                first.get("TORCHELASTIC_RUN_ID", "test_run_id"), first.get("TORCHELASTIC_RESTART_COUNT", "0")
            )
        )
        redirects = to_map(self._redirects, nprocs)
        tee = to_map(self._tee, nprocs)
        dest = LogsDest(
            filtered_stdout=os.path.join(attempt, "filtered_stdout.log"),
            filtered_stderr=os.path.join(attempt, "filtered_stderr.log"),
        )
        for rank in range(nprocs):
            shown = self._local_ranks_filter is None or rank in self._local_ranks_filter
            if discard:
                dest.stdouts[rank] = dest.stderrs[rank] = ""
                dest.tee_stdouts[rank] = dest.tee_stderrs[rank] = os.devnull
                dest.error_files[rank] = os.devnull
                envs[rank][ERROR_FILE_ENV] = ""
                continue
            rank_dir = os.path.join(attempt, str(rank))
            os.mkdir(rank_dir)
            streams = redirects[rank] | tee[rank]  # a teed stream is redirected and tailed back
            for flag, name, files, tees in (
                (Std.OUT, "stdout.log", dest.stdouts, dest.tee_stdouts),
                (Std.ERR, "stderr.log", dest.stderrs, dest.tee_stderrs),
            ):
                files[rank] = os.path.join(rank_dir, name) if streams & flag else ""
                if tee[rank] & flag and shown:
                    tees[rank] = files[rank]
                if not shown and not files[rank]:
                    files[rank] = os.devnull
            dest.error_files[rank] = os.path.join(rank_dir, "error.json")
            envs[rank][ERROR_FILE_ENV] = dest.error_files[rank]
        return dest

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(root_log_dir={self._root_log_dir}, redirects={self._redirects}, "
            f"tee={self._tee}, local_ranks_filter={self._local_ranks_filter})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return NotImplemented
        return (self._root_log_dir, self._redirects, self._tee, self._local_ranks_filter) == (
            other._root_log_dir,
            other._redirects,
            other._tee,
            other._local_ranks_filter,
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value


class AttemptDirLogsSpecs(LogsSpecs):
    """kelastic's layout (see the module docstring) in ``log_dir``, which ``reify`` creates;
    a teed stream is redirected too (the console copy is read back from its file).

    ``reify`` raises :class:`LogDirIsAFileError` for a file and ``ValueError`` for a
    directory that is not empty.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        redirects: Std | int | Mapping[int, Std | int] = Std.NONE,
        tee: Std | int | Mapping[int, Std | int] = Std.NONE,
    ) -> None:
        super().__init__(os.fspath(log_dir), redirects, tee)

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        root = Path(self.root_log_dir)
        if root.exists():
            if not root.is_dir():
                raise LogDirIsAFileError(
                    f"log_dir {root} exists and is not a directory; pass a new or empty directory"
                )
            if any(root.iterdir()):
                raise ValueError(
                    f"log_dir {root} is not empty; pass a new or empty directory for every start_processes call "
                    "so that logs and error files of different attempts never mix"
                )
        redirects = to_map(self._redirects, nprocs)
        tee = to_map(self._tee, nprocs)
        dest = LogsDest(
            filtered_stdout=str(root / "filtered_stdout.log"),
            filtered_stderr=str(root / "filtered_stderr.log"),
        )
        for rank in range(nprocs):
            rank_dir = root / str(rank)
            rank_dir.mkdir(parents=True, exist_ok=True)
            streams = redirects[rank] | tee[rank]
            for flag, name, files, tees in (
                (Std.OUT, "stdout.log", dest.stdouts, dest.tee_stdouts),
                (Std.ERR, "stderr.log", dest.stderrs, dest.tee_stderrs),
            ):
                files[rank] = str(rank_dir / name) if streams & flag else ""
                tees[rank] = files[rank] if tee[rank] & flag else os.devnull
            dest.error_files[rank] = str(rank_dir / "error.json")
            envs[rank][ERROR_FILE_ENV] = dest.error_files[rank]
        return dest

    def __repr__(self) -> str:
        return (
            f"AttemptDirLogsSpecs(log_dir={self._root_log_dir}, redirects={self._redirects}, tee={self._tee})"
        )
