"""Outcomes of a run: per-rank failures, the run result, and error files.

A rank reports *why* it failed through an error file: a JSON object
``{"message": str, "traceback": str, "timestamp": float}`` written to the path in
``TORCHELASTIC_ERROR_FILE``. Callables launched by ``start_processes`` are wrapped in
:func:`record` automatically; a script (or binary) can decorate its ``main`` with it.
Error files written by ``torch.distributed.elastic``'s own ``@record`` are read too.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast, overload

__all__ = [
    "ERROR_FILE_ENV",
    "ProcessFailure",
    "RunProcsResult",
    "exitcode_message",
    "read_error_file",
    "record",
    "write_error_file",
]

#: Environment variable naming the file a rank writes its error report to.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

F = TypeVar("F", bound=Callable[..., Any])


def exitcode_message(exitcode: int, pid: int) -> str:
    """Describe an exit code; a negative code is a death by signal and is named (``Signal 9 (SIGKILL)``)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"Signal {-exitcode} ({name}) received by PID {pid}"
    return f"Process {pid} exited with code {exitcode}"


def write_error_file(path: str | os.PathLike[str], exc: BaseException) -> None:
    """Write ``exc`` as ``{message, traceback, timestamp}`` JSON to ``path`` (atomically, via rename)."""
    data = {
        "message": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "timestamp": time.time(),
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, target)


def read_error_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read an error file; ``None`` if it is missing or not a JSON object.

    Normalises torch's nested layout (``{"message": {"message": ..., "extraInfo": {...}}}``)
    to ours, keeping the original under ``"raw"``.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    message = data.get("message")
    if isinstance(message, dict):  # torch.distributed.elastic's format
        extra = message.get("extraInfo") or {}
        return {
            "message": str(message.get("message", "")),
            "traceback": str(extra.get("py_callstack", "")),
            "timestamp": float(extra.get("timestamp", 0) or 0),
            "raw": data,
        }
    return {
        "message": str(message or ""),
        "traceback": str(data.get("traceback", "")),
        "timestamp": float(data.get("timestamp", 0) or 0),
    }


@overload
def record(fn: F, *, error_file: str | None = None) -> F: ...
@overload
def record(fn: None = None, *, error_file: str | None = None) -> Callable[[F], F]: ...
def record(fn: F | None = None, *, error_file: str | None = None) -> F | Callable[[F], F]:
    """Decorator: if ``fn`` raises, write the exception to the error file, then re-raise.

    The error file is ``error_file`` if given, else ``$TORCHELASTIC_ERROR_FILE``; without
    either, the exception just propagates. ``SystemExit`` is an intentional exit and is
    not recorded. Usable bare (``@record``) or with arguments (``@record(error_file=...)``).
    """
    if fn is None:
        return functools.partial(record, error_file=error_file)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as exc:
            path = error_file or os.environ.get(ERROR_FILE_ENV)
            if path:
                try:
                    write_error_file(path, exc)
                except OSError as write_exc:
                    print(f"kelastic: could not write error file {path}: {write_exc}", file=sys.stderr)
            raise

    return cast(F, wrapper)  # functools.wraps keeps fn's signature


@dataclass
class ProcessFailure:
    """One failed rank.

    ``exitcode`` < 0 means killed by signal ``-exitcode``. ``message`` comes from the
    error file when the rank wrote one, else describes the exit code. ``timestamp`` is
    when the failure happened (the error file's time if present, else when it was seen),
    in seconds since the epoch.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str = ""
    timestamp: float = 0.0
    error_file_data: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.error_file_data is None and self.error_file:
            self.error_file_data = read_error_file(self.error_file)
        if self.error_file_data is not None:
            self.message = self.message or self.error_file_data.get("message", "")
            self.timestamp = self.error_file_data.get("timestamp") or self.timestamp
        if not self.message:
            self.message = exitcode_message(self.exitcode, self.pid)
        if not self.timestamp:
            self.timestamp = time.time()

    def signal_name(self) -> str:
        """``"SIGKILL"`` etc. for a death by signal, ``""`` otherwise."""
        if self.exitcode >= 0:
            return ""
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def traceback(self) -> str:
        """The failing rank's traceback from its error file, or ``""``."""
        return str((self.error_file_data or {}).get("traceback", ""))


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
        return min(self.failures.values(), key=lambda f: (f.timestamp, f.local_rank))

    def summary(self) -> str:
        """Human-readable account of the failures, root cause first; ``""`` on success."""
        root = self.root_failure()
        if root is None:
            return ""
        lines = [f"root cause (first failure): local_rank {root.local_rank} (pid {root.pid}): {root.message}"]
        others = sorted((f for f in self.failures.values() if f is not root), key=lambda f: f.timestamp)
        lines += [f"also failed: local_rank {f.local_rank} (pid {f.pid}): {f.message}" for f in others]
        tb = root.traceback()
        if tb:
            lines.append(f"traceback of local_rank {root.local_rank}:\n{tb.rstrip()}")
        return "\n".join(lines)
