"""End-to-end: a standby replaces a killed member while the survivor's old workers still stop.

Real ``python -m kelastic.agent`` processes, a real ``kelastic-rendezvous`` store, real gloo.
The survivor's worker holds its stop (tests/agent/scripts/slow_stop_worker.py waits for a file
on SIGTERM), so what the test asserts is the order of things, read from the store and from the
agents' events (``$KELASTIC_EVENTS_FILE``), never a duration: the new group, the standby in the
lost member's place, is decided while the survivor's old worker is alive; the survivor's new
workers start only after the old one is gone.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic.agent.rendezvous import control
from kelastic.agent.rendezvous.protocol import RunKeys
from kelastic.agent.rendezvous.server import ServerProcess

harness = runpy.run_path(str(Path(__file__).with_name("agent_harness.py")))
WORKER = Path(__file__).parent / "scripts" / "slow_stop_worker.py"

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path, store: ServerProcess) -> Iterator[Any]:
    c = harness["Cluster"](tmp_path, store.endpoint, run_id="reform")
    yield c
    c.close()


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_standby_takes_the_place_while_the_survivors_old_workers_stop(
    cluster: Any, store: ServerProcess
) -> None:
    out, tmp = cluster.out, cluster.tmp
    common = ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "0", "--warm-start"]

    def start(name: str, *extra: str) -> Any:
        env = {"KELASTIC_EVENTS_FILE": str(tmp / f"{name}.events.jsonl")}
        return cluster.start(name, [*common, *extra], [], env=env, script=WORKER)

    survivor, victim = start("a"), start("b")
    cluster.wait_for("the first group's workers", lambda: len(list(out.glob("w2_*.json"))) == 2, 90)
    reserve = start("reserve", "--standby")
    keys, rdzv = RunKeys(cluster.run_id), control.connect(store.endpoint)
    cluster.wait_for("the standby parked", lambda: rdzv.check([keys.standby("reserve")]), 90)
    (old,) = [json.loads(p.read_text())["pid"] for p in out.glob("w2_a_*.json")]

    (out / "second").touch()  # the re-formed group's workers finish at once
    victim.kill_group(signal.SIGKILL)
    cluster.wait_for(
        "the group of the survivor and the standby",
        lambda: sorted(control.read_status(rdzv, cluster.run_id).members) == ["a", "reserve"],
        60,
    )
    # Decided while the survivor's old worker still stops (it waits for the release file).
    assert _alive(old), "the survivor's old worker was gone before the new group was decided"
    names = [e["name"] for e in _events(tmp / "a.events.jsonl")]
    assert "kelastic.agent.workers_stopped" not in names
    (out / "release").touch()
    assert cluster.wait_all(90, [survivor, reserve]) == [0, 0]

    a = _events(tmp / "a.events.jsonl")
    names = [e["name"].removeprefix("kelastic.agent.") for e in a]
    i_restart = names.index("restart")
    assert a[names.index("fault_noticed")]["metadata"]["cause"] == "membership"
    after = names[i_restart:]
    # The re-form: the stop ends after the join began and before the ranks and the new workers.
    assert after.index("workers_stopped") < after.index("rendezvous") < after.index("workers_started")
    stopped = a[i_restart + after.index("workers_stopped")]
    joined = a[i_restart + after.index("rendezvous")]["metadata"]
    assert joined["rdzv_closed"] < stopped["metadata"]["stopped_at"], (
        "the round closed only after the old workers stopped"
    )
    assert joined["group_world_size"] == 2
    r = _events(tmp / "reserve.events.jsonl")
    assert [e["metadata"]["group_world_size"] for e in r if e["name"] == "kelastic.agent.rendezvous"] == [2]
    assert "is a standby" in reserve.output()
    second = sorted(json.loads(p.read_text())["node"] for p in out.glob("w2_*.json"))
    assert second == ["a", "a", "b", "reserve"]
