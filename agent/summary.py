"""The failure summary the agent prints when its workers failed (torchrun's layout).

:func:`format_failure_summary` is pure: it takes the failures keyed by global
rank and returns the text. The root cause is the earliest failure (by the
failure's timestamp, which comes from the error file when the worker wrote
one); every other failure is listed under "Failures". Each entry shows the
time, host, global and local rank, exit code or the killing signal's name, the
pid, the error file and the traceback (or the message) the worker recorded.

:func:`root_cause_line` is the same root cause on one line, the agent's
termination message (what a Kubernetes pod status shows as the container's
``state.terminated.message``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["describe_exit", "format_failure_summary", "root_cause_line", "root_cause_rank"]

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
    return min(failures, key=lambda r: (_failed_at(failures[r]), r))


def _failed_at(failure: Any) -> float:
    """When ``failure`` happened: its precise ``failed_at`` where it has one, else ``timestamp``."""
    return float(getattr(failure, "failed_at", 0) or getattr(failure, "timestamp", 0) or 0)


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
    others = sorted((r for r in failures if r != root), key=lambda r: (_failed_at(failures[r]), r))
    out = ["=" * _WIDTH, f"{name} FAILED", "-" * _WIDTH, "Failures:"]
    if not others:
        out.append("  <NO_OTHER_FAILURES>")
    for i, rank in enumerate(others, start=1):
        out.extend(_entry(i, rank, failures[rank], host))
    out += ["-" * _WIDTH, "Root Cause (first observed failure):"]
    out.extend(_entry(0, root, failures[root], host))
    out.append("=" * _WIDTH)
    return "\n".join(out)


def _first_message_line(failure: Any) -> str:
    """The first non-empty line of the message the worker recorded in its error file, or ``""``."""
    data = getattr(failure, "error_file_data", None)
    if not isinstance(data, Mapping):
        return ""
    msg = data.get("message")
    if isinstance(msg, Mapping):  # torch's error-file layout nests the details
        msg = msg.get("message")
    if msg == "<NONE>":  # ProcessFailure's stand-in for "no error file" (torch's)
        return ""
    for line in str(msg or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def root_cause_line(failures: Mapping[int, Any], node: str) -> str:
    """One line naming the root cause of ``failures`` (global rank → ProcessFailure).

    ``"rank 0 (local rank 0, node n) exited with code 2: ValueError: bad"``; a death
    by signal reads ``"was killed by signal 9 (SIGKILL)"``; the part after the colon
    is the first line of the worker's error-file message and is left out when the
    worker wrote none.
    """
    rank = root_cause_rank(failures)
    failure = failures[rank]
    exitcode = int(getattr(failure, "exitcode", 1))
    how = (
        f"was killed by signal {describe_exit(exitcode)[1:]}"
        if exitcode < 0
        else f"exited with code {exitcode}"
    )
    line = f"rank {rank} (local rank {getattr(failure, 'local_rank', '?')}, node {node}) {how}"
    message = _first_message_line(failure)
    return f"{line}: {message}" if message else line
