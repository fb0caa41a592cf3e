"""etcd's tmpfs directories: a SIGKILLed owner's directory is swept, a live one's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kelastic.localcluster.controlplane.tmpfs import (
    Owner,
    claim_scratch_dir,
    process_start_time,
    scratch_verdict,
    sweep_scratch_dirs,
)
from kelastic.localcluster.testing import stop_process, wait_for

CLAIM_AND_SLEEP = (
    "import sys, time\n"
    "from kelastic.localcluster.controlplane.tmpfs import claim_scratch_dir\n"
    "print(claim_scratch_dir(sys.argv[1]), flush=True)\n"
    "time.sleep(600)\n"
)


def test_the_verdict_keeps_live_owners_and_young_or_used_unowned_directories() -> None:
    owner = Owner(4242, 1000)
    assert scratch_verdict(owner, 1000, False, 1e6) is None  # the owner runs: never removed
    assert "pid 4242, is gone" in str(scratch_verdict(owner, None, False, 0.0))
    assert "another process" in str(scratch_verdict(owner, 2000, False, 0.0))  # the pid was reused
    assert scratch_verdict(None, None, False, 5.0) is None  # perhaps being created right now
    assert scratch_verdict(None, None, True, 1e6) is None  # an etcd uses it as --data-dir
    assert "no owner" in str(scratch_verdict(None, None, False, 3600.0))


def test_owner_records_round_trip_and_reject_garbage() -> None:
    assert Owner.parse(Owner(12, 345).render()) == Owner(12, 345)
    assert Owner.parse("") is None and Owner.parse("12") is None and Owner.parse("a b") is None


def test_process_start_time_tells_a_running_process_from_a_gone_one() -> None:
    assert process_start_time(os.getpid()) is not None
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert process_start_time(proc.pid) is None


def _claim_in_child(base: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIM_AND_SLEEP, str(base)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_sigkilled_owners_directory_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    killed, leaked = _claim_in_child(tmp_path)
    live, kept = _claim_in_child(tmp_path)
    mine = claim_scratch_dir(tmp_path)
    try:
        (leaked / "data" / "db").write_bytes(b"x" * 4096)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert leaked.is_dir()  # nobody cleaned up after it
        swept = sweep_scratch_dirs(tmp_path)
        assert [s.path for s in swept] == [leaked] and swept[0].size_bytes >= 4096
        assert f"pid {killed.pid}" in swept[0].reason
        assert not leaked.exists() and kept.is_dir() and mine.is_dir()
        assert (kept / "data").is_dir() and (mine / "owner").read_text().split()[0] == str(os.getpid())
    finally:
        stop_process(live, 5)
        stop_process(killed, 5)


def test_an_unowned_directory_goes_only_when_old_and_unused(tmp_path: Path) -> None:
    old = tmp_path / "kelastic-etcd-old"
    (old / "member").mkdir(parents=True)
    used = tmp_path / "kelastic-etcd-used"
    used.mkdir()
    young = tmp_path / "kelastic-etcd-young"
    young.mkdir()
    reused = tmp_path / "kelastic-etcd-reused"  # the owner's pid now runs something else
    reused.mkdir()
    (reused / "owner").write_text(Owner(os.getpid(), 1).render())
    an_hour_ago = time.time() - 3600
    for path in (old, used):
        os.utime(path, (an_hour_ago, an_hour_ago))
    user = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"--data-dir={used}"])
    cmdline = Path(f"/proc/{user.pid}/cmdline")
    try:
        wait_for(lambda: str(used).encode() in cmdline.read_bytes(), 30, "the user's command line")
        swept = sweep_scratch_dirs(tmp_path)
    finally:
        stop_process(user, 5)
    assert sorted(s.path.name for s in swept) == ["kelastic-etcd-old", "kelastic-etcd-reused"]
    assert used.is_dir() and young.is_dir()


@pytest.mark.parametrize("name", ["kelastic-etcd-file", "other-dir"])
def test_only_directories_with_the_prefix_are_considered(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    if name.endswith("file"):
        path.write_text("x")
    else:
        path.mkdir()
    os.utime(path, (0, 0))
    assert sweep_scratch_dirs(tmp_path) == [] and path.exists()
