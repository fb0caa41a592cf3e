"""How ``close()`` stops ranks: SIGTERM to all at once, their own handlers run, and it wakes on
their exits (kelastic.agent.multiprocessing.exitwait), not on a poll period."""

from __future__ import annotations

import os
import runpy
import select
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kelastic.agent import warm
from kelastic.agent.multiprocessing import PContext, start_processes
from kelastic.agent.multiprocessing.exitwait import ExitWatch

alive = runpy.run_path(str(Path(__file__).parent / "scripts" / "rank_helpers.py"))["alive"]

# A rank with a SIGTERM handler of its own: it notes that it started, waits (up to 10 s) until
# its peer's handler started too, notes whether it saw that, then exits 0.
SLOW_TERM = textwrap.dedent(
    """
    import os, signal, sys, time
    out, rank, peer = sys.argv[1], sys.argv[2], sys.argv[3]

    def on_term(signum, frame):
        open(f"{out}/term{rank}", "w").close()
        deadline = time.monotonic() + 10
        while not os.path.exists(f"{out}/term{peer}") and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(f"{out}/saw{rank}", "w") as f:
            f.write(str(os.path.exists(f"{out}/term{peer}")))
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    open(f"{out}/ready{rank}", "w").close()
    while True:
        time.sleep(1)
    """
)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class _Calls:
    """Counts this thread's calls of ``time.sleep`` and ``select.select`` while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sleeps: list[float] = []
        self.selects = 0
        me = threading.get_ident()
        sleep, select_ = time.sleep, select.select

        def counting_sleep(seconds: float) -> None:
            if threading.get_ident() == me:
                self.sleeps.append(seconds)
            sleep(seconds)

        def counting_select(*args: Any) -> Any:
            if threading.get_ident() == me:
                self.selects += 1
            return select_(*args)

        monkeypatch.setattr(time, "sleep", counting_sleep)
        monkeypatch.setattr(select, "select", counting_select)


def _start(kind: str, tmp_path: Path) -> PContext:
    out = tmp_path / "out"
    out.mkdir()
    if kind == "binary":
        args = {r: ("-c", SLOW_TERM, out, r, 1 - r) for r in range(2)}
        ctx = start_processes("s", sys.executable, args, {0: {}, 1: {}}, tmp_path / "logs")
    else:  # a warm-started script, as kelastic-agent --warm-start runs it
        script = tmp_path / "slow_term.py"
        script.write_text(SLOW_TERM)
        args = {r: (str(script), str(out), str(r), str(1 - r)) for r in range(2)}
        ctx = start_processes(
            "s", warm.run_script, args, {0: {}, 1: {}}, tmp_path / "logs", start_method="forkserver"
        )
    return ctx


@pytest.mark.parametrize("kind", ["binary", "forkserver"])
def test_close_signals_every_rank_at_once_and_wakes_on_their_exits(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ranks' own SIGTERM handlers run, side by side (each sees the other's start: the
    launcher signals all ranks before it waits for any), and ``close()`` sleeps only until an
    exit: no fixed naps, one wake-up per exit or so, and every rank is reaped when it returns."""
    ctx = _start(kind, tmp_path)
    out = tmp_path / "out"
    try:
        wait_until(lambda: all((out / f"ready{r}").exists() for r in range(2)), 60, "both ranks to be ready")
        pids = list(ctx.pids().values())
        calls = _Calls(monkeypatch)
        ctx.close(timeout=30)
        monkeypatch.undo()
    finally:
        ctx.close(timeout=5)
    assert [(out / f"saw{r}").read_text() for r in range(2)] == ["True", "True"], (
        "a rank's SIGTERM handler did not see its peer's start: the ranks were not signalled together"
    )
    assert not any(alive(p) for p in pids)
    assert calls.sleeps == [], f"close() napped {len(calls.sleeps)} times instead of waiting on the exits"
    # One select per exit seen (two ranks; a fork server's status comes a moment after its
    # rank's pidfd), and one after the closing SIGKILL at most: never one per poll period.
    assert calls.selects <= 6, f"close() woke {calls.selects} times for two exits"


def test_exit_watch_wakes_when_a_watched_process_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pidfd wake-up: the watch sleeps in one select until the process is gone, however long."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        calls = _Calls(monkeypatch)
        with ExitWatch([proc.pid], lambda pid: proc.poll() is None) as watch:
            threading.Timer(0.3, proc.stdin.close).start()  # type: ignore[union-attr]
            assert watch.wait(lambda: proc.poll() is not None, list, time.monotonic() + 60)
        monkeypatch.undo()
        assert calls.sleeps == []
        assert calls.selects <= 2, f"the watch woke {calls.selects} times for one exit"
    finally:
        proc.kill()
        proc.wait()


def test_exit_watch_gives_up_at_its_deadline() -> None:
    with ExitWatch([os.getpid()], lambda pid: True) as watch:
        assert watch.wait(lambda: False, list, time.monotonic() + 0.05) is False
