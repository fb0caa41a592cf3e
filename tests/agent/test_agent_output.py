"""What a user reads of a successful run, agent side: no WARNING, INFO lines that fit a
terminal (long paths are DEBUG), and nothing left in the checkpoint tmpfs afterwards.

Real ``python -m kelastic.agent`` processes of a two-node job, a real store, real gloo.
"""

from __future__ import annotations

import datetime
import logging
import re
import runpy
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

from kelastic.agent.checkpoint.settings import DEFAULT_DIR
from kelastic.agent.launch import remove_empty_folders
from kelastic.agent.rendezvous.keepalive import KeepAlive
from kelastic.agent.rendezvous.protocol import RunKeys
from kelastic.agent.rendezvous.rounds import Member
from kelastic.agent.rendezvous.server import ServerProcess
from kelastic.agent.rendezvous.settings import settings_from_params

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))

#: An agent's INFO line, its ``[I 18:58:29] `` prefix included, fits a terminal this wide.
MAX_INFO_LINE = 100
_INFO = re.compile(r"^\[I \d\d:\d\d:\d\d\] (.*)$")


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
            assert not [line for line in lines if line.startswith("[W ")], agent.output()[-3000:]
            infos = [m for m in map(_INFO.match, lines) if m]
            assert infos, agent.output()[-3000:]
            long = [m.group(0) for m in infos if len(m.group(0)) > MAX_INFO_LINE]
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


@pytest.mark.parametrize(("closed", "level"), [(False, logging.WARNING), (True, logging.DEBUG)])
def test_a_peer_gone_after_the_job_finished_is_no_warning(
    closed: bool, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Its link closes when its agent exits at the end of the job: marked dead, said quietly."""
    caplog.set_level(logging.DEBUG, logger="kelastic.agent.rendezvous.keepalive")
    settings = settings_from_params(RendezvousParameters("kelastic", "127.0.0.1:1", "quiet", 1, 2))
    keys = RunKeys("quiet")
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10))
    if closed:
        store.set(keys.closed, "1")
    me = Member(round=1, rank=0, size=2, successor="peer")
    keep = KeepAlive(settings, keys, threading.RLock(), lambda: (me, None, me), threading.Event())
    keep.suspect(1, "peer")
    keep.claim_suspects(store)
    said = [r for r in caplog.records if "closed its link" in r.getMessage()]
    assert [r.levelno for r in said] == [level], [r.getMessage() for r in said]
