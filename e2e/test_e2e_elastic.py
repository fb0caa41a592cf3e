"""End-to-end: elasticity and failure recovery while a job trains.

Scenarios (b), (c), (f), (g), (i) and (j) of the operator issue: a worker pod
force-deleted, scaling up and down, the operator killed and restarted, the
rendezvous store pod killed (no restart of the group), suspend and resume, the
store pod deleted while the operator is down. The training history that
examples/train.py keeps next to its checkpoint says what really happened.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.slow

Events = list[dict[str, Any]]


def checkpoint_at_least(step: int) -> Callable[[Events], bool]:
    return lambda history: any(e["event"] == "checkpoint" and e["step"] >= step for e in history)


def assert_resumed_from_checkpoints(history: Events, checkpoint_every: int) -> None:
    """Every restart resumed at (or after) the last checkpoint recorded before it, on a checkpoint boundary."""
    last_checkpoint = 0
    for event in history:
        if event["event"] == "checkpoint":
            last_checkpoint = max(last_checkpoint, event["step"])
        elif event["event"] == "start":
            assert event["step"] >= last_checkpoint, (
                f"a restart lost checkpointed steps: {event} after {last_checkpoint}"
            )
            assert event["step"] % checkpoint_every == 0, (
                f"a restart did not resume from a checkpoint: {event}"
            )


def starts(history: Events) -> Events:
    return [e for e in history if e["event"] == "start"]


def pod_uid(kel: Any, name: str) -> str | None:
    result = kel.kubectl.run("get", "pod", name, "-o", "jsonpath={.metadata.uid}", check=False)
    return result.stdout.strip() or None if result.returncode == 0 else None


@pytest.mark.lanes("emulator")
def test_b_force_deleted_worker_recovers_without_losing_checkpointed_steps(kel: Any) -> None:
    job = kel.apply_job(kel.job_manifest("e2e-b", steps=150, step_delay=0.1, checkpoint_every=10))
    uid = job["metadata"]["uid"]
    kel.wait_history(uid, "a checkpoint at step >= 20 in elasticjob/e2e-b", checkpoint_at_least(20))
    victim = "e2e-b-worker-1"
    old = pod_uid(kel, victim)
    assert old, f"{victim} should be running"
    kel.kubectl.run("delete", "pod", victim, "--grace-period=0", "--force")

    status = kel.wait_phase("e2e-b", {"Succeeded", "Failed"}, timeout=300)
    assert status["phase"] == "Succeeded", status
    history = kel.history(uid)
    assert len(starts(history)) >= 2, f"the group should have re-formed after losing {victim}: {history}"
    assert_resumed_from_checkpoints(history, 10)
    assert history[-1] == {**history[-1], "event": "done", "step": 150}


@pytest.mark.lanes("control-plane")
def test_c_scale_up_then_down_world_follows_and_training_continues(kel: Any) -> None:
    job = kel.apply_job(
        kel.job_manifest("e2e-c", replicas=2, steps=5000, step_delay=0.05, checkpoint_every=10)
    )
    uid = job["metadata"]["uid"]

    def trains_at(world: int, after: float) -> Any:
        def probe(history: Events) -> bool:
            return any(
                e["event"] == "first_step" and e["world_size"] == world and e["time"] >= after
                for e in history
            )

        return probe

    def world_is(world: int) -> Any:
        def probe() -> bool:
            status = kel.status("e2e-c")
            if status.get("worldSize") != world:
                raise kel.LastSeen({k: status.get(k) for k in ("phase", "worldSize", "progress")})
            return True

        return probe

    kel.wait_history(uid, "elasticjob/e2e-c to train at world size 2", trains_at(2, 0))
    for replicas in (3, 2):
        since = time.time()
        kel.kubectl.run("scale", "elasticjob", "e2e-c", f"--replicas={replicas}")
        kel.wait_for(f"status.worldSize of elasticjob/e2e-c to become {replicas}", world_is(replicas), 180)
        kel.wait_history(
            uid, f"elasticjob/e2e-c to train at world size {replicas}", trains_at(replicas, since), 180
        )
        kel.wait_for(
            f"{replicas} worker pods of elasticjob/e2e-c",
            lambda n=replicas: (
                len(
                    [
                        p
                        for p in kel.pods("e2e-c", role="worker")
                        if not p["metadata"].get("deletionTimestamp")
                    ]
                )
                == n
            ),
            120,
        )
    # Scale-down removed the highest index.
    names = sorted(
        p["metadata"]["name"]
        for p in kel.pods("e2e-c", role="worker")
        if not p["metadata"].get("deletionTimestamp")
    )
    assert names == ["e2e-c-worker-0", "e2e-c-worker-1"], names
    # And training goes on at the smaller world.
    reached = max(e["step"] for e in kel.history(uid) if e["event"] == "checkpoint")
    kel.wait_history(
        uid, "elasticjob/e2e-c to keep checkpointing after scaling down", checkpoint_at_least(reached + 20)
    )
    assert_resumed_from_checkpoints(kel.history(uid), 10)
    assert kel.status("e2e-c")["phase"] in ("Running", "Scaling")


def stall(history: Events, fault: float) -> str:
    """The longest gap between checkpoints after ``fault``, next to the usual gap before it (printed)."""
    times = [e["time"] for e in history if e["event"] == "checkpoint"]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    after = [b - a for a, b in itertools.pairwise(t for t in times if t >= fault - 1)]
    usual = gaps[len(gaps) // 2] if gaps else 0.0  # the median: one stall does not move it
    return f"longest gap between checkpoints {max(after, default=0.0):.2f}s (median {usual:.2f}s)"


@pytest.mark.lanes("control-plane")
def test_f_operator_killed_and_restarted_mid_run_adopts_the_job(kel: Any) -> None:
    job = kel.apply_job(kel.job_manifest("e2e-f", steps=150, step_delay=0.1, checkpoint_every=10))
    uid = job["metadata"]["uid"]
    kel.wait_history(uid, "training to start in elasticjob/e2e-f", checkpoint_at_least(10))
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kel.pods("e2e-f")}
    assert len(before) == 4, f"3 workers and the rendezvous store: {sorted(before)}"

    killed = time.time()
    kel.kill_operator()
    # Training does not need the operator: the agents keep going.
    reached = max(e["step"] for e in kel.history(uid) if e["event"] == "checkpoint")
    kel.wait_history(
        uid, "training to go on while the operator is down", checkpoint_at_least(reached + 10), 120
    )
    kel.start_operator()

    seen: dict[str, str] = {}

    def finished() -> dict[str, Any] | None:
        for pod in kel.pods("e2e-f"):
            seen[pod["metadata"]["name"]] = pod["metadata"]["uid"]
        status = kel.status("e2e-f")
        if status.get("phase") in ("Succeeded", "Failed"):
            return status
        raise kel.LastSeen({k: status.get(k) for k in ("phase", "worldSize", "progress")})

    status = kel.wait_for("elasticjob/e2e-f to finish after the operator restart", finished, 300, interval=1)
    assert status["phase"] == "Succeeded", status
    # The restarted operator adopted the pods it found: nothing recreated, nothing duplicated.
    recreated = {n: (before.get(n), u) for n, u in seen.items() if before.get(n) != u}
    assert not recreated, f"pods were created or recreated after the operator restart: {recreated}"
    assert starts(kel.history(uid))[1:] == [], "the training group should not have restarted"
    print(f"[{kel.lane}] operator killed: {stall(kel.history(uid), killed)}")


@pytest.mark.lanes("emulator")
def test_g_rendezvous_store_pod_killed_costs_no_restart(kel: Any) -> None:
    job = kel.apply_job(kel.job_manifest("e2e-g", steps=300, step_delay=0.05, checkpoint_every=5))
    uid = job["metadata"]["uid"]
    kel.wait_history(uid, "a checkpoint at step >= 20 in elasticjob/e2e-g", checkpoint_at_least(20))
    store = "e2e-g-rendezvous"
    old = pod_uid(kel, store)
    assert old, f"{store} should be running"
    deleted = time.time()
    kel.kubectl.run("delete", "pod", store, "--grace-period=0", "--force")
    kel.wait_for(
        f"the operator to recreate {store}",
        lambda: (pod_uid(kel, store) or old) != old or kel.status("e2e-g").get("phase") == "Succeeded",
        120,
    )
    status = kel.wait_phase("e2e-g", {"Succeeded", "Failed"}, timeout=300)
    assert status["phase"] == "Succeeded", status
    history = kel.history(uid)
    # The workers' collectives never use the store: the group went on, no step lost or repeated.
    assert starts(history)[1:] == [], "the training group restarted when the store pod was deleted"
    assert history[-1] == {**history[-1], "event": "done", "step": 300}
    print(f"[{kel.lane}] store pod force-deleted: {stall(history, deleted)}")


@pytest.mark.lanes("emulator")
def test_j_operator_down_and_store_pod_deleted_costs_no_step(kel: Any) -> None:
    """Without the operator nobody recreates the store pod: the group trains on without any
    store, and re-establishes its round in the new store once the operator is back."""
    job = kel.apply_job(kel.job_manifest("e2e-j", steps=500, step_delay=0.05, checkpoint_every=5))
    uid = job["metadata"]["uid"]
    kel.wait_history(uid, "a checkpoint at step >= 20 in elasticjob/e2e-j", checkpoint_at_least(20))
    kel.wait_for("worldSize 3 in the status", lambda: kel.status("e2e-j").get("worldSize") == 3, 60)
    store = "e2e-j-rendezvous"
    old = pod_uid(kel, store)
    assert old, f"{store} should be running"
    kel.kill_operator()
    deleted = time.time()
    kel.kubectl.run("delete", "pod", store, "--grace-period=0", "--force")
    reached = max(e["step"] for e in kel.history(uid) if e["event"] == "checkpoint")
    kel.wait_history(
        uid, "training to go on with neither operator nor store", checkpoint_at_least(reached + 40), 120
    )
    kel.start_operator()
    kel.wait_for(f"the operator to recreate {store}", lambda: (pod_uid(kel, store) or old) != old, 120)

    def reformed() -> bool:
        # The status is read from the new store: the members re-established their round there.
        status = kel.status("e2e-j")
        text = str(status.get("progress") or "step 0")  # "120/500 (24%)"
        step = int(text.split("/")[0].split()[-1])
        return status.get("phase") == "Succeeded" or (status.get("worldSize") == 3 and step > reached + 40)

    kel.wait_for("the round to be re-established in the new store", reformed, 120)
    status = kel.wait_phase("e2e-j", {"Succeeded", "Failed"}, timeout=300)
    assert status["phase"] == "Succeeded", status
    history = kel.history(uid)
    assert starts(history)[1:] == [], "the training group restarted"
    assert history[-1] == {**history[-1], "event": "done", "step": 500}
    print(f"[{kel.lane}] operator down and store pod deleted: {stall(history, deleted)}")


@pytest.mark.lanes("emulator")
def test_i_suspend_then_resume(kel: Any) -> None:
    job = kel.apply_job(kel.job_manifest("e2e-i", steps=150, step_delay=0.1, checkpoint_every=10))
    uid = job["metadata"]["uid"]
    kel.wait_history(uid, "a checkpoint at step >= 20 in elasticjob/e2e-i", checkpoint_at_least(20))

    kel.kubectl.run(
        "patch", "elasticjob", "e2e-i", "--type=merge", "-p", json.dumps({"spec": {"suspend": True}})
    )
    kel.wait_phase("e2e-i", "Suspended", timeout=120)
    kel.wait_for(
        "the workers of suspended elasticjob/e2e-i to be deleted",
        lambda: kel.pods("e2e-i", role="worker") == [],
        90,
    )
    suspended_at = kel.history(uid)
    assert suspended_at[-1]["event"] != "done", "the job finished before it could be suspended"
    time.sleep(2)
    assert kel.history(uid) == suspended_at, "training went on while the job was suspended"

    kel.kubectl.run(
        "patch", "elasticjob", "e2e-i", "--type=merge", "-p", json.dumps({"spec": {"suspend": False}})
    )
    status = kel.wait_phase("e2e-i", {"Succeeded", "Failed"}, timeout=300)
    assert status["phase"] == "Succeeded", status
    history = kel.history(uid)
    resumed = starts(history[len(suspended_at) :])
    assert resumed and resumed[0]["step"] > 0, f"the resumed job should start from its checkpoint: {resumed}"
    assert_resumed_from_checkpoints(history, 10)
