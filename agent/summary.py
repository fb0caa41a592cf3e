"""The failure summary the agent prints when its workers failed (torchrun's layout).

:func:`format_failure_summary` is pure: it takes the failures keyed by global
rank and returns the text. The root cause is the earliest failure (by the
failure's timestamp, which comes from the error file when the worker wrote
one); every other failure is listed under "Failures". Each entry shows the
time, host, global and local rank, exit code or the killing signal's name, the
pid, the error file and the traceback (or the message) the worker recorded.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["describe_exit", "format_failure_summary", "root_cause_rank"]

_WIDTH = 60


def describe_exit(exitcode: int) -> str:
    """``"1"`` for an exit code, ``"-9 (SIGKILL)"`` for a death by signal."""
    if exitcode < 0:
        try:
            return f"{exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"{exitcode} (signal {-exitcode})"
    return str(exitcode)


def root_cause_rank(failures: Mapping[int, Any]) -> int:
    """Global rank of the earliest failure (lowest rank breaks ties)."""
    if not failures:
        raise ValueError("no failures to pick a root cause from")
    return min(failures, key=lambda r: (float(getattr(failures[r], "timestamp", 0) or 0), r))


def _traceback_of(failure: Any) -> str:
    data = getattr(failure, "error_file_data", None)
    if isinstance(data, Mapping):
        tb = data.get("traceback")
        if isinstance(tb, str) and tb.strip():
            return tb.rstrip()
        msg = data.get("message")
        if isinstance(msg, Mapping):  # torch's error-file layout nests the details
            extra = msg.get("extraInfo", {})
            if isinstance(extra, Mapping) and extra.get("py_callstack"):
                return str(extra["py_callstack"]).rstrip()
    message = getattr(failure, "message", "")
    return str(message).rstrip() or "(the worker left no error file; see its stderr above or in the log dir)"


def _entry(index: int, rank: int, failure: Any, host: str) -> list[str]:
    ts = float(getattr(failure, "timestamp", 0) or 0)
    when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(ts)) if ts else "unknown"
    tb = _traceback_of(failure).splitlines() or [""]
    lines = [
        f"[{index}]:",
        f"  time      : {when}",
        f"  host      : {host}",
        f"  rank      : {rank} (local_rank: {getattr(failure, 'local_rank', '?')})",
        f"  exitcode  : {describe_exit(int(getattr(failure, 'exitcode', 1)))} (pid: {getattr(failure, 'pid', '?')})",
        f"  error_file: {getattr(failure, 'error_file', '') or '<N/A>'}",
        f"  traceback : {tb[0]}",
    ]
    lines.extend(f"              {line}" for line in tb[1:])
    return lines


def format_failure_summary(name: str, failures: Mapping[int, Any], host: str) -> str:
    """The multi-line summary for ``failures`` (global rank → ProcessFailure) of program ``name``."""
    root = root_cause_rank(failures)
    others = sorted((r for r in failures if r != root), key=lambda r: (float(failures[r].timestamp or 0), r))
    out = ["=" * _WIDTH, f"{name} FAILED", "-" * _WIDTH, "Failures:"]
    if not others:
        out.append("  <NO_OTHER_FAILURES>")
    for i, rank in enumerate(others, start=1):
        out.extend(_entry(i, rank, failures[rank], host))
    out += ["-" * _WIDTH, "Root Cause (first observed failure):"]
    out.extend(_entry(0, root, failures[root], host))
    out.append("=" * _WIDTH)
    return "\n".join(out)
