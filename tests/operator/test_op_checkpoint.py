"""spec.checkpoint: parsed and validated, turned into agent flags and the pod's /dev/shm, and the
agents' checkpoint reports turned into status.checkpoint and one CheckpointRestored Event per restore."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent import contract
from kelastic.operator import checkpoint
from kelastic.operator.builders import BuildConfig, agent_command, worker_pod
from kelastic.operator.checkpoint import CheckpointReport, Restore, Source, checkpoint_status
from kelastic.operator.observed import RendezvousView
from kelastic.operator.reconcile import Decision, Emit, reconcile
from kelastic.operator.spec import CheckpointPersist, CheckpointSpec, Job, parse_job, parse_quantity

CFG = BuildConfig()
GI = 1024**3


def with_template(body: dict[str, Any], **pod: Any) -> dict[str, Any]:
    """``body`` with the worker container's fields (``volumeMounts``, ``resources``) and the pod's
    ``volumes`` set."""
    tmpl = body["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
    if "volumes" in pod:
        tmpl["volumes"] = pod.pop("volumes")
    tmpl["containers"][0].update(pod)
    return body


PVC_POD: dict[str, Any] = {
    "volumes": [
        {"name": "ckpt", "persistentVolumeClaim": {"claimName": "train-ckpt"}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}},
    ],
    "volumeMounts": [
        {"name": "ckpt", "mountPath": "/ckpt"},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "data", "mountPath": "/data", "readOnly": True},
    ],
    "resources": {"limits": {"memory": "16Gi"}},
}


def job(kit: SimpleNamespace, checkpoint_spec: Any = None, **pod: Any) -> Job:
    extra = {} if checkpoint_spec is None else {"checkpoint": checkpoint_spec}
    return parse_job(with_template(kit.job_body(**extra), **json.loads(json.dumps(pod))))


# --------------------------------------------------------------------------- the spec


def test_a_job_without_spec_checkpoint_gets_the_defaults(kit: SimpleNamespace) -> None:
    spec = job(kit).spec
    assert spec is not None and spec.checkpoint == CheckpointSpec(replicas=1, memory_limit=None, persist=None)
    assert job(kit, {}).spec == spec  # the API server's default ({}) parses the same


def test_a_full_checkpoint_spec(kit: SimpleNamespace) -> None:
    ckpt = {"replicas": 2, "memoryLimit": "6Gi", "persist": {"path": "/ckpt/run-1/", "every": 10}}
    spec = job(kit, ckpt, **PVC_POD).spec
    assert spec is not None
    assert spec.checkpoint == CheckpointSpec(
        replicas=2,
        memory_limit=6 * GI,
        persist=CheckpointPersist("/ckpt/run-1", every=10, interval_seconds=None),
    )
    interval = job(kit, {"persist": {"path": "/ckpt", "intervalSeconds": 300}}, **PVC_POD).spec
    assert interval is not None and interval.checkpoint.persist == CheckpointPersist("/ckpt", None, 300)
    # Neither every nor intervalSeconds: every checkpoint is persisted.
    every = job(kit, {"persist": {"path": "/ckpt"}}, **PVC_POD).spec
    assert every is not None and every.checkpoint.persist == CheckpointPersist("/ckpt", 1, None)
    # A memoryLimit in bytes, and without a container memory limit to compare with.
    plain = job(kit, {"memoryLimit": 512 * 1024**2}).spec
    assert plain is not None and plain.checkpoint.memory_limit == 512 * 1024**2


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("4Gi", 4 * GI),
        ("1.5G", 1_500_000_000),
        ("4e9", 4_000_000_000),
        ("1.1Gi", 1_181_116_007),
        (1024, 1024),
    ],
)
def test_quantities_are_read_as_kubernetes_reads_them(value: Any, size: int) -> None:
    assert parse_quantity(value) == size  # rounded up, exactly (1.1Gi is not a float's 1181116006)


@pytest.mark.parametrize(
    ("ckpt", "field", "hint"),
    [
        ("on", "spec.checkpoint", "must be an object"),
        ({"replicas": -1}, "spec.checkpoint.replicas", "at least 0"),
        ({"replicas": 4}, "spec.checkpoint.replicas", "at most 3"),
        ({"replicas": "2"}, "spec.checkpoint.replicas", "must be an integer"),
        ({"memoryLimit": "4GB"}, "spec.checkpoint.memoryLimit", "quantity of bytes"),
        ({"memoryLimit": "-1Gi"}, "spec.checkpoint.memoryLimit", "quantity of bytes"),
        ({"memoryLimit": "500m"}, "spec.checkpoint.memoryLimit", "quantity of bytes"),
        ({"memoryLimit": 0}, "spec.checkpoint.memoryLimit", "positive"),
        (
            {"memoryLimit": "16Gi"},
            "spec.checkpoint.memoryLimit",
            "less than the worker container's memory limit",
        ),
        ({"persist": {}}, "spec.checkpoint.persist.path", "is required"),
        ({"persist": "/ckpt"}, "spec.checkpoint.persist", "must be an object"),
        ({"persist": {"path": "ckpt"}}, "spec.checkpoint.persist.path", "absolute path"),
        ({"persist": {"path": "/ckpt/../etc"}}, "spec.checkpoint.persist.path", "without . or .."),
        ({"persist": {"path": "/checkpoints"}}, "spec.checkpoint.persist.path", "not under a volumeMount"),
        (
            {"persist": {"path": "/ckptx"}},
            "spec.checkpoint.persist.path",
            "its mounts: /ckpt, /scratch, /data",
        ),
        (
            {"persist": {"path": "/scratch/c"}},
            "spec.checkpoint.persist.path",
            "an emptyDir, which is deleted",
        ),
        ({"persist": {"path": "/data/c"}}, "spec.checkpoint.persist.path", "readOnly"),
        ({"persist": {"path": "/ckpt", "every": 0}}, "spec.checkpoint.persist.every", "at least 1"),
        (
            {"persist": {"path": "/ckpt", "intervalSeconds": 0}},
            "spec.checkpoint.persist.intervalSeconds",
            "least 1",
        ),
    ],
)
def test_invalid_checkpoint_specs_name_the_field(
    kit: SimpleNamespace, ckpt: Any, field: str, hint: str
) -> None:
    parsed = job(kit, ckpt, **PVC_POD)
    assert parsed.spec is None and parsed.error is not None
    assert parsed.error.field == field, parsed.error
    assert hint in parsed.error.message, parsed.error


def test_an_invalid_checkpoint_spec_fails_the_job_with_an_event(kit: SimpleNamespace) -> None:
    body = with_template(kit.job_body(checkpoint={"persist": {"path": "/nowhere"}}))
    d = reconcile(parse_job(body), kit.observed())
    assert d.status["phase"] == "Failed"
    (invalid,) = [c for c in d.status["conditions"] if c["type"] == "Invalid"]
    assert invalid["status"] == "True" and "spec.checkpoint.persist.path" in invalid["message"]
    assert any(
        isinstance(a, Emit)
        and a.warning
        and "spec.checkpoint.persist.path: /nowhere is not under" in a.message
        for a in d.actions
    )


# --------------------------------------------------------------------------- the pod


def flags_after(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_a_default_job_passes_only_the_checkpoint_folder(kit: SimpleNamespace) -> None:
    """The agent's defaults are the spec's; only the folder is named, under the pod's own
    /dev/shm mount, so a kubelet that relocates mount paths (kelastic local) keeps each pod's
    checkpoint memory private to it."""
    spec = job(kit).spec
    assert spec is not None
    cmd = agent_command(spec, run_id="u", endpoint="h:1", config=CFG)
    assert [a for a in cmd if a.startswith("--checkpoint")] == [contract.FLAG_CHECKPOINT_DIR]
    assert flags_after(cmd, contract.FLAG_CHECKPOINT_DIR) == "/dev/shm/kelastic-checkpoints"


def test_the_checkpoint_spec_becomes_the_agents_flags(kit: SimpleNamespace) -> None:
    ckpt = {
        "replicas": 2,
        "memoryLimit": "6Gi",
        "persist": {"path": "/ckpt/run", "every": 5, "intervalSeconds": 600},
    }
    spec = job(kit, ckpt, **PVC_POD).spec
    assert spec is not None
    cmd = agent_command(spec, run_id="u", endpoint="h:1", config=CFG)
    assert flags_after(cmd, contract.FLAG_CHECKPOINT_REPLICAS) == "2"
    assert flags_after(cmd, contract.FLAG_CHECKPOINT_MEMORY) == str(6 * GI)  # bytes: any parser reads them
    assert flags_after(cmd, contract.FLAG_CHECKPOINT_PERSIST_DIR) == "/ckpt/run"
    assert flags_after(cmd, contract.FLAG_CHECKPOINT_PERSIST_EVERY) == "5"
    assert flags_after(cmd, contract.FLAG_CHECKPOINT_PERSIST_INTERVAL) == "600"
    assert cmd[-3:] == ["train.py", "--lr", "0.1"]
    # Flags before the training command, where the agent reads them.
    assert cmd.index(contract.FLAG_CHECKPOINT_REPLICAS) < cmd.index("train.py")
    # replicas 0 is a value the agent must be told.
    zero = job(kit, {"replicas": 0}).spec
    assert zero is not None
    assert (
        flags_after(agent_command(zero, run_id="u", endpoint="h:1", config=CFG), "--checkpoint-replicas")
        == "0"
    )


def shm(pod: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the worker container's mounts at /dev/shm."""
    main = pod["spec"]["containers"][0]
    mounts = [m for m in main.get("volumeMounts") or [] if m["mountPath"].rstrip("/") == "/dev/shm"]
    names = {m["name"] for m in mounts}
    return [v for v in pod["spec"].get("volumes") or [] if v["name"] in names], mounts


def test_every_worker_pod_gets_a_memory_backed_dev_shm(kit: SimpleNamespace) -> None:
    pod = worker_pod(job(kit), 0, endpoint="h:1", config=CFG)
    volumes, mounts = shm(pod)
    # No memoryLimit: no sizeLimit; the agent's auto limit (from the container's) bounds the checkpoint.
    assert volumes == [{"name": "kelastic-shm", "emptyDir": {"medium": "Memory"}}]
    assert mounts == [{"name": "kelastic-shm", "mountPath": "/dev/shm"}]
    sized = worker_pod(job(kit, {"memoryLimit": "6Gi"}, **PVC_POD), 0, endpoint="h:1", config=CFG)
    volumes, _ = shm(sized)
    assert volumes == [{"name": "kelastic-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "7Gi"}}]
    # The template's own volumes and mounts stay, ours come last; the side containers get none.
    names = [v["name"] for v in sized["spec"]["volumes"]]
    assert names[:3] == ["ckpt", "scratch", "data"] and names[-2:] == ["kelastic-shm", "kelastic-job-secret"]
    # Building from a template that already holds our volume does not duplicate it.
    again = parse_job(
        with_template(
            kit.job_body(),
            volumes=pod["spec"]["volumes"],
            volumeMounts=pod["spec"]["containers"][0]["volumeMounts"],
        )
    )
    twice = worker_pod(again, 0, endpoint="h:1", config=CFG)
    assert [v["name"] for v in twice["spec"]["volumes"]].count("kelastic-shm") == 1
    assert [m["name"] for m in twice["spec"]["containers"][0]["volumeMounts"]].count("kelastic-shm") == 1


def test_a_template_that_mounts_dev_shm_keeps_its_own(kit: SimpleNamespace) -> None:
    theirs = {
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm/"}],
    }
    pod = worker_pod(job(kit, {"memoryLimit": "8Gi"}, **theirs), 0, endpoint="h:1", config=CFG)
    volumes, mounts = shm(pod)
    assert volumes == theirs["volumes"] and mounts == theirs["volumeMounts"]
    assert "kelastic-shm" not in json.dumps(pod)


# --------------------------------------------------------------------------- the status


def rep(
    node: str, latest: int | None = 7, step: int | None = 70, restored: Restore | None = None
) -> CheckpointReport:
    return CheckpointReport(node, latest, step, restored)


T = 1_700_000_000.0


def test_records_are_read_tolerantly() -> None:
    full = {
        "latest": 12,
        "step": 340,
        "restored": {"id": 11, "source": "replica", "seconds": 0.4, "time": T},
        "bytes": 1 << 30,
        "limit": 4 << 30,
        "future": "ignored",
    }
    assert checkpoint.report("a", full) == CheckpointReport("a", 12, 340, Restore(11, Source.REPLICA, 0.4, T))
    assert checkpoint.report("a", {}) == CheckpointReport("a")
    assert checkpoint.report("a", {"latest": None, "step": None, "restored": None}) == CheckpointReport("a")
    # Malformed values read as not reported, never as an error.
    odd = {"latest": "12", "step": -1, "restored": {"id": 3, "source": "tape", "seconds": 1, "time": T}}
    assert checkpoint.report("a", odd) == CheckpointReport("a")
    assert checkpoint.report("a", {"restored": {"id": 3, "source": "memory"}}) == CheckpointReport("a")


def test_no_record_leaves_the_status_alone() -> None:
    assert checkpoint_status({"latest": 3}, []) == (None, None)
    assert checkpoint_status(None, []) == (None, None)


def test_latest_is_the_newest_checkpoint_any_member_knows() -> None:
    status, event = checkpoint_status(None, [rep("a", 7, 70), rep("b", 8, 80), rep("c", None, None)])
    assert status == {"latest": 8, "step": 80} and event is None
    # A node that knows no step for it: the step is not made up.
    status, _ = checkpoint_status(status, [rep("a", 9, None)])
    assert status == {"latest": 9}


def test_a_restore_is_one_event_marked_in_the_status() -> None:
    restored = [
        rep("a", 12, 340, Restore(12, Source.MEMORY, 0.2, T)),
        rep("b", 12, 340, Restore(12, Source.REPLICA, 0.4, T + 0.3)),
    ]
    status, event = checkpoint_status({"latest": 12, "step": 340}, restored)
    assert (
        event
        == "restored checkpoint 12 (step 340) on 2 pods: 1 from memory, 1 from a peer's replica, in 0.4 s"
    )
    assert status == {
        "latest": 12,
        "step": 340,
        "restoredId": 12,
        "restoredFrom": "replica",
        "restoredSeconds": 0.4,
        "restoredTime": "2023-11-14T22:13:20.300Z",
    }
    # The agents keep reporting that restore: an operator that restarts reads the mark, no second Event.
    assert checkpoint_status(status, restored) == (status, None)
    # A slower pod of the same restore reports later: the figures follow it, still no Event.
    late = [*restored, rep("c", 12, 340, Restore(12, Source.DURABLE, 3.1, T + 2.5))]
    folded, event = checkpoint_status(status, late)
    assert event is None
    assert (folded or {})["restoredFrom"] == "durable" and (folded or {})["restoredSeconds"] == 3.1
    assert (folded or {})["restoredTime"] == status["restoredTime"]
    # The next fault restores again (the same checkpoint, a minute later): a new Event.
    again = [rep("a", 12, 340, Restore(12, Source.REPLICA, 0.5, T + 60))]
    later, event = checkpoint_status(folded, again)
    assert event == "restored checkpoint 12 (step 340) from a peer's replica in 0.5 s"
    assert (later or {})["restoredFrom"] == "replica" and (later or {})["restoredSeconds"] == 0.5


def test_a_restore_of_another_checkpoint_soon_after_is_its_own_event() -> None:
    first, _ = checkpoint_status(None, [rep("a", 4, None, Restore(4, Source.MEMORY, 0.1, T))])
    second, event = checkpoint_status(first, [rep("a", 5, None, Restore(5, Source.MEMORY, 0.1, T + 2))])
    assert event == "restored checkpoint 5 from memory in 0.1 s"
    assert (second or {})["restoredId"] == 5
    # An older restore (a pod that has not restored since) never comes back as news.
    assert checkpoint_status(second, [rep("b", 5, None, Restore(3, Source.DURABLE, 9.0, T - 100))])[1] is None


def running_job(kit: SimpleNamespace, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return kit.job_body(status={"phase": "Running", "scaledTo": 3, **(status or {})})


def pass_with(kit: SimpleNamespace, body: dict[str, Any], view: RendezvousView) -> Decision:
    pods = (kit.store(), *(kit.worker(i) for i in range(3)))
    return reconcile(parse_job(body), kit.observed(*pods, rendezvous=view))


def test_reconcile_shows_the_checkpoint_and_posts_the_restore_once(kit: SimpleNamespace) -> None:
    view = RendezvousView(
        world_size=3,
        restarts=1,
        members=("a", "b"),
        checkpoints=(rep("a", 12, 340, Restore(12, Source.REPLICA, 0.4, T)), rep("b", 12, 340)),
    )
    d = pass_with(kit, running_job(kit), view)
    assert d.status["checkpoint"]["latest"] == 12 and d.status["checkpoint"]["restoredFrom"] == "replica"
    (event,) = [a for a in d.actions if isinstance(a, Emit) and a.reason == "CheckpointRestored"]
    assert (
        event.message == "restored checkpoint 12 (step 340) from a peer's replica in 0.4 s"
        and not event.warning
    )
    # The next pass (or a new operator) starts from the status written: no second Event.
    again = pass_with(kit, running_job(kit, d.status), view)
    assert not [a for a in again.actions if isinstance(a, Emit) and a.reason == "CheckpointRestored"]
    assert again.status["checkpoint"] == d.status["checkpoint"]
    # Agents without checkpoint records (older ones), or the store unreachable: the status stays.
    older = RendezvousView(world_size=3, restarts=1, members=("a", "b"))
    assert pass_with(kit, running_job(kit, d.status), older).status["checkpoint"] == d.status["checkpoint"]
