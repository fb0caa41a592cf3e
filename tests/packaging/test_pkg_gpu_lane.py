"""The ``gpu`` lane is collected everywhere and, without the GPUs a test needs, skipped saying so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kelastic.agent.devices import cuda_device_count

REPO = Path(__file__).resolve().parents[2]
#: The lane's scenarios (docs/gpus.md lists them).
SCENARIOS = (
    "test_basic_world_one_gpu_per_agent",
    "test_sigkill_of_an_agent_while_the_others_sit_in_an_allreduce",
    "test_a_crashing_rank_restarts_the_group",
    "test_a_rank_stuck_outside_the_allreduce_is_caught_by_hang_detection",
    "test_warm_started_workers_are_forks_of_the_agent_and_use_cuda",
    "test_nproc_per_node_gpu_starts_one_worker_per_visible_gpu",
    "test_counting_gpus_leaves_cuda_uninitialised_so_a_fork_can_use_it",
    "test_gpu_pods_each_get_their_own_gpu_and_train_over_nccl",
    "test_a_force_deleted_gpu_pod_is_replaced_on_its_freed_gpu",
    "test_a_crashing_gpu_rank_restarts_the_group_on_the_same_gpus",
    "test_a_gpu_rank_stuck_outside_the_allreduce_is_restarted_by_hang_detection",
    "test_an_overlapping_save_of_a_gpu_state_is_staged_in_pinned_memory_and_restores_bit_identical",
)


@pytest.mark.slow  # a whole pytest collection in a subprocess: over 5 s
def test_the_gpu_lane_is_collected_and_skipped_with_what_it_needs() -> None:
    found = cuda_device_count()
    if found >= 1:
        pytest.skip(f"this machine has {found} GPU(s): the lane, or its one-GPU part, runs here")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
         "tests/gpu", "e2e/test_e2e_gpu.py"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    for needed in ("2 GPUs", "1 GPU"):
        reason = f"needs CUDA and at least {needed} (found {found}): run on a GPU machine with `python3 -m pytest -m gpu`"
        assert reason in done.stdout, done.stdout[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "failed" not in summary, summary
    # every scenario of the lane was collected (none lost to an import error)
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "-p", "no:cacheprovider",
         "tests/gpu", "e2e/test_e2e_gpu.py"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    for name in SCENARIOS:
        assert name in listed.stdout, listed.stdout[-3000:]


def test_the_gpu_marker_is_registered() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert '"gpu: needs CUDA, NCCL and at least 2 GPUs' in text
