"""A worker for the agent's end-to-end tests: checks torchrun's variables over a real gloo group.

Each run writes ``<out>/w<WORLD_SIZE>_r<RESTART>_rank<RANK>.json`` with the
variables it saw and what the group agreed on, then:

* ``--crash-rank R``: global rank R raises (recorded in its error file) while
  ``TORCHELASTIC_RESTART_COUNT < --crash-times`` (default: always);
* ``--until-world W``: keeps stepping (one all-reduce per step) until the
  agent restarts it at world size W, then does ``--steps`` more and exits 0;
* ``--until-file F``: keeps stepping until the file F exists, then does ``--steps`` more
  and exits 0;
* otherwise does ``--steps`` all-reduce steps and exits 0.
* ``--note-signals``: a termination signal writes ``<out>/signal_rank<RANK>.txt``
  with the signal's name before the worker exits.

Every step is appended to ``<out>/steps.log`` as ``<time> <world> <rank> <step>``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kelastic.agent import progress
from kelastic.agent.contract import WORKER_ENV_VARS
from kelastic.agent.multiprocessing import record

REQUIRED = WORKER_ENV_VARS


def _env() -> dict[str, str]:
    missing = [k for k in REQUIRED if k not in os.environ]
    if missing:
        raise RuntimeError(f"missing worker variables: {missing}")
    return {
        k: os.environ[k]
        for k in [*REQUIRED, "OMP_NUM_THREADS", "TORCHELASTIC_USE_AGENT_STORE"]
        if k in os.environ
    }


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-times", type=int, default=10**9)
    p.add_argument("--until-world", type=int, default=0)
    p.add_argument("--until-file", default="")
    p.add_argument("--max-wait", type=float, default=60.0)
    p.add_argument("--note-signals", action="store_true")
    p.add_argument("--total", type=int, default=None, help="total steps reported to kelastic's progress")
    a = p.parse_args()
    out = Path(a.out)
    if a.note_signals:

        def note(signum: int, frame: object) -> None:
            (out / f"signal_rank{os.environ['RANK']}.txt").write_text(signal.Signals(signum).name)
            os._exit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, note)
    env = _env()
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    restart = int(env["TORCHELASTIC_RESTART_COUNT"])
    if rank == a.crash_rank and restart < a.crash_times:
        raise ValueError(f"planned crash of rank {rank} at restart {restart}")

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    assert dist.get_rank() == rank and dist.get_world_size() == world
    mine = [
        int(env[k])
        for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE")
    ]
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, [*mine, env["ROLE_NAME"], env["TORCHELASTIC_RUN_ID"]])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    record_data = {"env": env, "group": gathered, "allreduce": t.item(), "pid": os.getpid()}
    (out / f"w{world}_r{restart}_rank{rank}.json").write_text(json.dumps(record_data))
    print(f"rank {rank} of {world} ready", flush=True)

    def step(i: int) -> None:
        x = torch.ones(1)
        dist.all_reduce(x)
        if int(x.item()) != world:
            raise RuntimeError(f"all-reduce gave {x.item()}, expected {world}")
        with open(out / "steps.log", "a") as f:
            f.write(f"{time.time():.6f} {world} {rank} {i}\n")
        progress.update(i + 1, a.total)
        time.sleep(a.step_time)

    i = 0
    if a.until_world and world != a.until_world:
        deadline = time.monotonic() + a.max_wait
        while time.monotonic() < deadline:  # the agent stops us when the world changes
            step(i)
            i += 1
        raise TimeoutError(f"world stayed {world}, never became {a.until_world} within {a.max_wait}s")
    if a.until_file:
        deadline = time.monotonic() + a.max_wait
        while not _all_see(a.until_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{a.until_file} did not appear within {a.max_wait}s")
            step(i)
            i += 1
    for _ in range(a.steps):
        step(i)
        i += 1
    dist.barrier()
    dist.destroy_process_group()


def _all_see(path: str) -> bool:
    """Whether any rank sees ``path``, agreed by every rank: each rank looking for itself can
    stop a step before another, and then waits in a collective the other never joins."""
    seen = torch.tensor([1.0 if os.path.exists(path) else 0.0])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


if __name__ == "__main__":
    sys.exit(main())
