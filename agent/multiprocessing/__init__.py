"""Start, watch, tail and stop the local ranks of an elastic job.

Public API (see each name's docstring for its contract):

- :func:`start_processes` → :class:`PContext` (:class:`MultiprocessContext` for
  callables, :class:`SubprocessContext` for binaries) with ``start``, ``wait``,
  ``pids``, ``close``;
- :class:`RunProcsResult`, :class:`ProcessFailure`, :func:`record` (error files);
- :class:`Std` (which streams to redirect/tee);
- :class:`SignalException` (termination signals in the launching process);
- :class:`TailLog`, :func:`tail_logfile` (console tailing, progress-bar aware).
"""

from .api import PContext, start_processes
from .errors import ProcessFailure, RunProcsResult, read_error_file, record, write_error_file
from .multiprocess_context import MultiprocessContext
from .progbar import new_progbar_events
from .signals import SignalException, install_signal_handlers, restore_signal_handlers
from .std import Std, to_std_map
from .subprocess_context import SubprocessContext
from .tail_log import TailLog, tail_logfile

__all__ = [
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "TailLog",
    "install_signal_handlers",
    "new_progbar_events",
    "read_error_file",
    "record",
    "restore_signal_handlers",
    "start_processes",
    "tail_logfile",
    "to_std_map",
    "write_error_file",
]
