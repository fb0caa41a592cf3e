"""No orphans: closing kills whole trees, signals reach the launcher, SIGKILL of the launcher kills ranks."""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kelastic.agent.multiprocessing import start_processes

alive = runpy.run_path(str(Path(__file__).parent / "scripts" / "rank_helpers.py"))["alive"]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def child_pids(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == parent:
                found.append(int(entry))
    return found


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A worker that starts one grandchild in its own group and one that escapes with setsid.
SPAWN_GRANDCHILDREN = textwrap.dedent(
    """
    import subprocess, sys, time
    a = subprocess.Popen(["sleep", "300"])
    b = subprocess.Popen(["sleep", "300"], start_new_session=True)
    open(sys.argv[1] + ".tmp", "w").write(f"{a.pid} {b.pid}")
    import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
    """
)


def test_close_kills_grandchildren(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchildren"
    ctx = start_processes(
        "g", sys.executable, {0: ("-c", SPAWN_GRANDCHILDREN, pidfile)}, {0: {}}, tmp_path / "logs"
    )
    grandchildren: list[int] = []
    try:
        wait_until(pidfile.exists, 20, "the worker to start its grandchildren")
        grandchildren = [int(p) for p in pidfile.read_text().split()]
        assert all(alive(p) for p in grandchildren)
        rank_pid = ctx.pids()[0]
        ctx.close(timeout=5)
        assert not alive(rank_pid)
        assert not os.path.exists(f"/proc/{rank_pid}")  # reaped, not a zombie
        wait_until(
            lambda: not any(alive(p) for p in grandchildren), 5, f"grandchildren {grandchildren} to die"
        )
    finally:
        ctx.close(timeout=1)
        kill_all(grandchildren)


def test_close_escalates_to_sigkill(tmp_path: Path) -> None:
    args = {0: ("-c", "trap '' TERM; echo ready; while :; do sleep 0.1; done")}
    ctx = start_processes("s", "/bin/sh", args, {0: {}}, tmp_path / "logs", redirects=1)
    pid = ctx.pids()[0]
    wait_until(
        lambda: (tmp_path / "logs/0/stdout.log").read_text() == "ready\n", 10, "the rank to trap SIGTERM"
    )
    begin = time.monotonic()
    ctx.close(death_sig=signal.SIGTERM, timeout=0.5)
    assert time.monotonic() - begin < 15
    assert not alive(pid)
    assert ctx.wait(timeout=0) is None  # closed by the caller: no result
    ctx.close()  # idempotent


def test_ranks_started_from_a_short_lived_thread_survive_it(tmp_path: Path) -> None:
    """The parent-death signal follows the forking *thread*: a thread that exits must not kill ranks."""
    holder = {}

    def start() -> None:
        holder["ctx"] = start_processes("th", "/bin/sleep", {0: (300,)}, {0: {}}, tmp_path / "logs")

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(30)
    ctx = holder["ctx"]
    try:
        time.sleep(0.5)
        assert ctx.wait(timeout=0) is None, "rank died when the thread that started it exited"
        assert alive(ctx.pids()[0])
    finally:
        ctx.close(timeout=5)


LAUNCHER = textwrap.dedent(
    """
    import json, sys, time
    from kelastic.agent.multiprocessing import SignalException, start_processes

    def main():
        log_dir = sys.argv[1]
        binaries = start_processes(
            "b", "/bin/sh",
            {0: ("-c", "sleep 300"), 1: ("-c", f"trap '' TERM; sleep 300 & echo $! > {log_dir}/gc.tmp; mv {log_dir}/gc.tmp {log_dir}/gc; wait")},
            {0: {}, 1: {}}, log_dir + "/b",
        )
        callables = start_processes("c", time.sleep, {0: (300,), 1: (300,)}, {0: {}, 1: {}}, log_dir + "/c")
        print(json.dumps(list(binaries.pids().values()) + list(callables.pids().values())), flush=True)
        try:
            while binaries.wait(timeout=1) is None:
                pass
        except SignalException as e:
            binaries.close(death_sig=e.sigval, timeout=1)
            callables.close(death_sig=e.sigval, timeout=1)
            print("closed", e.sigval.name, flush=True)
            sys.exit(0)

    if __name__ == "__main__":
        main()
    """
)


@pytest.fixture
def launcher(tmp_path: Path):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "logs")], stdout=subprocess.PIPE, text=True
    )
    workers: list[int] = []
    try:
        line = proc.stdout.readline()
        assert line, "launcher printed no pids"
        workers.extend(json.loads(line))
        yield proc, workers
    finally:
        proc.kill()
        proc.wait(10)
        # Collect what is left (only if the test failed) so nothing outlives the test.
        kill_all(workers)
        if (tmp_path / "logs" / "gc").exists():
            kill_all([int((tmp_path / "logs" / "gc").read_text())])


def test_sigterm_to_launcher_ends_every_child(launcher) -> None:
    proc, workers = launcher
    assert len(workers) == 4 and all(alive(p) for p in workers)
    begin = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert "closed SIGTERM" in out
    assert proc.returncode == 0
    assert time.monotonic() - begin < 20  # each context closes with timeout=1
    assert not any(alive(p) for p in workers)


def test_sigkill_of_launcher_leaves_no_worker(launcher, tmp_path: Path) -> None:
    proc, workers = launcher
    assert len(workers) == 4 and all(alive(p) for p in workers)
    gc_file = tmp_path / "logs" / "gc"
    wait_until(gc_file.exists, 10, "rank 1 to start its child")
    grandchild = int(gc_file.read_text())
    assert alive(grandchild)
    watchdogs = [pid for pid in child_pids(proc.pid) if "_watchdog_main" in cmdline(pid)]
    assert len(watchdogs) == 1
    proc.kill()
    proc.wait(10)
    wait_until(lambda: not any(alive(p) for p in workers), 5, f"workers {workers} to die with their launcher")
    wait_until(lambda: not alive(grandchild), 10, f"the child {grandchild} of a worker to die too")
    wait_until(lambda: not alive(watchdogs[0]), 10, "the watchdog to exit after doing its job")
