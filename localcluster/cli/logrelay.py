"""Relaying container logs to one console, prefixed by pod.

:class:`LogRelay` turns raw chunks of several streams into console text.
Complete lines are printed as ``[prefix] text``; kelastic's own lines as
``kelastic: text`` (:meth:`LogRelay.say`), the one voice of the CLI. Lines a
``drop`` predicate refuses are not printed (``kelastic local run`` drops the
agents' per-pod progress lines of a job: the job's own progress line says it once). Carriage returns (progress
bars redrawing one line) collapse: only the text after the last ``\\r`` of a
line counts. An unfinished line that is being redrawn (a live progress bar) is
shown in place on a terminal; when the output is not a terminal it is printed
as a plain line at most once per ``interval`` seconds per stream, so a log file
gets a steady trickle of progress instead of thousands of bar frames.

:class:`LogFollower` finds the kubelet's log files of a data directory
(``pods/<ns>_<pod>_<uid>/<container>/<restart>.log``) and feeds their new bytes
to a relay, tagged ``[pod]`` for a pod of one container and ``[pod/container]``
for a pod of several (init containers included), whichever of its containers
happen to have written yet.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LogFollower", "LogRelay"]


@dataclass
class _Stream:
    buffer: str = ""
    last_progress_at: float = float("-inf")
    shown_progress: str = ""


@dataclass
class LogRelay:
    """Formats chunks of named streams; ``write`` receives ready-to-print text."""

    write: Callable[[str], object]
    tty: bool = False
    interval: float = 10.0
    #: ``drop(prefix, text)``: True for a complete line that is not to be printed.
    drop: Callable[[str, str], bool] | None = None
    _streams: dict[str, _Stream] = field(default_factory=dict)
    _open_line: str | None = None  # prefix of the stream whose progress line is on screen

    def _close_open_line(self) -> None:
        if self._open_line is not None:
            self.write("\n")
            self._open_line = None

    def line(self, prefix: str, text: str) -> None:
        """Print one complete line for ``prefix`` (unless ``drop`` refuses it)."""
        if self.drop is not None and self.drop(prefix, text):
            return
        self._close_open_line()
        self.write(f"[{prefix}] {text}\n")

    def say(self, text: str) -> None:
        """Print one line in kelastic's own voice, ``kelastic: text``."""
        self._close_open_line()
        self.write(f"kelastic: {text}\n")

    def feed(self, prefix: str, chunk: str, now: float) -> None:
        stream = self._streams.setdefault(prefix, _Stream())
        data = stream.buffer + chunk
        *complete, rest = data.split("\n")
        for raw in complete:
            text = raw.rstrip("\r").rsplit("\r", 1)[-1]
            if text == stream.shown_progress and text and self._open_line == prefix:
                # The bar's final frame is already on screen: just end the line.
                self._close_open_line()
            else:
                self.line(prefix, text)
            stream.shown_progress = ""
        stream.buffer = rest
        if "\r" in rest:
            # Keep only the last complete frame and the start of the next one.
            head, tail = rest.rsplit("\r", 1)
            frame = head.rsplit("\r", 1)[-1]
            stream.buffer = f"{frame}\r{tail}"
            if frame and frame != stream.shown_progress:
                self._progress(prefix, stream, frame, now)

    def _progress(self, prefix: str, stream: _Stream, text: str, now: float) -> None:
        if self.tty:
            if self._open_line not in (None, prefix):
                self._close_open_line()
            self.write(f"\r\x1b[K[{prefix}] {text}")
            self._open_line = prefix
            stream.shown_progress = text
        elif now - stream.last_progress_at >= self.interval:
            self.line(prefix, text)
            stream.last_progress_at = now
            stream.shown_progress = text

    def flush(self, prefix: str | None = None) -> None:
        """Print what is left of unfinished lines (of one stream, or all)."""
        for name, stream in self._streams.items():
            if prefix is not None and name != prefix:
                continue
            text = stream.buffer.rstrip("\r").rsplit("\r", 1)[-1]
            if text and text != stream.shown_progress:
                self.line(name, text)
            stream.buffer = ""
            stream.shown_progress = ""
        self._close_open_line()


@dataclass
class _File:
    path: Path
    offset: int = 0


class LogFollower:
    """Polls the kubelet's log directory and relays new output of every container run."""

    def __init__(
        self,
        data_dir: Path,
        relay: LogRelay,
        namespaces: set[str] | None = None,
        containers_of: Callable[[str, str], int | None] | None = None,
    ) -> None:
        self.pods_dir = data_dir / "pods"
        self.relay = relay
        #: Only pods of these namespaces are relayed (None: every pod).
        self.namespaces = namespaces
        #: ``containers_of(namespace, pod)``: how many containers (init containers included) the
        #: pod's spec has, None when unknown; asked once per pod.
        self.containers_of = containers_of
        self._containers: dict[str, int] = {}
        self._files: dict[Path, _File] = {}

    def _count(self, pod_dir: Path, seen: int) -> int:
        """How many containers the pod has: its spec's count, else the ones that wrote so far."""
        known = self._containers.get(pod_dir.name)
        if known is None and self.containers_of is not None:
            namespace, rest = pod_dir.name.split("_", 1)
            counted = self.containers_of(namespace, rest.rsplit("_", 1)[0])
            if counted is not None:
                known = self._containers[pod_dir.name] = counted
        return max(known or 0, seen)

    @staticmethod
    def _prefix(pod_dir: Path, container: str, containers: int) -> str:
        namespace, rest = pod_dir.name.split("_", 1)
        name = rest.rsplit("_", 1)[0]
        base = name if namespace == "default" else f"{namespace}/{name}"
        return base if containers <= 1 else f"{base}/{container}"

    def poll(self, now: float) -> None:
        """Relay everything written since the last poll."""
        if not self.pods_dir.is_dir():
            return
        for pod_dir in sorted(self.pods_dir.iterdir()):
            if self.namespaces is not None and pod_dir.name.split("_", 1)[0] not in self.namespaces:
                continue
            containers = sorted(p for p in pod_dir.iterdir() if p.is_dir() and p.name != "volumes")
            count = self._count(pod_dir, len(containers)) if containers else 0
            for cdir in containers:
                runs = sorted(cdir.glob("*.log"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1)
                for run in runs:
                    self._relay(run, self._prefix(pod_dir, cdir.name, count), now)

    def _relay(self, path: Path, prefix: str, now: float) -> None:
        entry = self._files.get(path)
        if entry is None:
            entry = self._files[path] = _File(path)
            if path.stem != "0":
                self.relay.line(prefix, f"--- container restarted (run {path.stem}) ---")
        try:
            size = os.path.getsize(path)
        except OSError:
            return
        if size <= entry.offset:
            return
        with open(path, "rb") as f:
            f.seek(entry.offset)
            data = f.read(size - entry.offset)
        entry.offset = size
        self.relay.feed(prefix, data.decode("utf-8", errors="replace"), now)
