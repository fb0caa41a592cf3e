"""Tail rank log files to the console: ``TailLog`` (one thread for many files) and ``tail_logfile``.

Contract:

- files that do not exist yet are waited for (checked every ``interval_sec``);
- each file's lines come out whole and in order, prefixed with the file's header;
- everything written before ``stop()`` is printed by the time ``stop()`` returns,
  including a final line without a trailing newline;
- carriage-return progress output (tqdm in a rank) collapses to its latest state: a
  completed line prints only the text after its last ``\\r``; a line still being
  rewritten is shown at most once per ``cr_interval_sec`` (its latest state);
- no busy loop: an idle tailer sleeps until a log directory changes (inotify; at most
  ``interval_sec`` as a fallback), so a new line is printed within milliseconds; while
  lines flow it reads up to 1 MiB per file per pass and prints one batch per pass;
- with ``progbar_events`` from the node's progress display, each batch is printed
  inside a :func:`~.progbar.console_turn` so the bar is erased first and redrawn after;
- ``log_line_filter`` (torch's): only lines for which it returns True are printed; it
  gets each line as text with its trailing newline.

torch's ``TailLog(name, log_files, dst, log_line_prefixes, interval_sec, log_line_filter)``
call works too: a mapping in the fourth place is taken as ``log_line_prefixes``.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from .fswatch import ChangeWaiter
from .progbar import CONSOLE_LOCK, console_turn

__all__ = ["TailLog", "tail_logfile"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_PER_FILE_ROUND = 1 << 20
_MAX_PARTIAL = 1 << 20  # a "line" longer than this without a newline is printed in pieces
_ACTIVE_SLEEP = 0.02


def _last_state(line: bytes) -> bytes:
    """What a terminal would show for a carriage-return-rewritten line: its last non-empty segment."""
    for seg in reversed(line.split(b"\r")):
        if seg:
            return seg
    return b""


def _collapse_cr(block: bytes) -> bytes:
    return b"\n".join(_last_state(line) if b"\r" in line else line for line in block.split(b"\n"))


class _FileTail:
    """Incremental reader of one log file that turns appended bytes into headed lines."""

    def __init__(
        self, path: str, header: bytes, cr_interval: float, line_filter: Callable[[str], bool] | None = None
    ) -> None:
        self.path = path
        self.header = header
        self.line_filter = line_filter
        self.cr_interval = cr_interval
        self.fd: int | None = None
        self.pending = b""  # the current incomplete line
        self.cr_state: bytes | None = None  # latest state of a line being rewritten with \r
        self.cr_dirty = False
        self.cr_shown_at = float("-inf")
        self.open_error: str | None = None

    def _headed(self, block: bytes) -> bytes:
        if self.line_filter is not None:
            keep = self.line_filter
            lines = [ln for ln in block.split(b"\n") if keep(ln.decode("utf-8", errors="replace") + "\n")]
            if not lines:
                return b""
            block = b"\n".join(lines)
        if self.header:
            return self.header + block.replace(b"\n", b"\n" + self.header) + b"\n"
        return block + b"\n"

    def _set_pending(self, data: bytes) -> None:
        if b"\r" not in data:
            self.pending = data
            return
        segments = data.split(b"\r")
        tail = segments[-1]
        last = _last_state(data)
        # Keep only what can still be shown: the text after the last \r, or (when the
        # line ends in \r) its last state, so a following "\n" still prints that state.
        self.pending = tail if tail else (last + b"\r" if last else b"")
        if last and last != self.cr_state:
            self.cr_state = last
            self.cr_dirty = True

    def _cr_tick(self, now: float) -> bytes:
        if self.cr_dirty and self.cr_state and now - self.cr_shown_at >= self.cr_interval:
            self.cr_dirty = False
            self.cr_shown_at = now
            return self._headed(self.cr_state)
        return b""

    def read(self, now: float) -> tuple[bytes, bool]:
        """New complete lines (headed), and whether more data is waiting to be read."""
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return b"", False
            except OSError as exc:
                if self.open_error is None:
                    self.open_error = str(exc)
                    logger.warning("cannot tail %s: %s (will retry)", self.path, exc)
                return b"", False
        chunks = []
        total = 0
        backlog = True
        while total < _PER_FILE_ROUND:
            chunk = os.read(self.fd, _CHUNK)
            chunks.append(chunk)
            total += len(chunk)
            if len(chunk) < _CHUNK:
                backlog = False
                break
        if not total:
            return self._cr_tick(now), False
        data = self.pending + b"".join(chunks)
        cut = data.rfind(b"\n")
        if cut < 0:
            if len(data) > _MAX_PARTIAL:
                self.pending = b""
                return self._headed(data), backlog
            self._set_pending(data)
            return self._cr_tick(now), backlog
        complete = data[:cut]
        if b"\r" in complete:
            complete = _collapse_cr(complete)
        self.cr_state = None
        self.cr_dirty = False
        self._set_pending(data[cut + 1 :])
        return self._headed(complete) + self._cr_tick(now), backlog

    def finish(self) -> bytes:
        """The final incomplete line (its latest state if it was rewritten with \\r), headed."""
        rest = _last_state(self.pending) if b"\r" in self.pending else self.pending
        self.pending = b""
        self.cr_state = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        return self._headed(rest) if rest else b""


def _write(dst: IO[Any], data: bytes) -> None:
    if isinstance(dst, (io.RawIOBase, io.BufferedIOBase)):
        dst.write(data)
        dst.flush()
        return
    buffer = getattr(dst, "buffer", None)
    if buffer is not None:
        dst.flush()  # text written earlier through the text layer goes first
        buffer.write(data)
        buffer.flush()
    else:
        dst.write(data.decode("utf-8", errors="replace"))
        dst.flush()


class _Printer:
    """Writes batches to ``dst`` under the shared console lock and the display handshake."""

    def __init__(self, dst: IO[Any], lock: Any, progbar_events: Mapping[str, threading.Event] | None) -> None:
        self.dst = dst
        self.lock = lock if lock is not None else CONSOLE_LOCK
        self.events = progbar_events
        self.failed = False

    def __call__(self, data: bytes) -> None:
        if not data:
            return
        with self.lock, console_turn(self.events):
            try:
                _write(self.dst, data)
            except (OSError, ValueError) as exc:
                if not self.failed:
                    self.failed = True
                    logger.warning("cannot write tailed log lines to %r: %s; dropping them", self.dst, exc)


def _tail_loop(
    tails: list[_FileTail],
    printer: _Printer,
    finished: threading.Event,
    interval_sec: float,
    waiter: ChangeWaiter | None = None,
) -> None:
    if waiter is None:
        waiter = ChangeWaiter(os.path.dirname(os.path.abspath(t.path)) for t in tails)
    try:
        _tail_until_finished(tails, printer, finished, interval_sec, waiter)
    finally:
        waiter.close()


def _tail_until_finished(
    tails: list[_FileTail],
    printer: _Printer,
    finished: threading.Event,
    interval_sec: float,
    waiter: ChangeWaiter,
) -> None:
    while True:
        # Read before the pass: the pass then sees all data written before stop().
        finishing = finished.is_set()
        now = time.monotonic()
        outs = []
        backlog = False
        for tail in tails:
            out, more = tail.read(now)
            if out:
                outs.append(out)
            backlog = backlog or more
        if outs:
            printer(b"".join(outs))
        if backlog:
            continue
        if finishing:
            printer(b"".join(tail.finish() for tail in tails))
            return
        if outs:
            # Lines are flowing: let a few more arrive so they go out in one batch.
            finished.wait(min(interval_sec, _ACTIVE_SLEEP))
        else:
            # Idle: sleep until a log directory changes (or stop(), or the polling interval).
            waiter.wait(interval_sec)


def tail_logfile(
    header: str,
    file: str,
    dst: IO[Any],
    finished: threading.Event,
    interval_sec: float,
    lock: Any = None,
    progbar_events: Mapping[str, threading.Event] | None = None,
    cr_interval_sec: float = 5.0,
) -> None:
    """Tail ``file`` to ``dst`` in the calling thread until ``finished`` is set, then drain it.

    Each line is printed as ``header + line``. ``lock`` serialises writes with other
    tailers of the same console (default: the process-wide console lock).
    """
    tail = _FileTail(str(file), header.encode(), cr_interval_sec)
    _tail_loop([tail], _Printer(dst, lock, progbar_events), finished, interval_sec)


class TailLog:
    """Tail ``log_files`` (``{local_rank: path}``) to ``dst`` with ``[{name}{local_rank}]:`` headers.

    One background thread serves all files. ``start()`` returns self; ``stop()`` prints
    everything written so far (a final partial line included), then ends the thread.
    """

    def __init__(
        self,
        name: str,
        log_files: Mapping[int, str | os.PathLike[str]],
        dst: IO[Any],
        interval_sec: float | Mapping[int, str] | None = 0.1,
        progbar_events: Mapping[str, threading.Event] | float | None = None,
        log_line_prefixes: Mapping[int, str] | None = None,
        cr_interval_sec: float = 5.0,
        stop_timeout: float = 60.0,
        log_line_filter: Callable[[str], bool] | None = None,
    ) -> None:
        if interval_sec is None or isinstance(interval_sec, Mapping):  # torch's positional order:
            log_line_prefixes, interval_sec = interval_sec, 0.1  # (..., log_line_prefixes, interval_sec)
            if isinstance(progbar_events, (int, float)):
                interval_sec = float(progbar_events)
        events = None if isinstance(progbar_events, (int, float)) else progbar_events
        prefixes = log_line_prefixes or {}
        self._name = name
        self._tails = [
            _FileTail(
                os.fspath(path),
                prefixes.get(rank, f"[{name}{rank}]:").encode(),
                cr_interval_sec,
                log_line_filter,
            )
            for rank, path in sorted(log_files.items())
        ]
        self._printer = _Printer(dst, None, events)
        self._interval = interval_sec
        self._finished = threading.Event()
        self._waiter: ChangeWaiter | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._stop_timeout = stop_timeout

    def start(self) -> TailLog:
        if self._tails and self._thread is None:
            self._waiter = ChangeWaiter(os.path.dirname(os.path.abspath(t.path)) for t in self._tails)
            self._thread = threading.Thread(
                target=_tail_loop,
                args=(self._tails, self._printer, self._finished, self._interval, self._waiter),
                name=f"kelastic-tail-{self._name}",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Deliver everything written so far, then stop; waits up to ``stop_timeout`` s.
        Idempotent."""
        if self._stopped:
            return
        self._finished.set()
        if self._waiter is not None:
            self._waiter.wake()
        if self._thread is not None:
            self._thread.join(self._stop_timeout)
            if self._thread.is_alive():
                logger.error("log tailer %s did not finish within %.0f s", self._name, self._stop_timeout)
        self._stopped = True

    def stopped(self) -> bool:
        return self._stopped
