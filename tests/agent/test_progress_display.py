"""Worker progress reports and the node progress display, on a real pty and a real pipe."""

from __future__ import annotations

import io
import os
import pty
import re
import sys
import textwrap
import threading
import time
import tty
from pathlib import Path

import pytest

from kelastic.agent import progress
from kelastic.agent.contract import ENV_PROGRESS_FILE
from kelastic.agent.multiprocessing import Std, start_processes
from kelastic.agent.progress import (
    NodeProgress,
    ProgressDisplay,
    ProgressReport,
    aggregate,
    plain_line_due,
    progress_file,
    read_report,
    render_bar,
)

ERASE = "\r\x1b[2K"


def test_update_writes_latest_report(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "p" / "progress.json"
    monkeypatch.setenv(ENV_PROGRESS_FILE, str(path))
    for step in range(1, 1001):
        progress.update(step, 2000, loss=1.0 / step)
    progress.flush()
    report = read_report(path)
    assert report is not None and report.step == 1000 and report.total == 2000
    assert report.metrics == {"loss": pytest.approx(1.0 / 1000)}
    progress.update(2000, 2000)  # the final step is written at once
    assert read_report(path).step == 2000


def test_update_without_env_is_a_no_op(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(ENV_PROGRESS_FILE, raising=False)
    monkeypatch.chdir(tmp_path)
    progress.update(1, 10)
    progress.flush()
    assert list(tmp_path.iterdir()) == []
    assert read_report(tmp_path / "missing.json") is None


def test_aggregate_render_and_plain_rate() -> None:
    reports = {1: ProgressReport(40, 100, {"loss": 0.5}), 0: ProgressReport(50, 100, {"loss": 0.25})}
    node = aggregate(reports)
    assert node == NodeProgress(step=40, total=100, metrics={"loss": 0.25}, ranks=2)
    assert node.fraction == 0.4
    bar = render_bar(node, "job", width=60)
    assert len(bar) <= 59 and "40%" in bar and "40/100" in bar
    assert aggregate({}) is None
    first = NodeProgress(10, 100, {}, 1)
    assert plain_line_due(None, 0, first, 0)
    assert not plain_line_due(first, 0.0, NodeProgress(35, 100, {}, 1), 0.5)  # too soon
    assert plain_line_due(first, 0.0, NodeProgress(25, 100, {}, 1), 1.5)  # crossed 20 %
    assert not plain_line_due(first, 0.0, NodeProgress(15, 100, {}, 1), 1.5)  # same decile
    assert plain_line_due(first, 0.0, NodeProgress(15, 100, {}, 1), 5.0)  # interval elapsed
    assert not plain_line_due(first, 0.0, first, 60.0)  # nothing new


WORKER = textwrap.dedent(
    """
    import sys, time
    from kelastic.agent import progress
    n = int(sys.argv[1]); pause = float(sys.argv[2])
    for i in range(n):
        print(f"line {i}", flush=True)
        progress.update(i + 1, n, loss=1.0 / (i + 1))
        time.sleep(pause)
    """
)


def run_job(tmp_path: Path, display: ProgressDisplay, lines: int, pause: float) -> None:
    log_dir = tmp_path / "logs"
    files = {r: progress_file(log_dir, r) for r in range(2)}
    envs = {r: {ENV_PROGRESS_FILE: str(files[r])} for r in range(2)}
    args = {r: ("-c", WORKER, lines, pause) for r in range(2)}
    ctx = start_processes(
        "w", sys.executable, args, envs, log_dir, tee=Std.OUT, progbar_events=display.events
    )
    display.set_progress_files(files)
    try:
        result = ctx.wait(timeout=60)
        assert result is not None and not result.is_failed(), result.summary() if result else "timed out"
    finally:
        ctx.close(timeout=5)


def check_log_lines(visible: list[str], lines: int) -> None:
    per_rank: dict[int, list[int]] = {0: [], 1: []}
    for text in visible:
        match = re.fullmatch(r"\[w([01])\]:line (\d+)", text)
        if match:
            per_rank[int(match.group(1))].append(int(match.group(2)))
        else:
            assert re.fullmatch(r"\[w progress\] step \d+/\d+ .*", text), f"torn or foreign line: {text!r}"
    for rank, seen in per_rank.items():
        assert seen == list(range(lines)), f"rank {rank}: log lines missing or out of order"


def test_live_bar_on_pty_never_tears_log_lines(tmp_path: Path, monkeypatch) -> None:
    master, slave = pty.openpty()
    tty.setraw(slave)  # no \n -> \r\n translation: we see exactly what was written
    chunks: list[bytes] = []

    def read_all() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    console = open(slave, "w", buffering=1, closefd=False)  # noqa: SIM115 - closed below
    try:
        monkeypatch.setattr(sys, "stdout", console)  # where tee'd lines go
        display = ProgressDisplay(name="w", stream=console, refresh_sec=0.02).start()
        assert display.live
        run_job(tmp_path, display, lines=400, pause=0.003)
        display.print("agent: all ranks done")
        display.stop()
    finally:
        console.close()
        os.close(slave)
        reader.join(10)
        os.close(master)
    raw = b"".join(chunks).decode()
    assert raw.count(ERASE + "w [") >= 5, "the live bar was hardly ever drawn"
    physical = raw.split("\n")
    assert physical[-1] == "" or ERASE in physical[-1]
    # What stays on screen of each physical line is the text after its last erase.
    visible = [line.rsplit(ERASE, 1)[-1] for line in physical[:-1]]
    assert "agent: all ranks done" in visible
    check_log_lines([v for v in visible if v != "agent: all ranks done"], 400)
    assert re.fullmatch(r"\[w progress\] step 400/400 \(100%\).*", visible[-1])


def test_plain_progress_lines_on_a_pipe_are_rate_limited(tmp_path: Path, monkeypatch) -> None:
    read_fd, write_fd = os.pipe()
    sink = io.BytesIO()
    reader = threading.Thread(target=lambda: sink.write(b"".join(iter(lambda: os.read(read_fd, 65536), b""))))
    reader.start()
    console = open(write_fd, "w", buffering=1)  # noqa: SIM115 - closed below
    try:
        monkeypatch.setattr(sys, "stdout", console)
        display = ProgressDisplay(
            name="w", stream=console, refresh_sec=0.02, plain_min_interval_sec=0.3
        ).start()
        assert not display.live
        begin = time.monotonic()
        run_job(tmp_path, display, lines=300, pause=0.003)  # about 1.2 s, 10 % every 0.12 s
        display.stop()
        elapsed = time.monotonic() - begin
    finally:
        console.close()
        reader.join(10)
        os.close(read_fd)
    text = sink.getvalue().decode()
    assert "\x1b" not in text and "\r" not in text
    visible = text.split("\n")[:-1]
    check_log_lines(visible, 300)
    progress_lines = [line for line in visible if line.startswith("[w progress]")]
    # At most one line per 0.3 s (plus the final one), though the job crossed a 10 %
    # mark every ~0.12 s and its steps changed at every 0.02 s refresh.
    assert 2 <= len(progress_lines) <= elapsed / 0.3 + 2, (elapsed, progress_lines)
    assert progress_lines[-1].startswith("[w progress] step 300/300 (100%)")
