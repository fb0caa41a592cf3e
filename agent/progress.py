"""Training progress: the worker-side ``update()`` and the node-wide progress display.

Worker side (in the user's training script; a no-op outside kelastic)::

    from kelastic.agent import progress
    for step in range(start, total):
        ...
        progress.update(step + 1, total, loss=loss.item())

``update`` keeps the latest report and writes it (at most 10 times a second, plus the
final step and at exit) as JSON to the file named by ``KELASTIC_PROGRESS_FILE``
(:data:`kelastic.agent.contract.ENV_PROGRESS_FILE`). The report also carries the first
step this process reported and when (a restarted group's first step: what a restart
cost), and ``stall``, the seconds the process waited on checkpoint saves, which
``stalled(seconds)`` adds to (``kelastic.checkpoint.MemoryWriter`` calls it for the
saves it makes on the training thread). The agent turns them into the node's goodput
record (:mod:`kelastic.agent.goodput`).

Agent side (``kelastic.agent.local_agent``), once per node::

    display = ProgressDisplay(name=spec.role).start()       # live bar on a TTY,
                                                            # plain lines on a pipe/file
    # for each attempt, with attempt_dir the log_dir passed to start_processes:
    files = {r: progress_file(attempt_dir, r) for r in range(nproc)}
    envs[r][ENV_PROGRESS_FILE] = str(files[r])              # tell each rank where to write
    ctx = start_processes(..., log_dir=attempt_dir, progbar_events=display.events)
    display.set_progress_files(files)                       # after a restart: the new files
    ...
    node = display.snapshot()   # NodeProgress | None: min step over local ranks, for
                                # rendezvous.control.publish_progress (rate-limit to 1/s)
    ...
    display.print("agent: restarting workers")              # agent messages, bar-safe
    ctx.close(); display.stop()                             # at agent exit

The display and the console tailers (``TailLog``) share ``display.events`` (the
handshake of :mod:`kelastic.agent.multiprocessing.progbar`): before a batch of log
lines the bar is erased, after it the bar is redrawn, so lines never tear the bar. On
a pipe or a file (``kubectl logs``) there is no live bar; the display prints a plain
progress line at most every ``plain_min_interval_sec`` s: on each 10 % of the total
or after ``plain_interval_sec`` s without one.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .contract import ENV_PROGRESS_FILE
from .multiprocessing.progbar import (
    ACTIVE,
    CONSOLE_LOCK,
    DONE,
    GRANTED,
    WANT,
    console_turn,
    new_progbar_events,
)

__all__ = [
    "NodeProgress",
    "ProgressDisplay",
    "ProgressReport",
    "aggregate",
    "flush",
    "new_incarnation",
    "plain_line_due",
    "progress_file",
    "read_report",
    "render_bar",
    "render_plain",
    "stalled",
    "update",
    "waited",
    "waiting",
]

# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------

_MIN_WRITE_INTERVAL = 0.1


@dataclass(frozen=True)
class ProgressReport:
    """One rank's latest progress: ``step`` done out of ``total`` (None if unknown), its
    metrics, and ``time`` (seconds since the epoch) when it was reported."""

    step: int
    total: int | None
    metrics: dict[str, float] = field(default_factory=dict)
    time: float = 0.0
    #: Seconds this rank's process waited on checkpoint saves so far (:func:`stalled`).
    stall: float = 0.0
    #: The first step this rank's process reported, and when (None: not recorded).
    first: tuple[int, float] | None = None
    #: Seconds this rank's process waited on its peers so far (:func:`waited`, :func:`waiting`).
    wait: float = 0.0


class _Reporter:
    """Keeps the latest report in memory; writes it at most every ``_MIN_WRITE_INTERVAL`` s."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: tuple[str, int, int | None, dict[str, float], float] | None = None
        self.written_at = float("-inf")
        self.exit_hook = False
        self.stall = 0.0
        self.wait = 0.0
        self.first: tuple[int, float] | None = None

    def offer(self, path: str, step: int, total: int | None, metrics: dict[str, float], final: bool) -> None:
        now = time.monotonic()
        with self.lock:
            stamp = time.time()
            if self.first is None:
                self.first = (int(step), stamp)
            self.pending = (path, step, total, metrics, stamp)
            if final or now - self.written_at >= _MIN_WRITE_INTERVAL:
                self._write_locked(now)
            elif not self.exit_hook:
                self.exit_hook = True
                atexit.register(flush)

    def flush(self) -> None:
        with self.lock:
            if self.pending is not None:
                self._write_locked(time.monotonic())

    def _write_locked(self, now: float) -> None:
        pending, self.pending = self.pending, None
        self.written_at = now
        if pending is None:
            return
        path, step, total, metrics, stamp = pending
        text = json.dumps(
            {
                "step": int(step),
                "total": None if total is None else int(total),
                "metrics": {k: float(v) for k, v in metrics.items()},
                "time": stamp,
                "stall": round(self.stall, 6),
                "wait": round(self.wait, 6),
                "first": list(self.first) if self.first is not None else None,
            }
        )
        tmp = f"{path}.{os.getpid()}.tmp"
        for _attempt in range(2):
            try:
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
                return
            except OSError:
                try:  # the directory may not exist yet
                    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                except OSError:
                    return  # progress is best effort: never break training over it


_reporter = _Reporter()


def update(step: int, total: int | None = None, **metrics: float) -> None:
    """Report that ``step`` of ``total`` steps are done, with optional scalar ``metrics``.

    Cheap enough for every step: the report is kept in memory and written to
    ``$KELASTIC_PROGRESS_FILE`` at most every 0.1 s, immediately when ``step >= total``,
    and at interpreter exit. Does nothing when the variable is unset (plain ``python``
    or ``torchrun``). Never raises for I/O problems.
    """
    path = os.environ.get(ENV_PROGRESS_FILE)
    if not path:
        return
    _reporter.offer(path, step, total, metrics, final=total is not None and step >= total)


def flush() -> None:
    """Write the latest report now (e.g. before a long evaluation pause)."""
    _reporter.flush()


def new_incarnation() -> None:
    """Start the counts over, as a new process would: the worker now reports to the next
    group's progress file (:func:`kelastic.inprocess.run`, after a re-form that kept the
    process). Whatever was not written yet belonged to the old group, and is dropped."""
    with _reporter.lock:
        _reporter.pending = None
        _reporter.written_at = float("-inf")
        _reporter.first = None
        _reporter.stall = 0.0
        _reporter.wait = 0.0


def stalled(seconds: float) -> None:
    """Record that training waited ``seconds`` on a checkpoint save (sent with the next report).

    ``kelastic.checkpoint.MemoryWriter`` calls it for every save it makes on the training
    thread; a script that saves some other way may call it around its own saves. The job's
    goodput counts these seconds as save stalls. Never raises.
    """
    if seconds > 0:
        with _reporter.lock:
            _reporter.stall += float(seconds)


def waited(seconds: float) -> None:
    """Record that this rank waited ``seconds`` on its peers (sent with the next report).

    In a synchronous group every member's step takes as long as the slowest member's: the
    others wait for it in the collectives. What a rank spent on its own work, the step minus
    these waits, is what tells a slow member (a straggler, :mod:`kelastic.agent.straggler`)
    from the ones that wait for it. Never raises.
    """
    if seconds > 0:
        with _reporter.lock:
            _reporter.wait += float(seconds)


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Count the time inside the ``with`` block as waiting on peers (:func:`waited`)::

    with progress.waiting():
        dist.all_reduce(grads)
    """
    started = time.monotonic()
    try:
        yield
    finally:
        waited(time.monotonic() - started)


# ---------------------------------------------------------------------------------------
# Agent side: reading and aggregating
# ---------------------------------------------------------------------------------------


def progress_file(log_dir: str | os.PathLike[str], local_rank: int) -> Path:
    """Where a rank of an attempt writes progress: ``{log_dir}/{local_rank}/progress.json``."""
    return Path(log_dir) / str(local_rank) / "progress.json"


def read_report(path: str | os.PathLike[str]) -> ProgressReport | None:
    """The report in ``path``, or None if there is none yet or it is unreadable."""
    try:
        data = json.loads(Path(path).read_text())
        total = data.get("total")
        first = data.get("first")
        return ProgressReport(
            step=int(data["step"]),
            total=None if total is None else int(total),
            metrics={str(k): float(v) for k, v in (data.get("metrics") or {}).items()},
            time=float(data.get("time", 0.0)),
            stall=float(data.get("stall") or 0.0),
            wait=float(data.get("wait") or 0.0),
            first=(int(first[0]), float(first[1])) if first else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class NodeProgress:
    """Progress of the node: the slowest local rank's ``step``, the largest ``total``,
    ``metrics`` of the lowest reporting rank, ``ranks`` reporting, ``rate`` in steps/s."""

    step: int
    total: int | None
    metrics: dict[str, float]
    ranks: int
    rate: float | None = None

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return min(max(self.step / self.total, 0.0), 1.0)


def aggregate(reports: Mapping[int, ProgressReport]) -> NodeProgress | None:
    """Combine per-rank reports (pure); None when no rank has reported."""
    if not reports:
        return None
    totals = [r.total for r in reports.values() if r.total is not None]
    return NodeProgress(
        step=min(r.step for r in reports.values()),
        total=max(totals) if totals else None,
        metrics=dict(reports[min(reports)].metrics),
        ranks=len(reports),
    )


def _eta(progress: NodeProgress) -> str:
    if not progress.total or not progress.rate or progress.rate <= 0:
        return ""
    seconds = max(progress.total - progress.step, 0) / progress.rate
    if not math.isfinite(seconds):
        return ""
    hours, rest = divmod(int(seconds), 3600)
    return f"eta {hours}:{rest // 60:02d}:{rest % 60:02d}"


def _details(progress: NodeProgress) -> list[str]:
    parts = []
    if progress.rate:
        parts.append(f"{progress.rate:.3g} step/s")
    eta = _eta(progress)
    if eta:
        parts.append(eta)
    parts += [f"{k}={v:.4g}" for k, v in sorted(progress.metrics.items())]
    parts.append(f"{progress.ranks} rank{'s' if progress.ranks != 1 else ''}")
    return parts


def render_bar(progress: NodeProgress, name: str, width: int) -> str:
    """One terminal line (at most ``width - 1`` characters) showing ``progress`` (pure)."""
    fraction = progress.fraction
    if fraction is None:
        head = f"{name} step {progress.step}"
    else:
        cells = 20
        filled = int(fraction * cells)
        head = f"{name} [{'#' * filled}{'.' * (cells - filled)}] {fraction * 100:3.0f}% {progress.step}/{progress.total}"
    line = " | ".join([head, *_details(progress)])
    return line[: max(width - 1, 10)]


def render_plain(progress: NodeProgress, name: str) -> str:
    """A plain progress line for logs (pure)."""
    if progress.fraction is None:
        head = f"[{name} progress] step {progress.step}"
    else:
        head = f"[{name} progress] step {progress.step}/{progress.total} ({progress.fraction * 100:.0f}%)"
    return " ".join([head, *_details(progress)])


def plain_line_due(
    last: NodeProgress | None,
    last_at: float,
    current: NodeProgress,
    now: float,
    interval: float = 5.0,
    min_interval: float = 1.0,
) -> bool:
    """Should a plain progress line be printed now (pure)?

    Never twice within ``min_interval`` s nor for an unchanged step; otherwise when
    nothing was printed yet, after ``interval`` s, on crossing a 10 % mark, or at the end.
    """
    if last is None:
        return True
    if current.step == last.step or now - last_at < min_interval:
        return False
    if now - last_at >= interval:
        return True
    if current.total and last.total:
        if int(10 * current.step / current.total) > int(10 * last.step / last.total):
            return True
        if current.step >= current.total:
            return True
    return False


# ---------------------------------------------------------------------------------------
# Agent side: the display
# ---------------------------------------------------------------------------------------

_ERASE = "\r\x1b[2K"


class ProgressDisplay:
    """One progress display per node, fed by the progress files of its local ranks.

    ``live`` (default: whether ``stream`` is a terminal) draws a one-line bar, redrawn
    every ``refresh_sec`` s and after every batch of log lines; otherwise plain lines
    are printed (see :func:`plain_line_due`). Pass :attr:`events` to
    ``start_processes(progbar_events=...)``. ``start()`` returns self; ``stop()`` prints
    the final state and ends the display thread. All waits are bounded.
    """

    def __init__(
        self,
        name: str = "progress",
        stream: IO[str] | None = None,
        live: bool | None = None,
        refresh_sec: float = 0.25,
        plain_interval_sec: float = 5.0,
        plain_min_interval_sec: float = 1.0,
        hold_sec: float = 2.0,
    ) -> None:
        import sys

        self.name = name
        self.stream: IO[str] = stream if stream is not None else sys.stdout
        if live is None:
            try:
                live = self.stream.isatty()
            except (AttributeError, ValueError):
                live = False
        self.live = live
        self.refresh_sec = refresh_sec
        self.plain_interval_sec = plain_interval_sec
        self.plain_min_interval_sec = plain_min_interval_sec
        self.hold_sec = hold_sec
        #: The handshake events to pass as ``progbar_events`` to ``start_processes``/``TailLog``.
        self.events: dict[str, threading.Event] = new_progbar_events()
        self._files: dict[int, Path] = {}
        self._files_lock = threading.Lock()
        self._history: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._current: NodeProgress | None = None
        self._shown: NodeProgress | None = None  # last plain line printed / bar drawn
        self._shown_at = float("-inf")
        self._bar_visible = False
        self._read_at = float("-inf")
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- feeding ----------------------------------------------------------------------------
    def set_progress_files(self, files: Mapping[int, str | os.PathLike[str]]) -> None:
        """Read progress from ``{local_rank: path}`` from now on (replaces earlier files;
        call it for every new attempt). The rate estimate restarts."""
        with self._files_lock:
            self._files = {rank: Path(p) for rank, p in files.items()}
            self._history.clear()

    def snapshot(self) -> NodeProgress | None:
        """The node's latest aggregated progress (None before any rank reported)."""
        return self._current

    def _refresh(self) -> NodeProgress | None:
        with self._files_lock:
            files = dict(self._files)
        reports = {rank: r for rank, path in files.items() if (r := read_report(path)) is not None}
        progress = aggregate(reports)
        if progress is not None:
            now = time.monotonic()
            if not self._history or self._history[-1][1] != progress.step:
                self._history.append((now, progress.step))
            while len(self._history) > 2 and now - self._history[0][0] > 30:
                self._history.popleft()
            rate = None
            if len(self._history) >= 2:
                (t0, s0), (t1, s1) = self._history[0], self._history[-1]
                if t1 - t0 > 0.5:
                    rate = (s1 - s0) / (t1 - t0)
            progress = NodeProgress(progress.step, progress.total, progress.metrics, progress.ranks, rate)
        self._current = progress
        return progress

    # -- drawing (only on the display thread, or after it ended) ---------------------------
    def _width(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            return 80

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # the console went away; progress is best effort

    def _draw_bar(self) -> None:
        if self._current is None:
            return
        self._write(_ERASE + render_bar(self._current, self.name, self._width()))
        self._bar_visible = True
        self._shown = self._current

    def _erase_bar(self) -> None:
        if self._bar_visible:
            self._write(_ERASE)
            self._bar_visible = False

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._read_at >= self.refresh_sec:  # after a tailer's turn, redraw without re-reading
            self._read_at = now
            self._refresh()
        progress = self._current
        if progress is None or not CONSOLE_LOCK.acquire(timeout=0.05):
            return  # a tailer holds the console; it will ask for a turn
        try:
            if self.live:
                self._draw_bar()
            elif plain_line_due(
                self._shown,
                self._shown_at,
                progress,
                time.monotonic(),
                self.plain_interval_sec,
                self.plain_min_interval_sec,
            ):
                self._write(render_plain(progress, self.name) + "\n")
                self._shown, self._shown_at = progress, time.monotonic()
        finally:
            CONSOLE_LOCK.release()

    def _serve_tailer(self) -> None:
        """A tailer wants the console: erase the bar, grant, wait (bounded) until it is done."""
        self._erase_bar()
        self.events[GRANTED].set()
        self.events[DONE].wait(self.hold_sec)
        self.events[GRANTED].clear()
        self.events[DONE].clear()

    def _run(self) -> None:
        while not self._stopping.is_set():
            if self.live and self.events[WANT].wait(self.refresh_sec):
                if self._stopping.is_set():
                    break
                self._serve_tailer()
            elif not self.live:
                self._stopping.wait(self.refresh_sec)
            self._tick()

    def print(self, text: str, file: IO[str] | None = None) -> None:
        """Print a line of the agent's own (to ``file``, default the display's stream)
        without tearing the bar: the same handshake the log tailers use. Not for use on
        the display thread."""
        stream = file if file is not None else self.stream
        with CONSOLE_LOCK, console_turn(self.events):
            try:
                stream.write(text.rstrip("\n") + "\n")
                stream.flush()
            except (OSError, ValueError):
                pass

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> ProgressDisplay:
        if self._thread is None:
            if self.live:
                self.events[ACTIVE].set()
            self._thread = threading.Thread(target=self._run, name="kelastic-progress", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the display: tailers stop handshaking, the bar is replaced by a final plain
        line (if there was progress not shown yet). Waits at most a few seconds."""
        self.events[ACTIVE].clear()
        self._stopping.set()
        self.events[WANT].set()  # wake the display thread
        if self._thread is not None:
            self._thread.join(5)
        self.events[WANT].clear()
        self.events[GRANTED].set()  # release any tailer still waiting for a turn
        progress = self._refresh()
        with CONSOLE_LOCK:
            self._erase_bar()
            if progress is not None and (
                self.live or self._shown is None or progress.step != self._shown.step
            ):
                self._write(render_plain(progress, self.name) + "\n")
                self._shown = progress
