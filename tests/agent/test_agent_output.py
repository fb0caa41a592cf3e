"""What a user reads of a successful run, agent side: no WARNING, INFO lines that fit a
terminal (long paths are DEBUG), and nothing left in the checkpoint tmpfs afterwards.

Real ``python -m kelastic.agent`` processes of a two-node job, a real store, real gloo.
"""

from __future__ import annotations

import re
import runpy
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kelastic.agent.checkpoint.settings import DEFAULT_DIR
from kelastic.agent.launch import remove_empty_folders
from kelastic.agent.rendezvous.server import ServerProcess, start_server_process

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))

#: An agent's INFO message (after ``[time] INFO logger: ``) fits this many characters.
MAX_INFO_MESSAGE = 100
_INFO = re.compile(r"^\[[^\]]+\] INFO (\S+): (.*)$")


@pytest.fixture
def store() -> Iterator[ServerProcess]:
    server = start_server_process(harness.loopback_host(), 0, timeout=60)
    yield server
    server.stop()


@pytest.mark.slow
def test_a_successful_two_node_run_reads_cleanly_and_leaves_no_tmpfs_folder(
    tmp_path: Path, store: ServerProcess
) -> None:
    run_id = f"output-{tmp_path.name}"
    cluster = harness.Cluster(tmp_path, store.endpoint, run_id=run_id)
    try:
        for name in ("a", "b"):
            cluster.start(name, ["--nnodes", "2", "--nproc-per-node", "2"], ["--steps", "5"])
        assert cluster.wait_all(180) == [0, 0], "\n".join(a.output()[-3000:] for a in cluster.agents)
        for agent in cluster.agents:
            lines = agent.output().splitlines()
            assert not [line for line in lines if " WARNING " in line], agent.output()[-3000:]
            infos = [m for m in map(_INFO.match, lines) if m]
            assert infos, agent.output()[-3000:]
            long = [m.group(0) for m in infos if len(m.group(2)) > MAX_INFO_MESSAGE]
            assert not long, long
            assert not any(DEFAULT_DIR in line for line in lines), "tmpfs paths are DEBUG"
        # The node folders are freed, and the run's folder, empty, is gone with them.
        assert not (Path(DEFAULT_DIR) / run_id).exists(), list((Path(DEFAULT_DIR) / run_id).iterdir())
    finally:
        cluster.close()


def test_empty_checkpoint_folders_go_and_the_rest_stays(tmp_path: Path) -> None:
    base = tmp_path / "ckpt"
    mine, theirs = base / "run" / "node-a", base / "run" / "node-b"
    mine.mkdir(parents=True)
    theirs.mkdir(parents=True)
    remove_empty_folders(mine)  # node-b is still there: the run's folder stays
    assert not mine.exists() and theirs.exists()
    theirs.rmdir()
    remove_empty_folders(theirs)  # already gone: its empty run folder goes, the user's folder stays
    assert not (base / "run").exists() and base.exists()
