"""End-to-end on GPUs: ElasticJobs whose pods request ``nvidia.com/gpu`` on ``kelastic local``.

The local kubelet reports the machine's GPUs as the node's ``nvidia.com/gpu`` and gives
each pod its own (``CUDA_VISIBLE_DEVICES``); the workers (tests/gpu/scripts/nccl_worker.py)
train over NCCL with ``nprocPerNode: gpu``. Both kelastic local lanes (the emulator, where
the kubelet places pods, and the real control plane, where kube-scheduler counts the
GPUs). Part of the ``gpu`` lane: skipped, saying what it needs, without CUDA and two GPUs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]

WORKER = "tests/gpu/scripts/nccl_worker.py"  # the local kubelet runs pods in the repository


def gpu_job(
    kel: Any,
    name: str,
    out: Path,
    *,
    min_replicas: int,
    worker_args: list[str],
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Two pods of one GPU each, one worker per GPU (``nprocPerNode: gpu``), warm starts."""
    if kel.lane == "real":
        pytest.skip("the GPU scenarios run the repository's worker script: kelastic local only")
    doc = kel.job_manifest(
        name,
        replicas=2,
        min_replicas=min_replicas,
        max_replicas=2,
        command=["python", WORKER],
        args=["--out", str(out), *worker_args],
        spec={"nprocPerNode": "gpu", "warmStart": True, **(spec or {})},
    )
    container = doc["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    return doc


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("w*_r*_rank*.json"))]


def test_gpu_pods_each_get_their_own_gpu_and_train_over_nccl(kel: Any, tmp_path: Path) -> None:
    kel.apply_job(gpu_job(kel, "e2e-gpu-a", tmp_path, min_replicas=2, worker_args=["--steps", "20"]))
    status = kel.wait_phase("e2e-gpu-a", {"Succeeded", "Failed"}, timeout=300)
    assert status["phase"] == "Succeeded", status
    seen = records(tmp_path)
    assert sorted(int(r["env"]["RANK"]) for r in seen) == [0, 1]
    assert {r["env"]["WORLD_SIZE"] for r in seen} == {"2"}
    assert len({r["device_uuid"] for r in seen}) == 2, "two pods shared a GPU"
    assert sorted(r["cuda_visible_devices"] for r in seen) == ["0", "1"]
    assert all(r["device_count"] == 1 and r["allreduce"] == 1.0 and not r["bad_fork"] for r in seen)


def test_a_force_deleted_gpu_pod_is_replaced_on_its_freed_gpu_and_the_job_completes(
    kel: Any, tmp_path: Path
) -> None:
    job = gpu_job(kel, "e2e-gpu-b", tmp_path, min_replicas=1, worker_args=["--steps", "400"])
    kel.apply_job(job)
    kel.wait_for("both ranks to train", lambda: len(records(tmp_path)) >= 2, 240)
    kel.kubectl.run("delete", "pod", "e2e-gpu-b-worker-1", "--grace-period=0", "--force")
    status = kel.wait_phase("e2e-gpu-b", {"Succeeded", "Failed"}, timeout=400)
    assert status["phase"] == "Succeeded", status
    seen = records(tmp_path)
    # The group formed again after the loss (at world 1, then 2 with the replacement, or
    # straight at 2), every time with one GPU per rank.
    assert len(seen) > 2, seen
    for r in seen:
        assert r["device_count"] == 1 and not r["bad_fork"]


def test_a_crashing_gpu_rank_restarts_the_group_on_the_same_gpus(kel: Any, tmp_path: Path) -> None:
    args = ["--steps", "10", "--crash-rank", "1", "--crash-times", "1", "--hold-fraction", "0.6"]
    kel.apply_job(gpu_job(kel, "e2e-gpu-c", tmp_path, min_replicas=2, worker_args=args))
    status = kel.wait_phase("e2e-gpu-c", {"Succeeded", "Failed"}, timeout=300)
    assert status["phase"] == "Succeeded", status
    again = [r for r in records(tmp_path) if r["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"]
    assert sorted(int(r["env"]["RANK"]) for r in again) == [0, 1], records(tmp_path)
    assert len({r["device_uuid"] for r in again}) == 2 and all(r["held_bytes"] > 0 for r in again)


def test_a_gpu_rank_stuck_outside_the_allreduce_is_restarted_by_hang_detection(
    kel: Any, tmp_path: Path
) -> None:
    args = ["--steps", "10", "--hang-rank", "1", "--hang-at", "5"]
    job = gpu_job(
        kel, "e2e-gpu-d", tmp_path, min_replicas=2, worker_args=args, spec={"hangTimeoutSeconds": 10}
    )
    kel.apply_job(job)
    status = kel.wait_phase("e2e-gpu-d", {"Succeeded", "Failed"}, timeout=400)
    assert status["phase"] == "Succeeded", status
    assert sorted(p.name for p in tmp_path.glob("done_*")) == ["done_r1_rank0", "done_r1_rank1"]
