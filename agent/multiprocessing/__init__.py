"""Start, watch, tail and stop the local ranks of an elastic job.

Public API (see each name's docstring for its contract):

- :func:`start_processes` → :class:`PContext` (:class:`MultiprocessContext` for
  callables, :class:`SubprocessContext` for binaries, both also built with torch's
  constructor arguments) with ``start``, ``wait``, ``pids``, ``close``, ``stdouts``,
  ``stderrs``, ``error_files``, and ``returned``/``release`` for callable ranks, which
  stay alive after they returned until released (:mod:`.handshake`);
- :class:`LogsSpecs`, :class:`DefaultLogsSpecs`, :class:`LogsDest` (torch 2.x's way to
  say where logs go; kelastic's ``log_dir``/``redirects``/``tee`` work as well);
- :class:`RunProcsResult`, :class:`ProcessFailure`, :func:`record`,
  :class:`ChildFailedError`, :class:`ErrorHandler`, :func:`get_error_handler` (error files);
- :class:`Std`, :func:`to_map` (which streams to redirect/tee; ``to_std_map`` is the
  same function under its older kelastic name);
- :class:`SignalException` (termination signals in the launching process,
  ``TORCHELASTIC_SIGNALS_TO_HANDLE`` to choose them);
- :class:`TailLog`, :func:`tail_logfile` (console tailing, progress-bar aware);
- :mod:`.redirects` (fd-level redirection of this process's own streams).

The names of ``torch.distributed.elastic.multiprocessing`` are all here, so code written
for torch's launcher runs on kelastic's. Where kelastic deliberately behaves differently
is said in :mod:`.api` (``start_processes``) and :mod:`.errors` (``ProcessFailure``).
"""

from . import redirects
from .api import start_processes
from .errors import (
    ChildFailedError,
    ErrorHandler,
    ProcessFailure,
    RunProcsResult,
    get_error_handler,
    read_error_file,
    record,
    write_error_file,
)
from .logs_specs import DefaultLogsSpecs, LogDirIsAFileError, LogsDest, LogsSpecs
from .multiprocess_context import MultiprocessContext
from .pcontext import EntrypointNotFoundError, PContext, RankMismatchError
from .progbar import new_progbar_events
from .signals import SignalException, install_signal_handlers, restore_signal_handlers
from .std import Std, to_map, to_std_map
from .subprocess_context import SubprocessContext
from .tail_log import TailLog, tail_logfile

__all__ = [
    "ChildFailedError",
    "DefaultLogsSpecs",
    "EntrypointNotFoundError",
    "ErrorHandler",
    "LogDirIsAFileError",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "RankMismatchError",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "TailLog",
    "get_error_handler",
    "install_signal_handlers",
    "new_progbar_events",
    "read_error_file",
    "record",
    "redirects",
    "restore_signal_handlers",
    "start_processes",
    "tail_logfile",
    "to_map",
    "to_std_map",
    "write_error_file",
]
