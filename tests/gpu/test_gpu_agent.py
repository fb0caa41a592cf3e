"""The GPU lane: real ``kelastic-agent`` processes on one machine, NCCL, one GPU per agent.

Each agent gets its own GPUs through ``CUDA_VISIBLE_DEVICES`` (as a pod gets them from the
device plugin) and runs tests/gpu/scripts/nccl_worker.py. The NCCL timeout is longer than
any wait here, so a survivor stuck in a collective on a lost peer comes back only through
kelastic. Skipped, saying what they need, where there is no CUDA or fewer than two GPUs
(the root conftest); run them with ``python3 -m pytest -m gpu`` (docs/gpus.md).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kelastic.agent.rendezvous.server import start_server_process

AGENT_TESTS = Path(__file__).resolve().parents[1] / "agent"
harness = SimpleNamespace(**runpy.run_path(str(AGENT_TESTS / "agent_harness.py")))
WORKER = Path(__file__).parent / "scripts" / "nccl_worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def gpus() -> int:
    """How many GPUs the lane may use (the root conftest skipped it where fewer than 2)."""
    from kelastic.agent.devices import cuda_device_count

    return cuda_device_count()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    """A rendezvous store of the test's own and the agents of one job (killed at the end)."""
    store = start_server_process(harness.loopback_host(), 29400, timeout=60)
    agents = harness.Cluster(tmp_path, store.endpoint, run_id=f"gpu-{tmp_path.name}")
    try:
        yield agents
    finally:
        agents.close()
        store.stop()


def on_gpus(*devices: int) -> dict[str, str]:
    """An agent's environment: its own GPUs, numbered as nvidia-smi numbers them."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def start_agents(
    cluster: Any, count: int, agent_args: list[str], script_args: list[str], per_agent: int = 1
) -> list[Any]:
    """``count`` agents, agent i on GPUs [i*per_agent, (i+1)*per_agent)."""
    return [
        cluster.start(
            f"gpu{i}",
            agent_args,
            script_args,
            env=on_gpus(*range(i * per_agent, (i + 1) * per_agent)),
            script=WORKER,
        )
        for i in range(count)
    ]


def forked_from_agent(record: dict[str, Any]) -> bool:
    """Whether the worker's parent, the fork server, is a fork of the agent (the same command
    line) rather than multiprocessing's fresh server (``-c 'from multiprocessing.forkserver …``)."""
    parent = str(record["parent_cmdline"])
    return " -m kelastic.agent " in parent and "multiprocessing.forkserver" not in parent


def check_records(records: list[dict[str, Any]], world: int) -> None:
    """One record per rank, each on a GPU of its own, and the all-reduce summed every rank."""
    assert sorted(int(r["env"]["RANK"]) for r in records) == list(range(world)), records
    assert len({r["device_uuid"] for r in records}) == world, "two ranks shared a GPU"
    for r in records:
        assert r["allreduce"] == world * (world - 1) / 2
        assert r["bad_fork"] is False


def test_basic_world_one_gpu_per_agent(cluster: Any, gpus: int) -> None:
    n = min(gpus, 4)
    start_agents(cluster, n, ["--nnodes", f"{n}:{n}", "--nproc-per-node", "1", "--max-restarts", "0"], [])
    assert cluster.wait_all(180) == [0] * n
    records = cluster.records(n)
    check_records(records, n)
    for r in records:
        assert r["device_count"] == 1, "an agent's workers must see only the agent's GPUs"
        assert r["cuda_visible_devices"] in {str(i) for i in range(n)}


def test_sigkill_of_an_agent_while_the_others_sit_in_an_allreduce_restarts_them_at_the_smaller_world(
    cluster: Any, gpus: int
) -> None:
    n = min(gpus, 3)
    args = ["--nnodes", f"{n - 1}:{n}", "--nproc-per-node", "1", "--max-restarts", "0"]
    # Short steps: within 10 ms of the peer's death the survivors are in an all-reduce on
    # the GPU that cannot complete, well before any agent can have noticed.
    agents = start_agents(
        cluster, n, args, ["--until-world", str(n - 1), "--steps", "5", "--step-time", "0.01"]
    )
    cluster.wait_for(f"steps at world {n}", lambda: any(w == n for _, w, _, _ in cluster.steps()), 180)
    killed_at = time.time()
    agents[-1].kill_group(signal.SIGKILL)
    # Well within the NCCL timeout (600 s): only kelastic can have freed the survivors.
    assert cluster.wait_all(120, agents[:-1]) == [0] * (n - 1)
    check_records(cluster.records(n - 1), n - 1)
    first = min(t for t, w, _, _ in cluster.steps() if w == n - 1)
    print(f"GPU recovery: first step at world {n - 1} {first - killed_at:.2f}s after SIGKILL")


def test_a_crashing_rank_restarts_the_group_and_its_replacement_gets_the_freed_memory(cluster: Any) -> None:
    # Every worker holds 60% of its GPU: a replacement started before the crashed worker's
    # process was gone could not allocate as much (and would spend the last restart).
    args = ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "1"]
    agents = start_agents(
        cluster, 2, args, ["--crash-rank", "1", "--crash-times", "1", "--hold-fraction", "0.6"]
    )
    assert cluster.wait_all(240) == [0, 0], "\n".join(a.output()[-3000:] for a in agents)
    again = [r for r in cluster.records(2) if r["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"]
    check_records(again, 2)
    assert all(r["held_bytes"] > 0 for r in again)
    assert sorted(p.name for p in cluster.out.glob("done_*")) == ["done_r1_rank0", "done_r1_rank1"]


def test_a_rank_stuck_outside_the_allreduce_is_caught_by_hang_detection(cluster: Any) -> None:
    args = ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "1", "--hang-timeout", "8"]
    agents = start_agents(cluster, 2, args, ["--hang-rank", "1", "--hang-at", "5", "--steps", "5"])
    assert cluster.wait_all(300) == [0, 0]
    assert sorted(p.name for p in cluster.out.glob("done_*")) == ["done_r1_rank0", "done_r1_rank1"]
    logs = "\n".join(a.output() for a in agents)
    assert "reported no progress for" in logs and "hang timeout 8s" in logs


def _first_step_after(cluster: Any, started: float) -> float:
    return min(t for t, _, _, _ in cluster.steps()) - started


def test_warm_started_workers_are_forks_of_the_agent_and_use_cuda(cluster: Any) -> None:
    args = ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "0", "--warm-start"]
    started = time.time()
    start_agents(cluster, 2, args, [])
    assert cluster.wait_all(180) == [0, 0]
    records = cluster.records(2)
    check_records(records, 2)
    for r in records:
        # The fork server is a fork of the agent, not the fresh interpreter of the fallback:
        # the agent never initialised CUDA, so the workers it forked can use it.
        assert forked_from_agent(r), r["parent_cmdline"]
    print(
        f"warm start on GPU: first step {_first_step_after(cluster, started):.2f}s after the agents started"
    )


def test_nproc_per_node_gpu_starts_one_worker_per_visible_gpu(cluster: Any) -> None:
    # One agent with two GPUs; --warm-start too: counting the GPUs must not have
    # initialised CUDA in the agent its workers are forked from.
    args = ["--nnodes", "1:1", "--nproc-per-node", "gpu", "--max-restarts", "0", "--warm-start"]
    (agent,) = start_agents(cluster, 1, args, [], per_agent=2)
    assert cluster.wait_all(180) == [0]
    records = cluster.records(2)
    check_records(records, 2)
    assert sorted(r["env"]["LOCAL_RANK"] for r in records) == ["0", "1"]
    assert all(r["device_count"] == 2 and r["env"]["LOCAL_WORLD_SIZE"] == "2" for r in records)
    assert all(forked_from_agent(r) for r in records), agent.output()[-3000:]


_FORK_CHECK = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed
    from kelastic.agent import devices
    from kelastic.agent.cli import parse_nproc_per_node
    if sys.argv[1] == "is_available":
        torch.cuda.is_available()  # what kelastic no longer does: torch poisons every fork
    n = parse_nproc_per_node("gpu")
    state = {"nproc": n, "initialized": torch.cuda.is_initialized(), "touched": devices.cuda_touched()}
    pid = os.fork()
    if pid == 0:
        try:
            bad = torch._C._cuda_isInBadFork()
            x = torch.ones(1, device="cuda")
            os._exit(0 if (not bad and x.item() == 1.0) else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    state["child"] = os.waitstatus_to_exitcode(status)
    print(json.dumps(state))
    """
)


def test_counting_gpus_leaves_cuda_uninitialised_so_a_fork_can_use_it(gpus: int) -> None:
    def run(mode: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-c", _FORK_CHECK, mode],
            capture_output=True,
            text=True,
            timeout=180,
            env={k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"},
        )
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout.splitlines()[-1]))

    clean = run("count")
    assert clean == {"nproc": gpus, "initialized": False, "touched": False, "child": 0}
    # Pins why: torch's own availability check leaves the forks unable to use CUDA.
    poisoned = run("is_available")
    assert poisoned["touched"] is True and poisoned["child"] != 0, poisoned
