"""Helm's own lines, said with a prefix.

helm-python-sdk runs Helm's Go code in this process, and Helm's loader logs through Go's
default logger straight to file descriptor 2 (``2026/11/28 15:34:06 INFO found symbolic
link in path. ...``), past Python and past the SDK's log hook. :func:`helm_lines` catches
those writes while Helm runs: it points descriptor 2 at a pipe, and a thread hands each line
in Go's log format to ``say`` as ``helm: INFO found symbolic link ...`` (without Go's
timestamp); any other line (another thread's) goes on to the real stderr as it was.

Helm's notice that a chart file is a symbolic link (the chart ships its CRD as a link to the
repository's) says nothing a user can act on: it goes to this module's DEBUG log instead.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["go_log_line", "helm_lines"]

#: Go's log line: ``2026/11/28 15:34:06 INFO message`` (date, time, then the record).
_GO_LOG = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(?:\.\d+)? (.*)$")
#: One redirection at a time: descriptor 2 is the whole process's.
_LOCK = threading.Lock()
#: Helm's lines that tell a user nothing to act on (kept at DEBUG).
_QUIET = ("INFO found symbolic link in path",)
log = logging.getLogger(__name__)


def go_log_line(line: str) -> str | None:
    """``line`` without Go's timestamp when it is a Go log line, else None."""
    found = _GO_LOG.match(line)
    return found.group(1) if found else None


@contextmanager
def helm_lines(say: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, Go log lines written to descriptor 2 go to ``say`` as ``helm: ...``."""
    with _LOCK:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        relay = threading.Thread(target=_relay, args=(read_end, saved, say), name="helm-lines", daemon=True)
        relay.start()
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)  # the pipe's last writer is gone: the relay reads to its end
            relay.join()
            os.close(saved)


def _relay(read_end: int, stderr: int, say: Callable[[str], None]) -> None:
    with os.fdopen(read_end, "r", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            text = go_log_line(line.rstrip("\n"))
            if text is None:
                os.write(stderr, line.encode())
                continue
            if text.startswith(_QUIET):
                log.debug("helm: %s", text)
                continue
            try:
                say(f"helm: {text}")
            except Exception:  # a broken sink must not stop the relay: Helm would block on the pipe
                os.write(stderr, line.encode())
