"""A worker for the GPU lane: torchrun's variables over a real NCCL group, one GPU per rank.

Each run sets its device to ``cuda:LOCAL_RANK`` (the agent's ``CUDA_VISIBLE_DEVICES``
decides which physical GPU that is), all-reduces on it and writes
``<out>/w<WORLD_SIZE>_r<RESTART>_rank<RANK>.json``: the variables it saw, the GPUs it
could see, its device's UUID, the all-reduce's result, whether torch called its process
a bad fork, and its parent's command line (a warm start's workers are children of the
fork server). Then:

* ``--crash-rank R``: global rank R raises while ``TORCHELASTIC_RESTART_COUNT < --crash-times``,
  after its first all-reduce (its peers are then waiting in the next one);
* ``--hang-rank R``: on the first attempt rank R stops stepping at step ``--hang-at``
  (the others block in the all-reduce on the GPU until kelastic's hang detection acts);
* ``--until-world W``: steps until the agent restarts it at world size W, then ``--steps`` more;
* otherwise ``--steps`` steps and exit 0.
* ``--hold-fraction F``: before the first step, allocate F of the device's total memory
  and keep it: with F above one half, a replacement started while the previous worker
  still held its memory would fail with an out-of-memory error.

Every step (one all-reduce on the GPU, synchronised) is appended to
``<out>/steps.log`` as ``<time> <world> <rank> <step>``. The NCCL timeout is
``--nccl-timeout`` (default 600 s): longer than any test waits, so only kelastic can end a
collective stuck on a lost peer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kelastic.agent import progress
from kelastic.agent.contract import WORKER_ENV_VARS
from kelastic.agent.multiprocessing import record


def _parent_cmdline() -> str:
    try:
        return (
            Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-times", type=int, default=10**9)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-at", type=int, default=5)
    p.add_argument("--until-world", type=int, default=0)
    p.add_argument("--max-wait", type=float, default=120.0)
    p.add_argument("--hold-fraction", type=float, default=0.0)
    p.add_argument("--nccl-timeout", type=float, default=600.0)
    a = p.parse_args()
    out = Path(a.out)
    missing = [k for k in WORKER_ENV_VARS if k not in os.environ]
    if missing:
        raise RuntimeError(f"missing worker variables: {missing}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    bad_fork = bool(getattr(torch._C, "_cuda_isInBadFork", lambda: False)())

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    held = None
    if a.hold_fraction > 0:
        _free, total = torch.cuda.mem_get_info(device)
        held = torch.empty(int(total * a.hold_fraction), dtype=torch.uint8, device=device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=a.nccl_timeout))
    t = torch.tensor([float(rank)], device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize(device)
    props = torch.cuda.get_device_properties(device)
    rec = {
        "env": {k: os.environ[k] for k in WORKER_ENV_VARS},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device_count": torch.cuda.device_count(),
        "device_uuid": str(getattr(props, "uuid", "")),
        "device_name": props.name,
        "allreduce": t.item(),
        "bad_fork": bad_fork,
        "held_bytes": 0 if held is None else held.numel(),
        "pid": os.getpid(),
        "parent_cmdline": _parent_cmdline(),
    }
    (out / f"w{world}_r{restart}_rank{rank}.json").write_text(json.dumps(rec))
    print(f"rank {rank} of {world} ready on {props.name} ({rec['device_uuid']})", flush=True)
    if rank == a.crash_rank and restart < a.crash_times:
        raise ValueError(f"planned crash of rank {rank} at restart {restart}")

    def step(i: int) -> None:
        if rank == a.hang_rank and restart == 0 and i == a.hang_at:
            time.sleep(3600)  # the others wait for this rank in the all-reduce below
        x = torch.ones(1, device=device)
        dist.all_reduce(x)
        if int(x.item()) != world:  # .item() waits for the collective on the GPU
            raise RuntimeError(f"all-reduce gave {x.item()}, expected {world}")
        with open(out / "steps.log", "a") as f:
            f.write(f"{time.time():.6f} {world} {rank} {i}\n")
        progress.update(i + 1)
        time.sleep(a.step_time)

    # Steps until the agent restarts us at --until-world (it stops us when the world
    # changes), forever on a hanging first attempt, else --steps of them.
    waiting = bool(a.until_world) and world != a.until_world
    hanging = a.hang_rank >= 0 and restart == 0
    deadline = time.monotonic() + a.max_wait
    i = 0
    while waiting or hanging or i < a.steps:
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"world stayed {world}, never became {a.until_world} within {a.max_wait}s")
        step(i)
        i += 1
    (out / f"done_r{restart}_rank{rank}").write_text("ok")
    # A last all-reduce on our device rather than dist.barrier(), which would have to guess it.
    dist.all_reduce(torch.ones(1, device=device))
    torch.cuda.synchronize(device)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
