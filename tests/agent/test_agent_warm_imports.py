"""The warm fork server also imports the training script's installed modules
(``--warm-imports script``, the default): once, in the server, not in every worker start;
never the script's own modules; one that fails or hangs is skipped with a warning.

Real agents, real workers and real packages on ``PYTHONPATH``, each writing its pid to a
file when imported, so the test sees which process ran its module-level code.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kelastic.agent import warm

#: The training script: imports an installed package, its own helper and a package that
#: raises when imported (which it survives), records its pid; the first run fails.
TRAIN = textwrap.dedent(
    """
    import os
    import sys

    import pidpkg
    import helper

    try:
        import badpkg
    except RuntimeError:
        badpkg = None

    def log(what):
        with open(os.environ["PID_LOG"], "a") as f:
            f.write(f"{what} {os.getpid()}\\n")

    log("worker")
    marker = os.environ["PID_LOG"] + ".failed-once"
    if not os.path.exists(marker):
        open(marker, "w").close()
        sys.exit(3)
    """
)


def _pid_logger(what: str) -> str:
    return (
        f"import os\nwith open(os.environ['PID_LOG'], 'a') as f:\n    f.write('{what} %d\\n' % os.getpid())\n"
    )


def _layout(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """The installed packages (a folder on PYTHONPATH), the job's folder with train.py and
    helper.py, and the environment that points at both and at the pid file."""
    site, job = tmp_path / "site", tmp_path / "job"
    for folder in (site / "pidpkg", site / "badpkg", job):
        folder.mkdir(parents=True)
    (site / "pidpkg" / "__init__.py").write_text(_pid_logger("pidpkg"))
    (site / "badpkg" / "__init__.py").write_text(
        _pid_logger("badpkg") + "raise RuntimeError('badpkg refuses')\n"
    )
    (job / "helper.py").write_text(_pid_logger("helper"))
    (job / "train.py").write_text(TRAIN)
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "PID_LOG": str(tmp_path / "pids"), "LOGLEVEL": "INFO"}
    return site, job, env


def _pids(tmp_path: Path) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {}
    for line in (tmp_path / "pids").read_text().splitlines():
        what, pid = line.split()
        seen.setdefault(what, []).append(int(pid))
    return seen


def _agent(tmp_path: Path, *flags: str) -> tuple[dict[str, list[int]], str]:
    _, job, env = _layout(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kelastic.agent",
            "--standalone",
            "--warm-start",
            "--max-restarts",
            "1",
            *flags,
            str(job / "train.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return _pids(tmp_path), proc.stderr


@pytest.mark.slow  # a real agent, a worker started twice
def test_the_scripts_installed_packages_are_imported_once_in_the_fork_server(tmp_path: Path) -> None:
    pids, stderr = _agent(tmp_path)
    workers = pids["worker"]
    assert len(workers) == 2, pids  # failed once, then restarted
    # The package's module-level code ran once, in neither worker: in the fork server.
    assert len(pids["pidpkg"]) == 1 and pids["pidpkg"][0] not in workers, pids
    # The script's own module is imported by each worker start, never early.
    assert pids["helper"] == workers, pids
    # The package that raises: tried in the server, skipped with a warning naming it, and
    # imported (and survived) by each worker itself.
    assert pids["badpkg"] == [pids["pidpkg"][0], *workers], pids
    assert "importing badpkg failed (RuntimeError: badpkg refuses)" in stderr
    assert "the fork server imported the script's modules pidpkg" in stderr
    assert "helper" not in stderr


@pytest.mark.slow  # a real agent, a worker started twice
def test_warm_imports_torch_leaves_the_scripts_imports_to_each_worker(tmp_path: Path) -> None:
    pids, stderr = _agent(tmp_path, "--warm-imports", "torch")
    workers = pids["worker"]
    assert len(workers) == 2, pids
    assert pids["pidpkg"] == workers and pids["badpkg"] == workers and pids["helper"] == workers, pids
    assert "script's modules" not in stderr and "badpkg" not in stderr


#: Run as ``python PROBE``: a thread runs, so the fork server cannot be a fork of this
#: process and is multiprocessing's own fresh one; a worker started through it reports.
PROBE = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, threading

    from kelastic.agent import warm

    def worker(queue):
        queue.put({"pidpkg": "pidpkg" in sys.modules, "env": warm.ENV_SCRIPT_IMPORTS in os.environ})

    if __name__ == "__main__":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        forked = warm.fork_forkserver(script_modules=["pidpkg", "badpkg"])
        ctx = multiprocessing.get_context("forkserver")
        queue = ctx.Queue()
        p = ctx.Process(target=worker, args=(queue,))
        p.start()
        seen = queue.get(timeout=240)
        p.join(60)
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        print(json.dumps({"forked": forked, "worker": seen, "worker_pid": p.pid, "server": server,
                          "env": warm.ENV_SCRIPT_IMPORTS in os.environ, "exitcode": p.exitcode}))
    """
)


@pytest.mark.slow  # a fresh fork server imports torch
def test_the_fallback_fork_server_imports_them_too_and_survives_a_failing_one(tmp_path: Path) -> None:
    _, _, env = _layout(tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = subprocess.run(
        [sys.executable, str(probe)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["forked"] is False and seen["exitcode"] == 0, seen
    # The worker found the package imported; its code ran in the server, not the worker.
    assert seen["worker"] == {"pidpkg": True, "env": False}, seen
    pids = _pids(tmp_path)
    assert pids["pidpkg"] == [seen["server"]] and seen["worker_pid"] not in pids["pidpkg"], pids
    assert pids["badpkg"] == [seen["server"]], pids
    assert "importing badpkg failed (RuntimeError: badpkg refuses)" in proc.stderr
    assert seen["env"] is False  # the variable was for the server only


def test_import_guarded_skips_what_raises_anything_or_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    modules = {
        "kw_fine": "VALUE = 1\n",
        "kw_raises": "raise RuntimeError('no GPU here')\n",
        "kw_exits": "import sys\nsys.exit(4)\n",
        # Hangs, and swallows every Exception on the way: the time limit is no Exception.
        "kw_hangs": "import time\nwhile True:\n    try:\n        time.sleep(60)\n    except Exception:\n        pass\n",
    }
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = signal.getsignal(signal.SIGALRM)
    timer = signal.setitimer(signal.ITIMER_REAL, 0)  # pytest-timeout's, if it uses SIGALRM
    # A timer of its own (its handler ignores it), which import_guarded must leave set.
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 600)
    log = logging.getLogger("kelastic.test.warm_imports")
    with caplog.at_level(logging.INFO, logger=log.name):
        done = warm.import_guarded(["kw_raises", "kw_exits", "kw_hangs", "json", "kw_fine"], log, timeout=0.5)
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert done == ["json", "kw_fine"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "warm start: importing kw_raises failed (RuntimeError: no GPU here); the workers import it themselves",
        "warm start: importing kw_exits failed (SystemExit: 4); the workers import it themselves",
        "warm start: importing kw_hangs took over 0.5s; the workers import it themselves",
    ]
    # json was imported already: only what the server imported itself is named.
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["warm start: the fork server imported the script's modules kw_fine"]
    # The handler and the timer that were there before are back (less the time it took).
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_IGN
    assert 0 < signal.setitimer(signal.ITIMER_REAL, 0)[0] < 600
    signal.signal(signal.SIGALRM, before)
    signal.setitimer(signal.ITIMER_REAL, *timer)
