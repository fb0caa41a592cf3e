"""A node's checkpoint folder is held by one live agent: two agents of one run on one host
(one host name, so one ``<run>/<node>`` folder) each get their own, and a restarted agent
gets its folder back (the claim is a ``flock`` the kernel drops when its holder dies)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.agent.checkpoint.errors import CheckpointError
from kelastic.agent.checkpoint.folder import claim_folder

HOLD = """
import sys
from kelastic.agent.checkpoint.folder import claim_folder
claim = claim_folder(__import__("pathlib").Path(sys.argv[1]))
print(claim.path, flush=True)
sys.stdin.read()
"""


def _holder(wanted: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(wanted)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_folder_another_live_agent_holds_is_not_shared(tmp_path: Path) -> None:
    wanted = tmp_path / "run" / "host"
    other, held = _holder(wanted)
    try:
        assert held == wanted
        mine = claim_folder(wanted)
        assert mine.path == tmp_path / "run" / "host-2"
        third = claim_folder(wanted)  # the same process's own claim is held too
        assert third.path == tmp_path / "run" / "host-3"
        third.release()
        mine.release()
    finally:
        other.kill()
        other.wait()


def test_the_folder_of_an_agent_that_died_is_claimed_back(tmp_path: Path) -> None:
    wanted = tmp_path / "run" / "host"
    other, held = _holder(wanted)
    (held / "ckpt-0000000007").mkdir()  # what it left: a restarted agent restores from it
    os.kill(other.pid, signal.SIGKILL)
    other.wait()
    again = claim_folder(wanted)
    assert again.path == wanted and (wanted / "ckpt-0000000007").is_dir()
    again.release()


def test_a_folder_removed_by_its_last_holder_is_made_again(tmp_path: Path) -> None:
    wanted = tmp_path / "run" / "host"
    first = claim_folder(wanted)
    first.release()
    wanted.rmdir()
    (tmp_path / "run").rmdir()
    second = claim_folder(wanted)
    assert second.path == wanted and wanted.is_dir()
    second.release()


def test_when_every_name_is_held_it_says_so(tmp_path: Path) -> None:
    wanted = tmp_path / "host"
    held = [claim_folder(wanted, tries=2) for _ in range(2)]
    with pytest.raises(CheckpointError, match="no free checkpoint folder"):
        claim_folder(wanted, tries=2)
    for claim in held:
        claim.release()
