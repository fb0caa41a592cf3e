"""TailLog and tail_logfile with real writer processes and real files."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from kelastic.agent.multiprocessing import TailLog, new_progbar_events, tail_logfile
from kelastic.agent.multiprocessing.progbar import ACTIVE

WRITER = textwrap.dedent(
    """
    import sys, time
    path, count = sys.argv[1], int(sys.argv[2])
    time.sleep(float(sys.argv[3]))  # the tailer starts before the file exists
    with open(path, "w") as f:
        for i in range(count):
            f.write(f"line {i}\\n")
            if i % 5000 == 0:
                f.flush()
        f.write("tail without newline")
    """
)


def run_writers(paths: list[Path], count: int) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(p), str(count), str(0.05 * i)])
        for i, p in enumerate(paths)
    ]
    try:
        for proc in procs:
            assert proc.wait(60) == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_eight_files_of_100k_lines_arrive_complete_and_in_order(tmp_path: Path) -> None:
    count = 100_000
    paths = [tmp_path / f"{rank}.log" for rank in range(8)]
    out_path = tmp_path / "console.txt"
    with open(out_path, "wb") as dst:
        tail = TailLog("trainer", dict(enumerate(paths)), dst).start()
        run_writers(paths, count)
        tail.stop()
    assert tail.stopped()
    per_rank: dict[int, list[str]] = {rank: [] for rank in range(8)}
    pattern = re.compile(r"\[trainer(\d)\]:(.*)")
    for line in out_path.read_text().split("\n")[:-1]:
        match = pattern.fullmatch(line)
        assert match, f"malformed or torn line: {line!r}"
        per_rank[int(match.group(1))].append(match.group(2))
    expected = [f"line {i}" for i in range(count)] + ["tail without newline"]
    for rank in range(8):
        assert len(per_rank[rank]) == len(expected), f"rank {rank}: {len(per_rank[rank])} lines"
        assert per_rank[rank] == expected, f"rank {rank} lines out of order"


def test_carriage_return_progress_collapses(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    out = tmp_path / "out.txt"
    with open(out, "wb") as dst:
        tail = TailLog("w", {0: log}, dst, interval_sec=0.01).start()
        with open(log, "w") as f:
            for pct in range(101):
                f.write(f"\r{pct:3d}%|{'#' * (pct // 10)}")
                f.flush()
                time.sleep(0.002)
            f.write("\nnext line\n")
            f.write("\rpartial 1\rpartial 2")
        tail.stop()
    lines = out.read_text().split("\n")[:-1]
    assert "\r" not in out.read_text()
    assert lines[-3:] == ["[w0]:100%|##########", "[w0]:next line", "[w0]:partial 2"]
    # 101 updates became at most one intermediate state plus the final one.
    assert len(lines) <= 4, lines


def test_waits_for_missing_file_and_delivers_before_stop(tmp_path: Path) -> None:
    log = tmp_path / "late.log"
    out = tmp_path / "out.txt"
    with open(out, "w") as dst:
        tail = TailLog("x", {3: log}, dst, interval_sec=0.05).start()
        time.sleep(0.3)
        log.write_text("hello\nworld")  # created late; the last line has no newline
        tail.stop()
    assert out.read_text() == "[x3]:hello\n[x3]:world\n"


def test_idle_tailer_does_not_busy_loop(tmp_path: Path) -> None:
    tail = TailLog("idle", {r: tmp_path / f"missing{r}.log" for r in range(8)}, sys.stdout).start()
    try:
        begin = time.process_time()
        time.sleep(1.0)
        used = time.process_time() - begin
    finally:
        tail.stop()
    assert used < 0.2, f"an idle tailer of 8 files used {used:.3f} s CPU in 1 s"


def test_tail_logfile_in_caller_thread(tmp_path: Path) -> None:
    log = tmp_path / "f.log"
    log.write_text("a\nb\n")
    out = tmp_path / "out.txt"
    finished = threading.Event()
    with open(out, "w") as dst:
        thread = threading.Thread(
            target=tail_logfile, args=("H:", str(log), dst, finished, 0.05, threading.Lock(), None)
        )
        thread.start()
        with open(log, "a") as f:
            f.write("c\n")
        finished.set()
        thread.join(10)
        assert not thread.is_alive()
    assert out.read_text() == "H:a\nH:b\nH:c\n"


def test_absent_display_never_blocks_the_tailer(tmp_path: Path) -> None:
    """An 'active' display that never answers delays each batch by the grant timeout at most."""
    events = new_progbar_events()
    events[ACTIVE].set()  # claims to be there, but no display thread serves the handshake
    log = tmp_path / "0.log"
    out = tmp_path / "out.txt"
    with open(out, "w") as dst:
        tail = TailLog("d", {0: log}, dst, interval_sec=0.05, progbar_events=events).start()
        log.write_text("".join(f"{i}\n" for i in range(1000)))
        begin = time.monotonic()
        tail.stop()
        assert time.monotonic() - begin < 10
    assert out.read_text() == "".join(f"[d0]:{i}\n" for i in range(1000))
