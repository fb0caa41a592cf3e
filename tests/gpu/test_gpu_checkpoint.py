"""Overlapping memory checkpoints of a state on the GPU: real agents, one GPU for all of them.

tests/agent/scripts/ckpt_worker.py with ``--device cuda --overlap``: the state lives on the
GPU (its step counter on the CPU, as Adam keeps it), every step is saved with
``OverlappingSaver``, whose copy goes to pinned host memory on a CUDA stream of its own. The
GPU spins before each update, so a staging copy not ordered after the queued update would
save the state from before it; the state holds NaN through each step's work from
``wait_staged()`` on, so a copy that the next step did not wait for would save NaN. Either
shows as a restore whose hash is not the one recorded at the save. Needs one GPU (the root
conftest skips it elsewhere, saying so).
"""

from __future__ import annotations

import os
import runpy
import signal
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent.rendezvous.server import ServerProcess

AGENT_TESTS = Path(__file__).resolve().parents[1] / "agent"
harness = SimpleNamespace(**runpy.run_path(str(AGENT_TESTS / "agent_harness.py")))
checkpoints = SimpleNamespace(**runpy.run_path(str(AGENT_TESTS / "test_checkpoint_agents.py")))

pytestmark = [pytest.mark.gpu(gpus=1), pytest.mark.slow, pytest.mark.timeout(900)]


# the same store and tmpfs folder as the CPU checkpoint tests (the agent tests' fixtures)
agent_fixtures = SimpleNamespace(**runpy.run_path(str(AGENT_TESTS / "conftest.py")))
store = agent_fixtures.store
shm = agent_fixtures.shm


def test_an_overlapping_save_of_a_gpu_state_is_staged_in_pinned_memory_and_restores_bit_identical(
    tmp_path: Path, store: ServerProcess, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the agents pass it on to their workers
    c: Any = harness.Cluster(tmp_path, store.endpoint, run_id=f"gpu-ckpt-{uuid.uuid4().hex[:6]}")
    try:
        for name in ("gpu-a", "gpu-b", "gpu-c"):
            checkpoints.start(
                c, name, shm, script=["--overlap", "--hold-step", "6", "--mib", "64", "--device", "cuda"]
            )
        c.wait_for("step 6's copy held on a rank", lambda: checkpoints.holding(c.out) is not None, 300)
        staged = [e for e in checkpoints.events(c.out) if e["event"] == "staged"]
        assert staged and staged[0]["pinned"], (
            f"the CUDA state was not staged in pinned host memory: {staged}"
        )
        held = checkpoints.holding(c.out)
        c.wait_for("step 5 committed", lambda: 5 in checkpoints.saved(c.out), 30)
        os.kill(held["pid"], signal.SIGKILL)
        restored = checkpoints.first_restore(c, world=3)
        assert restored["step"] == 5, restored
        assert restored["hash"] == checkpoints.saved(c.out)[5], "the restored GPU state is not the saved one"
        c.wait_for("steps after the restore", lambda: max(checkpoints.saved(c.out)) >= 9, 120)
        checkpoints.assert_no_step_diverged(c.out)
    finally:
        c.close()
