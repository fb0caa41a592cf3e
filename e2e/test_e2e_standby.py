"""End-to-end: a hot standby takes a lost worker's place, and the job's status shows its goodput.

A job of two workers and one standby (``spec.standbyReplicas: 1``): the status and
``kubectl get ej`` show the standby; a worker pod force-deleted is replaced by the
standby in one re-form at the same world size (the training history of
examples/train.py counts the group's starts), the deleted pod's replacement waits as
the new standby, and the job ends with every pod succeeded, the standby too. The
status carries the goodput the operator computed from the agents' records.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.slow

NAME = "e2e-standby"


def starts(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in history if e["event"] == "start"]


def live_workers(kel: Any) -> list[dict[str, Any]]:
    return [p for p in kel.pods(NAME, role="worker") if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def is_standby(kel: Any, pod: dict[str, Any]) -> bool:
    """Whether the pod's agent waits as a standby (it says so when it parks)."""
    logs = kel.kubectl.run("logs", pod["metadata"]["name"], check=False).stdout
    return STANDBY_SAYS in logs and " is rank " not in logs


#: What an agent that parks as a standby prints (kelastic.agent.rendezvous.join).
STANDBY_SAYS = "is a standby"


@pytest.mark.lanes("emulator")
def test_standby_replaces_a_deleted_worker_in_one_reform_and_goodput_is_in_the_status(kel: Any) -> None:
    manifest = kel.job_manifest(
        NAME, replicas=2, min_replicas=2, max_replicas=3, steps=400, step_delay=0.1, checkpoint_every=10
    )
    manifest["spec"]["standbyReplicas"] = 1
    uid = kel.apply_job(manifest)["metadata"]["uid"]
    kel.wait_history(
        uid, f"a checkpoint at step >= 20 in elasticjob/{NAME}", lambda h: any(
            e["event"] == "checkpoint" and e["step"] >= 20 for e in h
        )
    )  # fmt: skip

    def one_standby() -> bool:
        status = kel.status(NAME)
        # The goodput's accounting must have begun before the fault for the restart to count
        # in it: the operator reads the agents' records every few seconds, later under load.
        if status.get("standbys") != 1 or status.get("worldSize") != 2 or not status.get("goodput"):
            raise kel.LastSeen({k: status.get(k) for k in ("phase", "worldSize", "standbys", "goodput")})
        return True

    kel.wait_for(
        f"elasticjob/{NAME} to show one standby beside a world of 2, and its goodput", one_standby, 120
    )
    table = kel.kubectl.run(
        "get", "ej", NAME, "-o", "custom-columns=S:.status.standbys,G:.status.goodput.percent"
    )
    assert table.stdout.split()[2] == "1", table.stdout
    printed = kel.kubectl.run("get", "ej", NAME).stdout.splitlines()
    assert "STANDBY" in printed[0] and "GOODPUT" in printed[0], printed
    assert len(live_workers(kel)) == 3
    assert len(starts(kel.history(uid))) == 1

    # The standby holds no rank and runs no workers; its agent said so. Every pod is ready (a
    # standby is in the job too).
    def two_ready_members() -> list[dict[str, Any]]:
        pods = live_workers(kel)
        members = [p for p in pods if ready(p) and not is_standby(kel, p)]
        if len(members) != 2 or not all(map(ready, pods)):
            raise kel.LastSeen([(p["metadata"]["name"], ready(p), is_standby(kel, p)) for p in pods])
        return members

    members = kel.wait_for(
        f"two members of elasticjob/{NAME} and its standby to be ready", two_ready_members, 60
    )
    victim = members[-1]["metadata"]["name"]
    deleted = time.time()
    kel.kubectl.run("delete", "pod", victim, "--grace-period=0", "--force")

    def restarted_once(history: list[dict[str, Any]]) -> bool:
        return any(e["event"] == "first_step" and e["time"] > deleted for e in history)

    kel.wait_history(uid, f"elasticjob/{NAME} to train again after {victim} was deleted", restarted_once, 120)
    first = min(e["time"] for e in kel.history(uid) if e["event"] == "first_step" and e["time"] > deleted)

    def standby_again() -> bool:
        status = kel.status(NAME)
        if status.get("standbys") != 1 or len(live_workers(kel)) != 3:
            raise kel.LastSeen({k: status.get(k) for k in ("phase", "worldSize", "standbys")})
        return True

    kel.wait_for(f"{victim}'s replacement to wait as the new standby", standby_again, 120)
    status = kel.wait_phase(NAME, {"Succeeded", "Failed"}, timeout=400)
    assert status["phase"] == "Succeeded", status
    history = kel.history(uid)
    # One re-form, at the same size: no shrink to 1 and grow back to 2.
    assert [s["world_size"] for s in starts(history)] == [2, 2], starts(history)
    assert {e["world_size"] for e in history if e["event"] == "first_step"} == {2}
    assert history[-1] == {**history[-1], "event": "done", "step": 400}
    goodput = status.get("goodput") or {}
    assert goodput.get("restarts", 0) >= 1 and 0 < goodput.get("ratio", 0) <= 1, goodput
    assert goodput["percent"].endswith("%") and goodput["keptSteps"] > 0, goodput
    print(
        f"[{kel.lane}] standby: first step {first - deleted:.1f}s after the force-delete; "
        f"goodput {goodput['percent']} ({goodput['restarts']} restart(s), {goodput['restartSeconds']}s, "
        f"{goodput['redoneSteps']} steps redone)"
    )


@pytest.mark.lanes("emulator")
def test_a_job_with_a_standby_that_succeeds_has_no_warning_event(kel: Any) -> None:
    """Readiness as a user reads it: the members and the standby are ready, the pods all
    succeed, and nothing about the job is a Warning (``kubectl get events --field-selector
    type=Warning``): no probe fails while an agent starts, waits as a standby or finishes."""
    name = "e2e-standby-quiet"
    manifest = kel.job_manifest(
        name, replicas=2, min_replicas=2, max_replicas=3, steps=200, step_delay=0.1, checkpoint_every=50
    )
    manifest["spec"]["standbyReplicas"] = 1
    kel.apply_job(manifest)

    def all_ready_with_a_standby() -> bool:
        pods = [p for p in kel.pods(name, role="worker") if not p["metadata"].get("deletionTimestamp")]
        standbys = kel.status(name).get("standbys")
        if len(pods) != 3 or standbys != 1 or not all(map(ready, pods)):
            raise kel.LastSeen(
                {"standbys": standbys, "ready": [(p["metadata"]["name"], ready(p)) for p in pods]}
            )
        return True

    kel.wait_for(
        f"elasticjob/{name}'s two members and its standby to be ready", all_ready_with_a_standby, 120
    )
    status = kel.wait_phase(name, {"Succeeded", "Failed"}, timeout=300)
    assert status["phase"] == "Succeeded", status
    phases = {p["metadata"]["name"]: p["status"].get("phase") for p in kel.pods(name, role="worker")}
    assert set(phases.values()) == {"Succeeded"}, phases
    warnings = [
        f"{(e.get('involvedObject') or {}).get('name')}: {e.get('reason')} {e.get('message')}"
        for e in kel.kubectl.json("get", "events", "--field-selector", "type=Warning")["items"]
        if (e.get("involvedObject") or {}).get("name", "").startswith(name)
    ]
    assert not warnings, warnings
