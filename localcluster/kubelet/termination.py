"""Container termination messages, as a kubelet reads them.

A container's ``terminationMessagePath`` (default ``/dev/termination-log``) names a
file inside the container where the program may leave its last words. On a shared
host there is no per-container filesystem, so the process kubelet maps that path
to a fresh file per container run, ``<pod dir>/<container>/<restartCount>.termination-log``,
and tells the program where it is with the environment variable
:data:`ENV_TERMINATION_MESSAGE_PATH`. When the container ends, its message is

* the file's content (at most :data:`MAX_MESSAGE_BYTES`), or
* with ``terminationMessagePolicy: FallbackToLogsOnError`` and an empty file, when
  the container failed (exit code != 0): the last :data:`MAX_LOG_LINES` lines of its
  log, at most :data:`MAX_LOG_BYTES`,

and it is shown in ``containerStatuses[].state.terminated.message``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "ENV_TERMINATION_MESSAGE_PATH",
    "MAX_LOG_BYTES",
    "MAX_LOG_LINES",
    "MAX_MESSAGE_BYTES",
    "message_file",
    "read_termination_message",
]

#: Where a container's ``terminationMessagePath`` is mapped on this host.
ENV_TERMINATION_MESSAGE_PATH = "KELASTIC_TERMINATION_MESSAGE_PATH"
#: A real kubelet's limits (bytes of the file; lines and bytes of a log fallback).
MAX_MESSAGE_BYTES = 4096
MAX_LOG_LINES = 80
MAX_LOG_BYTES = 2048

FALLBACK_TO_LOGS = "FallbackToLogsOnError"


def message_file(container_dir: Path, restart_count: int) -> Path:
    """The host file a container run's ``terminationMessagePath`` maps to."""
    return container_dir / f"{restart_count}.termination-log"


def _tail(path: Path, lines: int, max_bytes: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            # Read enough to hold the lines wanted; lines longer than that are cut anyway.
            f.seek(max(0, size - max(max_bytes * 4, 64 * 1024)))
            data = f.read()
    except OSError:
        return ""
    text = b"\n".join(data.splitlines()[-lines:])
    return text[-max_bytes:].decode("utf-8", errors="replace")


def read_termination_message(message_path: Path, log_path: Path, policy: str | None, exit_code: int) -> str:
    """The message of a container run that ended with ``exit_code`` (``""`` for none)."""
    try:
        with open(message_path, "rb") as f:
            message = f.read(MAX_MESSAGE_BYTES).decode("utf-8", errors="replace")
    except OSError:
        message = ""
    if not message.strip() and policy == FALLBACK_TO_LOGS and exit_code != 0:
        message = _tail(log_path, MAX_LOG_LINES, MAX_LOG_BYTES)
    return message
