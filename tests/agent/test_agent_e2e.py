"""End-to-end: real ``python -m kelastic.agent`` processes, a real rendezvous store, real gloo.

Each test starts a ``kelastic-rendezvous`` store on its own 127.x address and
agents as subprocesses (one session each, so a whole node can be SIGKILLed),
and checks what the workers saw (tests/agent/scripts/check_worker.py).
"""

from __future__ import annotations

import datetime
import re
import runpy
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent.rendezvous import control
from kelastic.agent.rendezvous.protocol import RunKeys, read_counter
from kelastic.agent.rendezvous.server import ServerProcess, start_server_process

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path, store: ServerProcess) -> Iterator[Any]:
    c = harness.Cluster(tmp_path, store.endpoint, run_id=f"job-{tmp_path.name}")
    yield c
    c.close()


def _check_group(records: list[dict[str, Any]], world: int) -> None:
    """Every worker's variables agree with each other and with the rank rules."""
    assert sorted(int(r["env"]["RANK"]) for r in records) == list(range(world))
    group = records[0]["group"]  # [RANK, LOCAL_RANK, GROUP_RANK, ROLE_RANK, LWS, ROLE_WS, ROLE, RUN_ID]
    assert all(r["group"] == group for r in records), "workers disagree about the group"
    by_group: dict[int, int] = {}
    for _rank, _lr, grank, _rr, lws, _rws, _role, _rid in group:
        by_group[grank] = lws
    assert sorted(by_group) == list(range(len(by_group)))
    for rank, lr, grank, _rr, _lws, _rws, _role, _rid in group:
        assert rank == sum(by_group[g] for g in range(grank)) + lr
    for role in {g[6] for g in group}:
        entries = sorted((g for g in group if g[6] == role), key=lambda g: (g[2], g[1]))
        assert [g[3] for g in entries] == list(range(len(entries))), f"role ranks of {role}"
        assert {g[5] for g in entries} == {len(entries)}
    for r in records:
        assert r["allreduce"] == world * (world - 1) / 2


def test_three_agents_two_ranks_each(cluster: Any) -> None:
    # exactly the operator's command line (health port 0: any free port)
    common = ["--nnodes", "3:3", "--nproc-per-node", "2", "--max-restarts", "1", "--health-port", "0"]
    for name in ("node-a", "node-b", "node-c"):
        cluster.start(name, common, ["--steps", "2"])
    assert cluster.wait_all(90) == [0, 0, 0]
    records = cluster.records(6)
    assert len(records) == 6
    _check_group(records, 6)
    for r in records:
        env = r["env"]
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("6", "2", "3")
        assert (env["ROLE_NAME"], env["ROLE_WORLD_SIZE"], env["ROLE_RANK"]) == ("default", "6", env["RANK"])
        assert int(env["RANK"]) == 2 * int(env["GROUP_RANK"]) + int(env["LOCAL_RANK"])
        assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "1")
        assert env["TORCHELASTIC_RUN_ID"] == cluster.run_id
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["OMP_NUM_THREADS"] == "1"
        err = Path(env["TORCHELASTIC_ERROR_FILE"])
        assert err.parts[-4:] == (cluster.run_id, "attempt_0", env["LOCAL_RANK"], "error.json")
        assert err.parent.is_dir()


def test_fourth_agent_joining_restarts_all_at_the_larger_world(cluster: Any) -> None:
    # --warm-start: workers forked from a pre-imported server (the path of fast recoveries)
    common = ["--nnodes", "3:4", "--nproc-per-node", "1", "--max-restarts", "0", "--warm-start"]
    for name in ("a", "b", "c"):
        cluster.start(name, common, ["--until-world", "4", "--steps", "2"])
    cluster.wait_for("steps at world 3", lambda: any(w == 3 for _, w, _, _ in cluster.steps()), 60)
    cluster.start("d", common, ["--until-world", "4", "--steps", "2"])
    assert cluster.wait_all(60) == [0, 0, 0, 0]
    records = cluster.records(4)
    assert len(records) == 4
    _check_group(records, 4)
    # a membership change is not a failure: no restart was spent
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in records} == {"0"}


def test_sigkill_of_one_node_lets_the_survivors_continue(cluster: Any) -> None:
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "0", "--warm-start"]
    agents = [cluster.start(n, common, ["--until-world", "2", "--steps", "2"]) for n in ("a", "b", "c")]
    cluster.wait_for("steps at world 3", lambda: any(w == 3 for _, w, _, _ in cluster.steps()), 60)
    killed_at = time.time()
    agents[2].kill_group(signal.SIGKILL)
    assert cluster.wait_all(60, agents[:2]) == [0, 0]
    records = cluster.records(2)
    assert len(records) == 2
    _check_group(records, 2)
    first = min(t for t, w, _, _ in cluster.steps() if w == 2)
    print(f"recovery: first step at world 2 {first - killed_at:.2f}s after SIGKILL")


def test_a_standby_agent_replaces_a_killed_node_in_one_reform(cluster: Any, store: ServerProcess) -> None:
    done = cluster.tmp / "done"
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "0", "--warm-start"]
    script = ["--until-file", str(done), "--steps", "3", "--max-wait", "120"]
    agents = [cluster.start(n, common, script) for n in ("a", "b", "c")]
    cluster.wait_for("steps at world 3", lambda: any(w == 3 for _, w, _, _ in cluster.steps()), 90)
    reserve = cluster.start("reserve", [*common, "--standby"], script)
    keys = RunKeys(cluster.run_id)
    rdzv = control.connect(store.endpoint)
    cluster.wait_for("the standby parked", lambda: rdzv.check([keys.standby("reserve")]), 90)
    assert read_counter(rdzv, keys.open) == 1, "the standby's arrival re-formed the group"
    before = {r["pid"] for r in cluster.records(3)}
    killed_at = time.time()
    agents[2].kill_group(signal.SIGKILL)
    # The re-formed group's workers overwrite the records of the first (same world, same restart count).
    cluster.wait_for(
        "a second group of world 3",
        lambda: len({r["pid"] for r in cluster.records(3)} - before) == 3,
        60,
    )
    first = min(t for t, w, rank, _ in cluster.steps() if w == 3 and t > killed_at)
    done.touch()
    assert cluster.wait_all(90, [*agents[:2], reserve]) == [0, 0, 0]
    # One re-form: round 2 closed with the survivors and the standby, nothing after it.
    status = control.read_status(rdzv, cluster.run_id)
    assert read_counter(rdzv, keys.open) == 2
    assert status.round == 2 and sorted(status.members) == ["a", "b", "reserve"]
    assert {r["env"]["WORLD_SIZE"] for r in cluster.records()} == {"3"}
    assert "is a standby" in reserve.output()
    print(f"standby: first step of the re-formed group {first - killed_at:.2f}s after SIGKILL")


def test_heterogeneous_nodes_get_global_and_role_ranks(cluster: Any) -> None:
    cluster.start("a", ["--nnodes", "3", "--nproc-per-node", "2", "--role", "x"], ["--steps", "1"])
    cluster.start("b", ["--nnodes", "3", "--nproc-per-node", "1", "--role", "y"], ["--steps", "1"])
    cluster.start("c", ["--nnodes", "3", "--nproc-per-node", "1", "--role", "x"], ["--steps", "1"])
    assert cluster.wait_all(90) == [0, 0, 0]
    records = cluster.records(4)
    assert len(records) == 4
    _check_group(records, 4)
    roles = {r["env"]["ROLE_NAME"]: r["env"]["ROLE_WORLD_SIZE"] for r in records}
    assert roles == {"x": "3", "y": "1"}
    lws = {r["env"]["ROLE_NAME"] + r["env"]["LOCAL_WORLD_SIZE"] for r in records}
    assert lws == {"x2", "y1", "x1"}


# The rendezvous store lost under training: the workers' collectives never use it, so a
# store that dies and comes back costs no step and no restart; a node lost meanwhile still
# re-forms the group once, at the smaller size; a store that never comes back fails the job
# with a message naming it.
STORE_LOSS_ARGS = ["--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "0"]
# The first round closes with all three without waiting for the last call.
STORE_LOSS_CONF = ["--rdzv-conf", "last_call_timeout=30"]


def _restart_store(store: ServerProcess) -> ServerProcess:
    host, port = store.endpoint.rsplit(":", 1)
    return start_server_process(host, int(port), timeout=30)


def test_store_killed_mid_training_and_at_the_end_costs_no_step(cluster: Any, store: ServerProcess) -> None:
    """The store dies twice: mid-training (the group trains on and re-establishes its
    round when it is back), and as the workers finish (the agents wait at the exit
    barrier until it is back, then all succeed)."""
    steps = 200
    for name in ("a", "b", "c"):
        cluster.start(
            name, [*STORE_LOSS_ARGS, *STORE_LOSS_CONF], ["--steps", str(steps), "--step-time", "0.05"]
        )
    cluster.wait_for("steps at world 3", lambda: len(cluster.steps()) >= 3 * 10, 90)
    store.kill()
    cluster.wait_for("steps without a store", lambda: len(cluster.steps()) >= 3 * 25, 60)
    again = _restart_store(store)
    cluster.wait_for("steps near the end", lambda: len(cluster.steps()) >= 3 * (steps - 20), 60)
    again.kill()
    cluster.wait_for(
        "agents at the exit barrier",
        lambda: all("workers finished; waiting" in a.output() for a in cluster.agents),
        60,
    )
    assert all(a.proc.poll() is None for a in cluster.agents), "an agent passed the barrier without the store"
    last = _restart_store(store)
    try:
        assert cluster.wait_all(120) == [0, 0, 0], "\n".join(a.output()[-3000:] for a in cluster.agents)
    finally:
        last.stop()
    # One start per rank (no restart of the group), every step once, all at world 3.
    assert sorted(p.name for p in cluster.out.glob("w*.json")) == [f"w3_r0_rank{r}.json" for r in range(3)]
    rows = cluster.steps()
    assert {world for _, world, _, _ in rows} == {3}
    assert Counter((rank, step) for _, _, rank, step in rows) == Counter(
        {(rank, step): 1 for rank in range(3) for step in range(steps)}
    )
    for agent in cluster.agents:
        assert "restarting workers" not in agent.output()
        assert "re-established round 1" in agent.output()
        assert "all agents done after" in agent.output(), agent.output()[-3000:]


def test_store_killed_while_a_node_dies_restarts_once_at_the_smaller_size(
    cluster: Any, store: ServerProcess
) -> None:
    agents = [
        cluster.start(
            n,
            [*STORE_LOSS_ARGS, *STORE_LOSS_CONF],
            ["--until-world", "2", "--steps", "5", "--max-wait", "120"],
        )
        for n in ("a", "b", "c")
    ]
    cluster.wait_for("steps at world 3", lambda: len(cluster.steps()) >= 3 * 5, 90)
    store.kill()
    agents[2].kill_group(signal.SIGKILL)
    again = _restart_store(store)
    try:
        assert cluster.wait_all(120, agents[:2]) == [0, 0], "\n".join(a.output()[-3000:] for a in agents)
    finally:
        again.stop()
    worlds = sorted(p.name.split("_")[0] for p in cluster.out.glob("w*.json"))
    assert worlds == ["w2", "w2", "w3", "w3", "w3"], "expected one start at 3, then one at 2"
    for agent in agents[:2]:
        assert agent.output().count("restarting workers") == 1, agent.output()[-3000:]


def test_a_store_that_never_comes_back_fails_the_job_naming_it(cluster: Any, store: ServerProcess) -> None:
    agents = [
        cluster.start(
            n, [*STORE_LOSS_ARGS, "--rdzv-conf", "last_call_timeout=30,join_timeout=5"], ["--steps", "100000"]
        )
        for n in ("a", "b", "c")
    ]
    cluster.wait_for("steps at world 3", lambda: len(cluster.steps()) >= 3 * 5, 90)
    store.kill()
    codes = cluster.wait_all(90, agents)
    assert all(code != 0 for code in codes), codes
    # Each agent fails naming the store, whichever wait noticed first: an agent in its running
    # group says the store is unreachable; one whose workers failed meanwhile (a peer exited
    # first) re-joins and could not reach it within join_timeout.
    for agent in agents:
        out = agent.output()
        assert store.endpoint in out and re.search(r"unreachable|could not reach", out), out[-3000:]


def test_node_progress_reaches_the_rendezvous_store(cluster: Any, store: ServerProcess) -> None:
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--warm-start"]
    for name in ("a", "b"):
        cluster.start(name, common, ["--steps", "1000", "--step-time", "0.05", "--total", "1000"])
    client = control.connect(store.endpoint)

    def progressed() -> bool:
        status = control.read_status(client, cluster.run_id)
        return status.progress is not None and status.progress.step >= 5 and status.world_size == 4

    cluster.wait_for("job progress in the store", progressed, 60)
    status = control.read_status(client, cluster.run_id)
    assert set(status.members) == {"a", "b"}
    assert status.progress is not None and status.progress.total == 1000
    assert status.restarts == 0


def test_unreachable_store_fails_clearly_within_the_timeout(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    c = harness.Cluster(tmp_path, endpoint)
    try:
        agent = c.start("lonely", ["--nnodes", "2", "--rdzv-conf", "join_timeout=3"])
        rc = agent.wait(90)
        ended = time.time()
    finally:
        c.close()
    assert rc == 1
    out = agent.output()
    assert "could not run:" in out and endpoint in out
    # From the agent's first log line (start-up done, rendezvous begins) to its exit:
    # the join timeout plus a little, however long the interpreter took to start.
    first = re.search(r"^\[[IWE] (\d\d:\d\d:\d\d)\]", out, re.M)
    assert first is not None, out
    # The log line has the time of day only (local time, whole seconds): today's, or
    # yesterday's when the run crossed midnight.
    clock = datetime.datetime.strptime(first.group(1), "%H:%M:%S").time()
    today = datetime.datetime.fromtimestamp(ended).date()
    began = datetime.datetime.combine(today, clock).timestamp()
    if began > ended + 1:
        began -= 86400
    assert ended - began < 3 + 9, f"took {ended - began:.1f}s with join_timeout=3"
