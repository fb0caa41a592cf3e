"""A worker under ``kelastic.inprocess.run``: for tests/agent/test_inprocess_agents.py.

The process allocates its state once (a tensor counting the steps it took, in any group).
Each call of ``train`` (one per group the process is a member of) writes
``<out>/g<generation>_<node>_<pid>.json`` (its rank and world size, the environment it was
handed), then steps: an all-reduce of ones (every rank sees the world size) and a short
sleep, until a rank sees ``<out>/stop`` (all stop at that step); then it returns and the process exits 0.
``<out>/crash_<node>`` makes the rank fail on its own: it raises, or, when the file says
``exit``, its process exits with code 3. ``--rank-at-import`` reads ``RANK`` before
``run()`` (a worker started early has none: it fails there).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import kelastic.inprocess


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank-at-import", action="store_true", help="read RANK before run(), as some scripts do")
    a = p.parse_args()
    node = os.environ.get("KELASTIC_NODE_NAME", "?")
    steps_taken = torch.zeros((), dtype=torch.int64)  # outlives every group of this process

    def train() -> str:
        gen = kelastic.inprocess.generation()
        world, rank = dist.get_world_size(), dist.get_rank()
        record = {
            "node": node,
            "pid": os.getpid(),
            "gen": gen,
            "world": world,
            "rank": rank,
            "env_world": int(os.environ["WORLD_SIZE"]),
            "steps_before": int(steps_taken),
        }
        (a.out / f"g{gen}_{node}_{os.getpid()}.json").write_text(json.dumps(record))
        while True:
            crash = a.out / f"crash_{node}"
            if crash.exists():
                how = crash.read_text()
                crash.unlink()
                if how == "exit":
                    os._exit(3)
                raise RuntimeError(f"{node} fails on its own")
            # [1, stop?]: every rank sees the world size, and all stop at the same step
            x = torch.tensor([1.0, float((a.out / "stop").exists())])
            dist.all_reduce(x)
            assert int(x[0]) == world, (int(x[0]), world)
            if x[1] > 0:
                return "done"
            steps_taken.add_(1)
            time.sleep(0.05)

    if a.rank_at_import:
        print(f"this script's rank, read before run(): {os.environ['RANK']}")
    (a.out / f"before_{node}_{os.getpid()}").touch()  # what ran before any group (a standby's, early)
    result = kelastic.inprocess.run(train, backend="gloo", timeout=timedelta(seconds=60))
    (a.out / f"done_{node}_{os.getpid()}").write_text(result)


if __name__ == "__main__":
    main()
