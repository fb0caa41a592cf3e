"""``start_processes`` and the ``PContext`` contract shared by both kinds of rank.

How the agent uses this module (one call per attempt of the local worker group)::

    ctx = start_processes(
        name="trainer", entrypoint="/usr/bin/python3", args={0: ("train.py",), 1: ("train.py",)},
        envs={0: {...}, 1: {...}}, log_dir=attempt_dir, redirects=Std.ALL, tee=Std.ALL,
        progbar_events=display.events,        # kelastic.agent.progress.ProgressDisplay
    )
    try:
        while (result := ctx.wait(timeout=5)) is None:
            ...                                # health checks, membership changes
    except SignalException as e:
        ctx.close(death_sig=e.sigval)          # stop ranks with the signal we got
        raise
    finally:
        ctx.close()                            # idempotent; kills every rank's whole tree

``start_processes`` returns an already started context. ``log_dir`` must be new or empty
for every call (use one directory per attempt).

torch 2.x's signature works too: ``start_processes(name, entrypoint, args, envs,
logs_specs=DefaultLogsSpecs(...), log_line_prefixes=..., start_method=...,
duplicate_stdout_filters=..., duplicate_stderr_filters=...)`` (see :mod:`.logs_specs`;
a ``LogsSpecs`` may also be passed in ``log_dir``'s place), and so do torch's
constructors ``MultiprocessContext(name, entrypoint, args, envs, start_method,
logs_specs, ...)`` and ``SubprocessContext(name, entrypoint, args, envs, logs_specs,
...)`` followed by ``start()``. As torch's, a callable rank that returned stays alive
until every local rank has returned (:mod:`.handshake` says why), and ranks that fail
at the same moment are each reported with their own exit code and error file
(:data:`FAILURE_GRACE`). ``RunProcsResult.failures`` holds the ranks that failed, as
torch's does. The ranks the launcher stopped because another one failed are reported as
torch reports them: binaries with the signal that stopped them as their exit code
(``-15``; seen after the failure that caused it, so never the root cause), callables
not at all: they did not fail, and a callable rank that returned and waited for its
local peers is never a failure when the launcher stops it. (A process that dies on its
own is a failure, as in torch, also one killed from outside after its function returned.)
What kelastic deliberately does differently from torch's ``start_processes``:

- a plain ``log_dir`` that is not empty is refused: it is the directory of one attempt,
  and logs and error files of two attempts must never mix (torch's own docstring
  expects the directory to be empty; its ``DefaultLogsSpecs`` makes a new sub-directory
  instead, and so does kelastic's);
- when a rank fails, every other rank that failed on its own within
  :data:`FAILURE_GRACE` is reported too, for callables as for binaries (torch reports one
  failed callable only): each failed rank's error is in no other place;
- a rank whose error file cannot be read (not JSON, no ``message``: a handler of the
  user's own, or a file cut short when the rank was killed while writing it) is
  reported as failed with its exit code, its message naming the file and the error,
  where torch's ``wait`` raises the ``ProcessFailure`` error: the failed rank, its exit
  code and the other ranks' outcome exist only in the launcher's result, and an
  exception would lose them (``ProcessFailure`` itself raises as torch's does);
- its errors are both torch's and kelastic's types: mismatched ``args``/``envs`` raise an
  error that is a ``RuntimeError`` and a ``ValueError``, a missing binary one that is a
  ``FileNotFoundError`` and a ``ValueError`` (raised before any rank starts), a file as
  ``log_dir`` one that is a ``NotADirectoryError`` and a ``ValueError``;
- ``numa_options`` is accepted only as ``None``: kelastic does not bind ranks to NUMA nodes.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Mapping
from threading import Event
from typing import Any, cast

from .logs_specs import AttemptDirLogsSpecs, LogsSpecs
from .multiprocess_context import MultiprocessContext
from .pcontext import (
    FAILURE_GRACE,
    START_METHODS,
    EntrypointNotFoundError,
    PContext,
    RankLogs,
    RankMismatchError,
    check_numa_options,
    logs_from_dest,
    validate_rank_keys,
)
from .std import Std, to_std_map
from .subprocess_context import SubprocessContext

__all__ = [
    "FAILURE_GRACE",
    "EntrypointNotFoundError",
    "MultiprocessContext",
    "PContext",
    "RankLogs",
    "RankMismatchError",
    "SubprocessContext",
    "check_numa_options",
    "logs_from_dest",
    "start_processes",
    "validate_rank_keys",
]


def start_processes(
    name: str,
    entrypoint: Callable[..., Any] | str,
    args: Mapping[int, tuple[Any, ...]],
    envs: Mapping[int, Mapping[str, str]],
    log_dir: str | os.PathLike[str] | LogsSpecs | None = None,
    start_method: str = "spawn",
    redirects: Std | int | Mapping[int, Std | int] = Std.NONE,
    tee: Std | int | Mapping[int, Std | int] = Std.NONE,
    progbar_events: dict[str, Event] | None = None,
    *,
    logs_specs: LogsSpecs | None = None,
    log_line_prefixes: Mapping[int, str] | None = None,
    numa_options: object | None = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
    hold: bool = False,
    failure_grace: float = FAILURE_GRACE,
) -> PContext:
    """Start ``len(args)`` local ranks and return the started :class:`PContext`.

    - ``entrypoint``: a callable (run with ``multiprocessing`` using ``start_method``;
      it must be picklable for spawn/forkserver; its return value comes back in
      ``RunProcsResult.return_values``) or the path/name of a binary (run as a
      subprocess; each argument is passed as ``str(arg)``).
    - ``args``/``envs``: keyed by local rank, both exactly ``0..n-1``. ``envs[rank]`` is
      added to the launcher's environment for that rank; ``TORCHELASTIC_ERROR_FILE``
      is set to the rank's error file.
    - Where logs go, one of two ways:

      * kelastic's: ``log_dir`` (new or empty) with ``redirects``/``tee``: ``Std`` masks
        for all ranks or ``{rank: Std}`` (missing ranks = NONE). Redirected streams go to
        ``{log_dir}/{rank}/stdout.log`` / ``stderr.log``, the error file is
        ``{log_dir}/{rank}/error.json``; teed streams are redirected *and* printed to the
        launcher's stdout/stderr with a ``[{name}{local_rank}]:`` header;
      * torch's: ``logs_specs`` (a :class:`~.logs_specs.LogsSpecs`, torch's own included;
        also accepted in ``log_dir``'s place), which holds the redirects and tee too.

    - ``log_line_prefixes``: ``{local_rank: header}`` replacing the default header.
    - ``duplicate_stdout_filters``/``duplicate_stderr_filters``: teed lines containing any
      of these strings, of all ranks, are also copied to one file: the spec's
      ``filtered_stdout``/``filtered_stderr``, or ``{log_dir}/filtered_stdout.log`` /
      ``filtered_stderr.log``.
    - ``progbar_events``: ``ProgressDisplay.events`` of the node's progress display, so
      console lines never tear the bar; None when there is no display.
    - ``hold`` (callables only): keep the ranks that returned alive until
      :meth:`PContext.release` instead of until every local rank returned (see
      :mod:`.handshake`); :meth:`PContext.returned` says when they all have.
    - ``failure_grace``: seconds the other ranks get to end on their own once one failed
      (:data:`FAILURE_GRACE` by default). An agent that polls passes its monitor interval:
      it then reports what torch's agent, which polls as often, would have seen, and a
      crash's recovery does not wait a second for ranks stuck in a collective.

    Raises ``ValueError`` (see the module docstring for the torch types each one also is)
    for inconsistent ranks, an unknown start method, a missing binary, a ``log_dir`` that
    exists and is not an empty directory, or log arguments of both kinds; ``TypeError``
    for an entrypoint that is neither callable nor str.
    """
    nprocs = validate_rank_keys(args, envs)
    if not isinstance(entrypoint, str) and not callable(entrypoint):
        raise TypeError(
            f"entrypoint must be a callable or a binary path (str), got {type(entrypoint).__name__}"
        )
    if isinstance(entrypoint, str) and shutil.which(entrypoint) is None:
        raise EntrypointNotFoundError(
            errno.ENOENT, f"entrypoint binary {entrypoint!r} was not found or is not executable", entrypoint
        )
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}; got {start_method!r}")
    check_numa_options(numa_options)
    logs_specs = _where_logs_go(log_dir, logs_specs, redirects, tee, nprocs)
    common: dict[str, Any] = {
        "log_line_prefixes": log_line_prefixes,
        "duplicate_stdout_filters": duplicate_stdout_filters,
        "duplicate_stderr_filters": duplicate_stderr_filters,
        "progbar_events": progbar_events,
    }
    context: PContext
    if isinstance(entrypoint, str):
        context = SubprocessContext(name, entrypoint, args, envs, logs_specs, **common)
    else:
        context = MultiprocessContext(
            name, entrypoint, args, envs, start_method, logs_specs, hold=hold, **common
        )
    context.failure_grace = max(0.0, failure_grace)
    try:
        context.start()
    except BaseException:
        context.close(timeout=5)
        raise
    return context


def _where_logs_go(
    log_dir: str | os.PathLike[str] | LogsSpecs | None,
    logs_specs: LogsSpecs | None,
    redirects: Std | int | Mapping[int, Std | int],
    tee: Std | int | Mapping[int, Std | int],
    nprocs: int,
) -> LogsSpecs:
    """The one :class:`LogsSpecs` of :func:`start_processes`' two ways to say where logs go
    (pure); ValueError when both or neither are given."""
    if log_dir is not None and hasattr(log_dir, "reify"):
        if logs_specs is not None:
            raise ValueError("pass the LogsSpecs once: as logs_specs or in log_dir's place, not both")
        # torch's own LogsSpecs is not ours by class, only by shape: check the method.
        logs_specs, log_dir = cast(LogsSpecs, log_dir), None
    if logs_specs is not None:
        if (
            log_dir is not None
            or any(to_std_map(redirects, nprocs).values())
            or any(to_std_map(tee, nprocs).values())
        ):
            raise ValueError(
                "pass either logs_specs (which holds log_dir, redirects and tee) or log_dir/redirects/tee, not both"
            )
        return logs_specs
    if log_dir is None:
        raise ValueError("pass where logs go: log_dir (kelastic) or logs_specs (torch 2.x)")
    return AttemptDirLogsSpecs(log_dir, redirects, tee)
