"""A hot standby holds every member's newest checkpoint part and restores from its own memory.

Real ``kelastic-agent`` nodes (gloo, CPU), a real store and real DCP: two members save with
``MemoryWriter`` (scripts/ckpt_worker.py), a third agent waits as a standby. The members send
it their parts after each commit; when a member's node is killed, the standby takes its
place and its ranks restore with ``MemoryReader`` reading every part from the standby's
own memory: nothing fetched over the network at failover (its agent's log says so).
"""

from __future__ import annotations

import re
import runpy
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent.rendezvous.server import ServerProcess

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))
SCRIPT = Path(__file__).parent / "scripts" / "ckpt_worker.py"

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

events = harness.events


def saved(out: Path) -> dict[int, set[str]]:
    """Every step saved, with the hashes of its state (one each, unless a redo diverged)."""
    seen: dict[int, set[str]] = {}
    for e in events(out):
        if e["event"] == "saved":
            seen.setdefault(e["step"], set()).add(e["hash"])
    return seen


def newest_parts(folder: Path) -> tuple[int, set[str]]:
    """The newest checkpoint a node's folder holds files of, and which (0 and none: nothing)."""
    found = sorted(folder.glob("ckpt-*"))
    if not found:
        return 0, set()
    newest = found[-1]
    return int(newest.name.removeprefix("ckpt-")), {p.name for p in newest.glob("__*.mem")}


def committed(folder: Path) -> int:
    """The newest checkpoint a member's folder holds committed (its metadata arrived)."""
    done = [int(d.name.removeprefix("ckpt-")) for d in folder.glob("ckpt-*") if (d / ".metadata").exists()]
    return max(done, default=0)


def start(c: Any, name: str, shm: Path, *extra: str) -> Any:
    return c.start(
        name,
        ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "3", "--warm-start",
         "--checkpoint-dir", str(shm), "--checkpoint-memory", "256Mi", *extra],
        ["--mib", "8", "--step-time", "0.2", "--steps", "1000", "--save-every", "10"],
        script=SCRIPT,
    )  # fmt: skip


def test_the_standby_that_replaces_a_killed_member_restores_from_its_own_memory(
    tmp_path: Path, store: ServerProcess, shm: Path
) -> None:
    run_id = f"ckpt-{uuid.uuid4().hex[:6]}"
    c = harness.Cluster(tmp_path, store.endpoint, run_id=run_id)
    try:
        start(c, "node-a", shm)
        victim = start(c, "node-b", shm)
        c.wait_for("a save at world 2", lambda: any(
            e["event"] == "saved" and e["world"] == 2 for e in events(c.out)), 180)  # fmt: skip
        standby = start(c, "node-s", shm, "--standby")
        member, spare = shm / run_id / "node-a", shm / run_id / "node-s"

        def caught_up() -> bool:
            newest = committed(member)
            cid, names = newest_parts(spare)
            return newest > 0 and cid == newest and names == {"__0.mem", "__1.mem"}

        # the standby holds both members' parts of the newest checkpoint, sent in the background
        c.wait_for("the standby to hold every part of the newest checkpoint", caught_up, 120)
        victim.kill_group()
        shutil.rmtree(shm / run_id / "node-b", ignore_errors=True)  # its pod's /dev/shm goes with it
        c.wait_for("the standby's restore", lambda: "restored checkpoint" in standby.output(), 120)
        said = standby.output()
        line = next(s for s in said.splitlines() if "restored checkpoint" in s)
        assert re.search(r"\(\S+ \S+ local, 0 B fetched\)", line), line
        assert "(0 B read" not in line, line  # it did read the state, from its own memory
        c.wait_for("rank 0's restore", lambda: any(e["event"] == "restored" for e in events(c.out)), 60)
        restored = next(e for e in events(c.out) if e["event"] == "restored")
        assert restored["world"] == 2, restored
        assert saved(c.out)[restored["step"]] == {restored["hash"]}, "the restored state is not the saved one"
        c.wait_for("steps after the restore", lambda: max(saved(c.out)) >= restored["step"] + 10, 120)
        assert all(len(h) == 1 for h in saved(c.out).values()), "a redone step diverged"
    finally:
        c.close()
