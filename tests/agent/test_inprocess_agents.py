"""End-to-end: workers under ``kelastic.inprocess.run`` keep their processes across re-forms.

Real ``python -m kelastic.agent`` processes, a real ``kelastic-rendezvous`` store, real gloo
(tests/agent/scripts/inprocess_worker.py). What is asserted is who ran where, read from the
records each call of the training function writes: never a duration.
"""

from __future__ import annotations

import json
import runpy
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kelastic.agent.keep import alive
from kelastic.agent.rendezvous.server import ServerProcess

harness = runpy.run_path(str(Path(__file__).with_name("agent_harness.py")))
WORKER = Path(__file__).parent / "scripts" / "inprocess_worker.py"

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path, store: ServerProcess) -> Iterator[Any]:
    c = harness["Cluster"](tmp_path, store.endpoint, run_id="inprocess")
    yield c
    c.close()


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("g*_*.json"))]


def _before(out: Path, node: str) -> list[int]:
    """The pids of ``node``'s workers that reached kelastic.inprocess.run."""
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in out.glob(f"before_{node}_*"))


def _events(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["name"] for line in path.read_text().splitlines() if line.strip()]


def _start(cluster: Any, name: str, nnodes: str, *extra: str) -> Any:
    return _start_with(cluster, name, [], "--nnodes", nnodes, *extra)


def _start_with(cluster: Any, name: str, script_args: list[str], *extra: str) -> Any:
    common = ["--nproc-per-node", "1", "--max-restarts", "3", "--warm-start"]
    if "--nnodes" not in extra:
        common += ["--nnodes", "2"]
    env = {"KELASTIC_EVENTS_FILE": str(cluster.tmp / f"{name}.events.jsonl")}
    return cluster.start(name, [*common, *extra], script_args, env=env, script=WORKER)


def test_survivors_keep_their_processes_when_a_node_is_killed(cluster: Any) -> None:
    out = cluster.out
    a, b, c = (_start(cluster, n, "2:3") for n in "abc")
    cluster.wait_for("the first group", lambda: len([r for r in _records(out) if r["world"] == 3]) == 3, 120)
    first = {r["node"]: r["pid"] for r in _records(out) if r["gen"] == 0}
    # Started while the first rendezvous waited: the process that ran the script before it had
    # a group is the one that trained in it.
    assert {n: _before(out, n) for n in "abc"} == {n: [first[n]] for n in "abc"}

    c.kill_group(signal.SIGKILL)
    cluster.wait_for(
        "the group of the two survivors",
        lambda: {r["node"] for r in _records(out) if r["world"] == 2} == {"a", "b"},
        60,
    )
    second = [r for r in _records(out) if r["world"] == 2]
    # The same processes, in their second group, with the state they built in the first.
    assert {r["node"]: r["pid"] for r in second} == {"a": first["a"], "b": first["b"]}
    assert all(r["gen"] == 1 and r["env_world"] == 2 for r in second), second
    assert all(r["steps_before"] > 0 for r in second), second
    assert sorted(r["rank"] for r in second) == [0, 1]
    for name in "ab":
        names = _events(cluster.tmp / f"{name}.events.jsonl")
        assert "kelastic.agent.workers_kept" in names, names

    (out / "stop").touch()
    assert cluster.wait_all(60, [a, b]) == [0, 0]
    assert {p.name.split("_")[1] for p in out.glob("done_*")} == {"a", "b"}


def test_a_rank_that_raises_is_retried_in_its_process_and_one_that_exits_is_started_again(
    cluster: Any,
) -> None:
    out = cluster.out
    a, b = (_start(cluster, n, "2:2") for n in "ab")
    cluster.wait_for("the first group", lambda: len(_records(out)) == 2, 120)
    first = {r["node"]: r["pid"] for r in _records(out)}

    # b's training raises: the exception is b's failure (a restart spent), and both processes
    # live on into the next group
    (out / "crash_b").write_text("raise")
    cluster.wait_for("the second group", lambda: len(_records(out)) == 4, 60)
    second = {r["node"]: r for r in _records(out) if r["gen"] == 1}
    assert {n: r["pid"] for n, r in second.items()} == first, second
    assert "b fails on its own" in b.output()

    # b's process exits: b starts a new one, a keeps its own
    (out / "crash_b").write_text("exit")
    cluster.wait_for("the third group", lambda: len(_records(out)) == 6, 60)
    later = [r for r in _records(out) if r["gen"] == 2 or (r["gen"] == 0 and r["pid"] != first[r["node"]])]
    assert {r["node"]: (r["gen"], r["pid"] == first[r["node"]]) for r in later} == {
        "a": (2, True),
        "b": (0, False),
    }, later

    (out / "stop").touch()
    assert cluster.wait_all(60, [a, b]) == [0, 0]


def test_the_last_restart_spent_ends_the_worker_with_its_exception(cluster: Any) -> None:
    out = cluster.out
    a, b = (
        cluster.start(
            n,
            ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "0", "--warm-start"],
            [],
            script=WORKER,
        )
        for n in "ab"
    )
    cluster.wait_for("the first group", lambda: len(_records(out)) == 2, 120)
    (out / "crash_b").write_text("raise")
    codes = cluster.wait_all(60, [a, b])
    assert codes[1] != 0, b.output()
    # the failure names the exception the training raised, from the rank's own traceback
    assert "b fails on its own" in b.output()
    assert len(_records(out)) == 2  # nothing was retried


def test_a_standbys_workers_wait_started_and_take_the_lost_members_place(cluster: Any) -> None:
    out = cluster.out
    a, b = (_start(cluster, n, "2:2") for n in "ab")
    cluster.wait_for("the first group", lambda: len(_records(out)) == 2, 120)
    standby = _start(cluster, "reserve", "2:2", "--standby")
    # The standby's worker ran the script up to kelastic.inprocess.run, with no group.
    cluster.wait_for("the standby's worker", lambda: list(out.glob("before_reserve_*")), 90)
    (early,) = _before(out, "reserve")
    assert not [r for r in _records(out) if r["node"] == "reserve"]

    b.kill_group(signal.SIGKILL)
    cluster.wait_for(
        "the group of a and the standby",
        lambda: (
            {r["node"] for r in _records(out) if r["gen"] >= 1 or r["node"] == "reserve"} == {"a", "reserve"}
        ),
        60,
    )
    (taken,) = [r for r in _records(out) if r["node"] == "reserve"]
    # its first group (generation 0 for the process), in the process that waited for it
    assert taken["pid"] == early and taken["gen"] == 0 and taken["world"] == 2, taken
    assert "workers started early" in standby.output()

    (out / "stop").touch()
    assert cluster.wait_all(60, [a, standby]) == [0, 0]


def test_a_script_that_needs_its_rank_before_run_is_started_again_once_the_group_is_known(
    cluster: Any,
) -> None:
    out = cluster.out
    nodes = [_start_with(cluster, n, ["--rank-at-import"]) for n in "ab"]
    cluster.wait_for("the first group", lambda: len(_records(out)) == 2, 120)
    for node in nodes:
        # the early worker's KeyError is in the output, then a warning that says what to do
        assert "KeyError: 'RANK'" in node.output()
        assert "KELASTIC_KEEP_WORKERS=0" in node.output()
    assert {r["gen"] for r in _records(out)} == {0}
    (out / "stop").touch()
    assert cluster.wait_all(60, nodes) == [0, 0]


def test_a_spare_takes_the_place_of_a_worker_that_crashed_without_a_process_start(cluster: Any) -> None:
    out = cluster.out
    env = {"KELASTIC_SPARE_WORKERS": "1"}
    a, b = (
        cluster.start(
            n,
            ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "3", "--warm-start"],
            [],
            env=env | {"KELASTIC_EVENTS_FILE": str(cluster.tmp / f"{n}.events.jsonl")},
            script=WORKER,
        )
        for n in "ab"
    )
    cluster.wait_for("the first group", lambda: len(_records(out)) == 2, 120)
    first = {r["node"]: r["pid"] for r in _records(out)}
    # Once the group trained a while, each node holds a spare, parked before any group.
    cluster.wait_for("b's spare", lambda: len(_before(out, "b")) == 2, 60)
    (spare,) = [p for p in _before(out, "b") if p != first["b"]]
    assert "spare workers started" in b.output()

    (out / "crash_b").write_text("exit")  # b's process exits: its spare takes its place
    cluster.wait_for("the second group", lambda: len(_records(out)) == 4, 60)
    second = {r["node"]: r for r in _records(out) if r["pid"] != first[r["node"]] or r["gen"] == 1}
    assert second["b"]["pid"] == spare and second["b"]["gen"] == 0, second  # started before the crash
    assert second["a"]["pid"] == first["a"] and second["a"]["gen"] == 1, second  # kept
    # and b holds a new spare for the next crash
    cluster.wait_for("b's next spare", lambda: len(_before(out, "b")) == 3, 60)

    (out / "stop").touch()
    assert cluster.wait_all(60, [a, b]) == [0, 0]
    leftover = [p for p in _before(out, "b") + _before(out, "a") if alive(p)]
    assert not leftover, f"processes outlived their agents: {leftover}"


ROLLING = Path(__file__).parent / "scripts" / "rollforward_worker.py"


def _restores(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("r*_*.json"))]


def test_the_standby_that_replaces_a_killed_member_receives_the_survivors_live_state(
    cluster: Any, shm: Path
) -> None:
    out = cluster.out

    def start(name: str, *extra: str) -> Any:
        return cluster.start(
            name,
            ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "3", "--warm-start",
             "--checkpoint-dir", str(shm / name), *extra],
            [],
            script=ROLLING,
        )  # fmt: skip

    a, b = start("a"), start("b")
    cluster.wait_for("the first group", lambda: len(_restores(out)) == 2, 120)
    assert {r["source"] for r in _restores(out)} == {None}  # nothing to restore yet
    standby = start("reserve", "--standby")
    cluster.wait_for("the standby's worker", lambda: list(out.glob("before_reserve_*")), 90)

    # a few checkpoints (every 4 steps) and steps past the newest
    def reached() -> int:
        f = out / "step_a"
        return int(f.read_text() or 0) if f.exists() else 0

    cluster.wait_for("a checkpoint and steps past it", lambda: reached() >= 6, 60)
    b.kill_group(signal.SIGKILL)
    cluster.wait_for("the group of a and the standby", lambda: len(_restores(out)) == 4, 90)
    second = {r["node"]: r for r in _restores(out) if r["gen"] == 1 or r["node"] == "reserve"}
    assert set(second) == {"a", "reserve"}, second
    # a kept its process and its state: it sent it, copied nothing, redid nothing
    assert second["a"]["source"] == "live" and second["a"]["received"] == 0, second
    # the standby's early worker got a's state at a's step, not the checkpoint's
    assert second["reserve"]["source"] == "live" and second["reserve"]["received"] >= 2**20, second
    assert second["a"]["step"] == second["reserve"]["step"] > 0, second
    assert second["a"]["consistent"] and second["reserve"]["consistent"], second

    (out / "stop").touch()
    assert cluster.wait_all(60, [a, standby]) == [0, 0]
