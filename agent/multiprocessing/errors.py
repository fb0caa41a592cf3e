"""Outcomes of a run: per-rank failures, the run result, and error files.

A rank reports *why* it failed through an error file written to the path in
``TORCHELASTIC_ERROR_FILE``, in torch.distributed.elastic's layout, so tools that read
torch's error files read ours::

    {"message": {"message": "ValueError: bad lr",
                 "extraInfo": {"py_callstack": "<traceback>", "timestamp": "1700000000",
                               "precise_timestamp": 1700000000.25}}}

(``timestamp`` is whole seconds as a string, as torch writes it; ``precise_timestamp``
is kelastic's addition, so the first of several failures within one second is still
told apart.) The older flat layout ``{"message", "traceback", "timestamp"}`` is still
read. Callables launched by ``start_processes`` are wrapped in :func:`record`
automatically; a script (or binary) can decorate its ``main`` with it.

Compatible with ``torch.distributed.elastic.multiprocessing.errors``: :class:`ProcessFailure`
(``error_file`` is ``"<N/A>"`` and ``error_file_data`` ``{"message": "<NONE>"}`` when the rank
wrote no error file, ``timestamp`` is whole seconds, ``signal_name()`` is ``"<N/A>"`` for an
exit code; without an error file the message is torch's: ``"Signal 9 (SIGKILL) received by
PID 41"`` for a signal, else its pointer to the documentation of ``@record``, with torch's
``errorTraits`` in ``error_file_data``, since the exit code and pid are fields of their own
and only the traceback is missing; an error file that is not JSON raises its
``JSONDecodeError``, one without ``message`` a :class:`MalformedErrorFileError`, a
``KeyError`` as torch's), :class:`ChildFailedError`, :class:`ErrorHandler`,
:func:`get_error_handler`, and :func:`record`, which returns ``None`` on ``SystemExit(0)``.
(The launcher, which must still report such a rank's failure, catches that error: see
:mod:`.api`.) Where kelastic deliberately differs:

- ``ProcessFailure.message`` is always a str. torch puts the error file's nested dict there
  when the file is in its layout; kelastic puts the recorded message (``"ValueError: bad
  lr"``) there and keeps the whole file in ``error_file_data``.
- ``ProcessFailure`` also accepts ``message``, ``timestamp`` and ``error_file_data`` as
  arguments (the agent builds failures for hung ranks that way) and has ``failed_at``
  (float seconds) and ``traceback()``.
- :func:`record` records every exception, ``KeyboardInterrupt`` included, not only
  ``Exception`` subclasses, and takes an ``error_file`` argument besides torch's
  ``error_handler``.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, cast, overload

__all__ = [
    "ERROR_FILE_ENV",
    "NOT_AVAILABLE",
    "NO_TRACEBACK_MESSAGE",
    "ChildFailedError",
    "ErrorHandler",
    "MalformedErrorFileError",
    "ProcessFailure",
    "RunProcsResult",
    "error_file_payload",
    "exitcode_message",
    "get_error_handler",
    "read_error_file",
    "record",
    "write_error_file",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the file a rank writes its error report to.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

#: What torch shows for a missing error file or signal name; kept for tools that test for it.
NOT_AVAILABLE = "<N/A>"


#: ``ProcessFailure.message`` of a rank that exited with a code and left no error file
#: (torch's text: the traceback is what is missing, and @record is how to get it).
NO_TRACEBACK_MESSAGE = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
_NO_TRACEBACK_TRAITS = {"category": "system_terminated_error", "retryability": "False"}


def _empty_error_data() -> dict[str, Any]:
    """``error_file_data`` of a rank that wrote no error file (torch's sentinel, a fresh copy)."""
    return {"message": "<NONE>"}


F = TypeVar("F", bound=Callable[..., Any])


def exitcode_message(exitcode: int, pid: int) -> str:
    """Describe an exit code; a negative code is a death by signal and is named (``Signal 9 (SIGKILL)``)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = NOT_AVAILABLE
        return f"Signal {-exitcode} ({name}) received by PID {pid}"
    return f"Process {pid} exited with code {exitcode}"


def error_file_payload(exc: BaseException, now: float | None = None) -> dict[str, Any]:
    """The error-file object for ``exc`` in torch's layout (see the module docstring); pure."""
    when = time.time() if now is None else now
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                "timestamp": str(int(when)),
                "precise_timestamp": when,
            },
        }
    }


def _write_json_atomically(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, target)


def write_error_file(path: str | os.PathLike[str], exc: BaseException) -> None:
    """Write ``exc`` to ``path`` in torch's error-file layout (atomically, via rename)."""
    _write_json_atomically(path, error_file_payload(exc))


def _float(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def normalize_error_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """``{"message", "traceback", "timestamp"}`` of error-file data in either layout (pure).

    ``timestamp`` is float seconds: the precise time where the file has one.
    """
    message = data.get("message")
    if isinstance(message, Mapping):  # torch's layout
        extra = message.get("extraInfo") or {}
        if not isinstance(extra, Mapping):
            extra = {}
        return {
            "message": str(message.get("message", "")),
            "traceback": str(extra.get("py_callstack", "")),
            "timestamp": _float(extra.get("precise_timestamp")) or _float(extra.get("timestamp")),
        }
    return {
        "message": str(message or ""),
        "traceback": str(data.get("traceback", "")),
        "timestamp": _float(data.get("timestamp")),
    }


class MalformedErrorFileError(KeyError, ValueError):
    """An error file that is JSON but not in either layout (no ``message``, or torch's
    layout without ``extraInfo.timestamp``): the ``KeyError`` torch raises, and a
    ``ValueError`` like an error file that is not JSON at all."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _load_error_file_strictly(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The error file's object, checked as torch's ``ProcessFailure`` checks it.

    Raises ``json.JSONDecodeError`` (a ``ValueError``) for a file that is not JSON and
    :class:`MalformedErrorFileError` for one without what a reader needs.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "message" not in data:
        raise MalformedErrorFileError(
            f"error file {path} has no 'message' (write it with record() or ErrorHandler)"
        )
    message = data["message"]
    if isinstance(message, Mapping):
        extra = message.get("extraInfo")
        if not isinstance(extra, Mapping) or "timestamp" not in extra:
            raise MalformedErrorFileError(f"error file {path} has no message.extraInfo.timestamp")
    return data


def _load_error_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_error_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read an error file (either layout); ``None`` if it is missing or not a JSON object.

    Returns :func:`normalize_error_data` of it, with the file's object under ``"raw"``.
    """
    data = _load_error_file(path)
    if data is None:
        return None
    return {**normalize_error_data(data), "raw": data}


class ErrorHandler:
    """Writes a process's exception to its error file (``$TORCHELASTIC_ERROR_FILE``).

    The same methods as torch's ``ErrorHandler``: ``initialize()`` (turns on
    :mod:`faulthandler`), ``record_exception(e)`` (call it from an ``except`` block; does
    nothing without an error file) and ``dump_error_file(child_file, error_code)`` (copy a
    child's error file to this process's, setting ``errorCode`` when non-zero). Subclass it
    and override ``_get_error_file_path`` to write elsewhere.
    """

    def _get_error_file_path(self) -> str | None:
        return os.environ.get(ERROR_FILE_ENV) or None

    def initialize(self) -> None:
        try:
            faulthandler.enable(all_threads=True)
        except Exception as e:  # no usable stderr (closed, or not a real file): run without it
            logger.warning("could not enable faulthandler: %s: %s", type(e).__name__, e)

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        try:
            write_error_file(path, e)
        except OSError as write_exc:
            print(f"kelastic: could not write error file {path}: {write_exc}", file=sys.stderr)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        data = json.loads(Path(rootcause_error_file).read_text())
        message = data.get("message") if isinstance(data, dict) else None
        if error_code and isinstance(message, dict):
            # A child killed by a signal cannot record its own exit code.
            message["errorCode"] = error_code
        mine = self._get_error_file_path()
        if not mine:
            logger.error("no error file for this process to copy the child's %s to", rootcause_error_file)
            return
        _write_json_atomically(mine, data)


def get_error_handler() -> ErrorHandler:
    """The error handler :func:`record` uses when none is given."""
    return ErrorHandler()


class _FileErrorHandler(ErrorHandler):
    """Writes to a fixed path, else ``$TORCHELASTIC_ERROR_FILE`` (``record(error_file=...)``)."""

    def __init__(self, path: str) -> None:
        self._path = path

    def _get_error_file_path(self) -> str | None:
        return self._path


@overload
def record(fn: F, error_handler: ErrorHandler | None = None, *, error_file: str | None = None) -> F: ...
@overload
def record(
    fn: None = None, error_handler: ErrorHandler | None = None, *, error_file: str | None = None
) -> Callable[[F], F]: ...
def record(
    fn: F | None = None, error_handler: ErrorHandler | None = None, *, error_file: str | None = None
) -> F | Callable[[F], F]:
    """Decorator: if ``fn`` raises, write the exception to the error file, then re-raise.

    The error file is ``error_file`` if given, else the ``error_handler``'s (default:
    ``$TORCHELASTIC_ERROR_FILE``); without one, the exception just propagates.
    ``SystemExit(0)`` returns ``None`` (a script that calls ``sys.exit(0)`` succeeded);
    any other ``SystemExit`` is an intentional exit and propagates unrecorded. A
    :class:`ChildFailedError` copies the first failed child's error file instead of
    recording itself (and writes nothing when that child left no error file). Usable bare (``@record``) or with arguments.
    """
    if fn is None:
        return functools.partial(record, error_handler=error_handler, error_file=error_file)
    handler = _FileErrorHandler(error_file) if error_file else (error_handler or get_error_handler())

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        handler.initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as exit_:
            if exit_.code == 0:
                return None
            raise
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            if failure.error_file != NOT_AVAILABLE and os.path.isfile(failure.error_file):
                handler.dump_error_file(failure.error_file, failure.exitcode)
            else:
                # Not recorded as this process's own error: the child's is what matters,
                # and a reader of the error file would take the launcher for the culprit.
                logger.info(
                    "rank %s failed without an error file; decorate its entrypoint with @record", rank
                )
            raise
        except BaseException as exc:
            handler.record_exception(exc)
            raise

    return cast(F, wrapper)  # functools.wraps keeps fn's signature


@dataclass
class ProcessFailure:
    """One failed rank (torch's ``ProcessFailure``, see the module docstring for the differences).

    ``exitcode`` < 0 means killed by signal ``-exitcode``. ``error_file_data`` is the
    error file's JSON as written (``{"message": "<NONE>"}`` and ``error_file ==
    "<N/A>"`` when the rank wrote none). ``message`` is the recorded message, else a
    description of the exit code. ``timestamp`` is when the failure happened in whole
    seconds since the epoch (the error file's time if present, else when it was seen);
    ``failed_at`` is the same in float seconds, for ordering failures.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str = ""
    timestamp: int = 0
    error_file_data: dict[str, Any] = field(default_factory=dict)
    failed_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.error_file_data and self.error_file and os.path.isfile(self.error_file):
            self.error_file_data = _load_error_file_strictly(self.error_file)
        if not self.error_file_data:
            if not (self.error_file and os.path.isfile(self.error_file)):
                self.error_file = NOT_AVAILABLE
            self.error_file_data = _empty_error_data()
            recorded: dict[str, Any] = {"message": "", "traceback": "", "timestamp": 0.0}
        else:
            recorded = normalize_error_data(self.error_file_data)
        self.message = self.message or str(recorded["message"])
        self.failed_at = (
            self.failed_at or float(recorded["timestamp"]) or float(self.timestamp) or time.time()
        )
        self.timestamp = int(self.timestamp or self.failed_at)
        if not self.message:
            if self.exitcode < 0:
                self.message = exitcode_message(self.exitcode, self.pid)
            else:
                # torch's answer: the exit code and pid are fields already; what is missing
                # is the traceback, which the rank records by running under @record.
                self.error_file_data["errorTraits"] = dict(_NO_TRACEBACK_TRAITS)
                self.message = NO_TRACEBACK_MESSAGE

    def signal_name(self) -> str:
        """``"SIGKILL"`` etc. for a death by signal, ``"<N/A>"`` otherwise (as torch)."""
        if self.exitcode >= 0:
            return NOT_AVAILABLE
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """``timestamp`` as local ``YYYY-MM-DD_HH:MM:SS``."""
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")

    def traceback(self) -> str:
        """The failing rank's traceback from its error file, or ``""``."""
        return str(normalize_error_data(self.error_file_data).get("traceback", ""))


class ChildFailedError(Exception):
    """Raised by a launcher whose children failed, to report the children's root cause.

    ``failures`` maps (global) rank to :class:`ProcessFailure` and must not be empty.
    Under :func:`record`, the first failure's error file is copied to the launcher's own
    error file, so whoever reads the launcher's sees the child's error. ``str(e)`` is the
    failure summary (root cause first, as the agent prints it).
    """

    def __init__(self, name: str, failures: Mapping[int, ProcessFailure]) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = dict(failures)
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        """``(rank, failure)`` of the earliest failure (lowest rank breaks ties)."""
        rank = min(self.failures, key=lambda r: (self.failures[r].failed_at, r))
        return rank, self.failures[rank]

    def format_msg(self) -> str:
        from kelastic.agent.summary import format_failure_summary

        return "\n" + format_failure_summary(self.name, self.failures, socket.getfqdn())


@dataclass
class RunProcsResult:
    """What a finished run returned.

    ``return_values`` has one entry per rank when every rank succeeded (``None`` for
    binaries); ``failures`` the failed ranks; ``stdouts``/``stderrs`` the log file of
    each rank's stream, or ``""`` when that stream was not redirected.
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return bool(self.failures)

    def root_failure(self) -> ProcessFailure | None:
        """The earliest failure (ties broken by local rank): the likely root cause."""
        if not self.failures:
            return None
        return min(self.failures.values(), key=lambda f: (f.failed_at, f.local_rank))

    def summary(self) -> str:
        """Human-readable account of the failures, root cause first; ``""`` on success."""
        root = self.root_failure()
        if root is None:
            return ""
        lines = [f"root cause (first failure): local_rank {root.local_rank} (pid {root.pid}): {root.message}"]
        others = sorted((f for f in self.failures.values() if f is not root), key=lambda f: f.failed_at)
        lines += [f"also failed: local_rank {f.local_rank} (pid {f.pid}): {f.message}" for f in others]
        tb = root.traceback()
        if tb:
            lines.append(f"traceback of local_rank {root.local_rank}:\n{tb.rstrip()}")
        return "\n".join(lines)
