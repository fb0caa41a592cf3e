"""Memory checkpoints through real ``kelastic-agent`` nodes, a real store, real DCP and gloo.

The worker (scripts/ckpt_worker.py) saves every step with ``MemoryWriter`` and restores
with ``MemoryReader``; its state after step s is a pure function of s, so a restore is
bit-identical exactly when its hash equals the hash recorded when that step was saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import shutil
import signal
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kelastic.agent.rendezvous.server import ServerProcess

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))
SCRIPT = Path(__file__).parent / "scripts" / "ckpt_worker.py"

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

events = harness.events


def saved(out: Path) -> dict[int, str]:
    return {e["step"]: e["hash"] for e in events(out) if e["event"] == "saved"}


def first_restore(c: Any, world: int) -> dict[str, Any]:
    """The first restore of a group of ``world`` ranks (waits for it)."""
    c.wait_for(f"a restore at world {world}", lambda: any(
        e["event"] == "restored" and e["world"] == world for e in events(c.out)), 120)  # fmt: skip
    return next(e for e in events(c.out) if e["event"] == "restored" and e["world"] == world)


def assert_no_step_diverged(out: Path) -> None:
    """No step was redone with a different result: every step saved twice has one hash."""
    seen: dict[int, set[str]] = {}
    for e in events(out):
        if e["event"] == "saved":
            seen.setdefault(e["step"], set()).add(e["hash"])
    assert all(len(h) == 1 for h in seen.values()), seen


def digest(state: dict[str, Any]) -> str:
    """The worker's hash of its state (scripts/ckpt_worker.py)."""
    h = hashlib.sha256()
    for k in sorted(state["model"]):
        h.update(state["model"][k].numpy().tobytes())
    h.update(state["opt"]["momentum"].numpy().tobytes())
    h.update(str(int(state["step"])).encode())
    return h.hexdigest()[:16]


def start(
    c: Any,
    name: str,
    shm: Path,
    extra: list[str] = (),  # type: ignore[assignment]
    nnodes: str = "2:3",
    save_every: int = 1,
    script: list[str] = (),  # type: ignore[assignment]
) -> Any:
    return c.start(
        name,
        ["--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3", "--warm-start",
         "--checkpoint-dir", str(shm), "--checkpoint-memory", "512Mi", *extra],
        ["--mib", "8", "--step-time", "0.2", "--steps", "1000", "--save-every", str(save_every), *script],
        script=SCRIPT,
    )  # fmt: skip


def test_a_joining_node_waits_for_the_next_checkpoint_and_the_grown_group_redoes_no_step(
    tmp_path: Path, store: ServerProcess, shm: Path
) -> None:
    """Saves every 5 steps: re-formed at once, the grown group would redo up to 4 steps;
    re-formed right after the next save (every agent sees its commit), none."""
    c = harness.Cluster(tmp_path, store.endpoint, run_id=f"ckpt-{uuid.uuid4().hex[:6]}")
    try:
        for name in ("node-a", "node-b"):
            start(c, name, shm, save_every=5)
        c.wait_for("two saves at world 2", lambda: sum(
            e["event"] == "saved" and e["world"] == 2 for e in events(c.out)) >= 2, 180)  # fmt: skip
        start(c, "node-c", shm, save_every=5)
        c.wait_for("a restore at world 3", lambda: any(
            e["event"] == "restored" and e["world"] == 3 for e in events(c.out)), 120)  # fmt: skip
        trained = max(e["step"] for e in events(c.out) if e["event"] == "trained" and e["world"] == 2)
        restored = next(e for e in events(c.out) if e["event"] == "restored" and e["world"] == 3)
        assert restored["step"] == trained, f"steps {restored['step'] + 1}..{trained} were trained twice"
        # The agent that saw node-c first deferred; the other may have restarted only because
        # that one's workers left (a failed collective), never seeing node-c at a healthy tick.
        said = [a.output() for a in c.agents[:2]]
        assert any(
            "restarting after the next checkpoint" in out and "at the checkpoint after" in out for out in said
        ), [out[-3000:] for out in said]
        # A re-form's INFO lines fit a terminal of 100 columns, like a plain run's.
        for agent in c.agents:
            long = [
                line for line in agent.output().splitlines() if line.startswith("[I ") and len(line) > 100
            ]
            assert not long, long
    finally:
        c.close()


def test_killing_the_node_of_rank_0_restores_its_part_from_a_replica_bit_identical(
    tmp_path: Path, store: ServerProcess, shm: Path
) -> None:
    c = harness.Cluster(tmp_path, store.endpoint, run_id=f"ckpt-{uuid.uuid4().hex[:6]}")
    try:
        for name in ("node-a", "node-b", "node-c"):
            start(c, name, shm)
        c.wait_for("steps saved at world 3", lambda: any(
            e["event"] == "saved" and e["world"] == 3 and e["step"] >= 5 for e in events(c.out)), 180)  # fmt: skip
        holder = next(e["node"] for e in reversed(events(c.out)) if e["event"] == "saved")
        victim = next(a for a in c.agents if a.name == holder)
        last_before = max(saved(c.out))
        victim.kill_group()
        restored = first_restore(c, world=2)
        hashes = saved(c.out)
        assert restored["hash"] == hashes[restored["step"]], "the restored state is not the saved one"
        assert restored["step"] >= last_before - 1, (restored, last_before)
        assert restored["source"] == "replica", restored
        c.wait_for("steps after the restore", lambda: max(saved(c.out)) >= restored["step"] + 3, 60)
        assert_no_step_diverged(c.out)
    finally:
        c.close()


def test_after_every_node_died_the_durable_copy_restores_with_plain_dcp_and_with_kelastic(
    tmp_path: Path, store: ServerProcess, shm: Path
) -> None:
    durable = tmp_path / "durable"
    persist = ["--checkpoint-persist-dir", str(durable), "--checkpoint-persist-every", "2"]
    first = harness.Cluster(tmp_path / "first", store.endpoint, run_id=f"ckpt-{uuid.uuid4().hex[:6]}")
    try:
        for name in ("node-a", "node-b"):
            start(first, name, shm, persist, nnodes="2:2")
        first.wait_for("a durable copy", lambda: any(durable.glob("checkpoint-*/.metadata")), 180)
        first.wait_for("two more saves", lambda: len(saved(first.out)) >= 6, 60)
    finally:
        first.close()  # SIGKILL: every node of the job is gone, their memory with them
    shutil.rmtree(shm, ignore_errors=True)
    copies = sorted(durable.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    newest = copies[-1]
    # plain torch.distributed.checkpoint reads it without kelastic
    rows = 8 * 2**20 // 4 // 1024 // 4
    state = {
        "model": {f"layer{i}": torch.zeros(rows, 1024) for i in range(4)},
        "opt": {"momentum": torch.zeros(rows // 2, 1024, dtype=torch.float64)},
        "step": torch.zeros((), dtype=torch.int64),
        "extra": {"note": ""},
    }
    dcp.load(state, storage_reader=dcp.FileSystemReader(newest), no_dist=True)
    assert digest(state) == saved(first.out)[int(state["step"])]
    assert state["extra"]["note"] == "kelastic"
    # a new job (new agents, empty memory) restores it through MemoryReader
    second = harness.Cluster(tmp_path / "second", store.endpoint, run_id=f"ckpt-{uuid.uuid4().hex[:6]}")
    try:
        for name in ("node-a", "node-b"):
            start(second, name, shm, persist, nnodes="2:2")
        second.wait_for("a restore", lambda: any(e["event"] == "restored" for e in events(second.out)), 180)
        restored = next(e for e in events(second.out) if e["event"] == "restored")
        assert restored["source"] == "durable"
        assert restored["hash"] == saved(first.out)[restored["step"]]
    finally:
        second.close()


def holding(out: Path) -> dict[str, Any] | None:
    """The rank holding its copy of a save in the middle (scripts/ckpt_worker.py --hold-step)."""
    path = out / "holding.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("victim", ["worker", "node"])
def test_a_kill_in_the_middle_of_an_overlapping_save_restores_the_previous_checkpoint_bit_identical(
    tmp_path: Path, store: ServerProcess, shm: Path, victim: str
) -> None:
    """Saves every step with OverlappingSaver; step 6's copy is held half-written on one rank
    (its first tensor copied, the rest not) while the other ranks finished theirs, and that
    rank (or its whole node) is SIGKILLed: the group restores step 5, bit-identical, never
    the torn step 6, and trains on."""
    c = harness.Cluster(tmp_path, store.endpoint, run_id=f"ckpt-{uuid.uuid4().hex[:6]}")
    try:
        for name in ("node-a", "node-b", "node-c"):
            start(c, name, shm, script=["--overlap", "--hold-step", "6", "--mib", "48"])
        c.wait_for("step 6's copy held on a rank", lambda: holding(c.out) is not None, 180)
        held = holding(c.out)
        assert held is not None and held["step"] == 6
        c.wait_for("step 5 committed", lambda: 5 in saved(c.out), 30)
        assert 6 not in saved(c.out), "step 6 was committed although a rank's copy is held"
        if victim == "worker":
            os.kill(held["pid"], signal.SIGKILL)
        else:
            next(a for a in c.agents if a.name == held["node"]).kill_group()
        restored = first_restore(c, world=3 if victim == "worker" else 2)
        assert restored["step"] == 5, f"restored {restored}, not the previous complete checkpoint (step 5)"
        assert restored["hash"] == saved(c.out)[5], "the restored state is not the one saved at step 5"
        c.wait_for("steps after the restore", lambda: max(saved(c.out)) >= 9, 60)
        assert_no_step_diverged(c.out)
    finally:
        c.close()
