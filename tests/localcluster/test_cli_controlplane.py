"""``kelastic local up --control-plane`` as a user runs it: stopped while starting, or SIGKILLed.

Real processes: the CLI, etcd, kube-apiserver, controller-manager, scheduler (from
the ``control_plane_bin`` fixture; skipped with a reason without them).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kelastic.localcluster.cli.cluster import SHM, LocalCluster
from kelastic.localcluster.controlplane.tmpfs import OWNER_FILE, PREFIX, Owner
from kelastic.localcluster.testing import process_alive, wait_for

pytestmark = pytest.mark.slow

KELASTIC = [sys.executable, "-m", "kelastic.localcluster"]


class _Cli:
    """A running ``kelastic`` command whose output lines are collected as they come."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KELASTIC_LOCAL_OPERATOR"}
        self.proc = subprocess.Popen(
            [*KELASTIC, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=cwd,
            env=env,
            start_new_session=True,  # as a terminal's job: the test signals it alone
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or []:
            self._queue.put(line)

    def _drain(self) -> None:
        while not self._queue.empty():
            self.lines.append(self._queue.get())

    def wait_line(self, matches: Callable[[str], bool], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            found = [line for line in self.lines if matches(line)]
            if found:
                return found[0]
            assert self.proc.poll() is None, (
                f"kelastic exited ({self.proc.returncode}) before {what}: {self.lines}"
            )
            assert time.monotonic() < deadline, f"no {what} after {timeout} s: {self.lines}"
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        time.sleep(0.1)
        self._drain()
        return code


@contextmanager
def _kelastic(argv: list[str], cwd: Path) -> Iterator[_Cli]:
    cli = _Cli(argv, cwd)
    try:
        yield cli
    finally:
        if cli.proc.poll() is None:
            os.killpg(cli.proc.pid, signal.SIGKILL)
            cli.proc.wait()


def _processes_naming(text: str) -> list[int]:
    """Pids of the live processes whose command line or environment holds ``text``.

    The components name their state directory on their command line; pod processes
    carry paths of the data directory (inside it) in their environment.
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if any(text.encode() in (entry / part).read_bytes() for part in ("cmdline", "environ")):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return [p for p in pids if process_alive(p)]


def _stopped_promptly(cli: _Cli, sig: int, state: Path) -> tuple[int, float]:
    sent = time.monotonic()
    cli.proc.send_signal(sig)
    code = cli.finish(30)
    took = time.monotonic() - sent
    left: list[str] = []

    def none_left() -> bool:
        left[:] = [
            Path(f"/proc/{p}/cmdline").read_bytes()[:200].decode(errors="replace")
            for p in _processes_naming(str(state))
        ]
        return not left

    wait_for(none_left, 10, "no component or pod process left running")
    assert not left
    return code, took


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_control_plane_starts_stops_it_at_once(
    control_plane_bin: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    state = tmp_path / "state"
    argv = [
        "local",
        "up",
        "--control-plane",
        str(control_plane_bin),
        "--state-dir",
        str(state),
        "--no-operator",
    ]
    with _kelastic(argv, tmp_path) as cli:
        # etcd is up, kube-apiserver is starting: seconds before the cluster would be ready.
        cli.wait_line(lambda line: "etcd healthy after" in line, 60, "etcd healthy")
        assert _processes_naming(str(state)), "no component runs yet"
        code, took = _stopped_promptly(cli, sig, state)
    assert code == 128 + sig, cli.lines
    assert took < 15, f"took {took:.1f} s to stop"  # not a benchmark: the start-up alone takes longer
    assert not any("kelastic local is up" in line for line in cli.lines), cli.lines
    assert any("while starting: stopping what was started" in line for line in cli.lines), cli.lines


def test_run_stopped_while_starting_exits_143_on_sigterm(control_plane_bin: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "pod.json"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "never-started"},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x", "command": ["true"]}]},
    }
    manifest.write_text(json.dumps(pod))
    with _kelastic(
        ["local", "run", str(manifest), "--control-plane", str(control_plane_bin)], tmp_path
    ) as cli:
        cli.wait_line(lambda line: "etcd healthy after" in line, 60, "etcd healthy")
        sent = time.monotonic()
        cli.proc.send_signal(signal.SIGTERM)
        code = cli.finish(30)
        took = time.monotonic() - sent
    assert code == 143, cli.lines
    assert took < 15, f"took {took:.1f} s to stop"
    assert any("interrupted; everything was stopped" in line for line in cli.lines), cli.lines
    assert not any("applied" in line and "object(s)" in line for line in cli.lines), cli.lines


def test_a_signal_while_the_chart_installs_stops_everything(control_plane_bin: Path, tmp_path: Path) -> None:
    pytest.importorskip(
        "helm_python", reason="helm-python-sdk installs the chart (pip install helm-python-sdk)"
    )
    state = tmp_path / "state"
    argv = ["local", "up", "--control-plane", str(control_plane_bin), "--state-dir", str(state)]
    with _kelastic(argv, tmp_path) as cli:
        cli.wait_line(lambda line: "applied" in line and "CRD" in line, 120, "the CRDs applied")
        code, took = _stopped_promptly(cli, signal.SIGTERM, state)
    assert code == 143, cli.lines
    assert took < 20, f"took {took:.1f} s to stop"
    assert not any("kelastic local is up" in line for line in cli.lines), cli.lines


def test_a_sigkilled_clusters_tmpfs_etcd_is_removed_at_the_next_start(
    control_plane_bin: Path, tmp_path: Path
) -> None:
    if not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        pytest.skip(f"{SHM} is not a writable directory: etcd's data is not kept in RAM here")
    argv = [
        "local",
        "up",
        "--control-plane",
        str(control_plane_bin),
        "--no-operator",
        "--data-dir",
        str(tmp_path / "d"),
    ]
    with _kelastic(argv, tmp_path) as cli:
        cli.wait_line(lambda line: "kelastic local is up" in line, 120, "the cluster up")
        owned = [p for p in SHM.glob(PREFIX + "*") if (o := _owner(p)) is not None and o.pid == cli.proc.pid]
        assert len(owned) == 1, owned
        cli.proc.send_signal(signal.SIGKILL)  # no chance to clean up
        cli.finish(10)
    # No component outlives it (each is told by its parent-death signal).
    marker = str(tmp_path / "d")
    wait_for(lambda: not _processes_mentioning(marker), 30, "every control-plane component to exit")
    leaked = owned[0]
    assert leaked.is_dir()
    lines: list[str] = []
    with LocalCluster(tmp_path / "next", control_plane=control_plane_bin, progress=lines.append):
        pass
    assert not leaked.exists()
    assert any(str(leaked) in line and f"pid {cli.proc.pid}" in line for line in lines), lines


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if text in cmdline and process_alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _owner(path: Path) -> Owner | None:
    try:
        return Owner.parse((path / OWNER_FILE).read_text())
    except OSError:
        return None
