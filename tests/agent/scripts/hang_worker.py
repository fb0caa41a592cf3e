"""A worker that hangs in a collective once: for the agent's hang-detection tests.

Each step is one all-reduce and one ``progress.update``. On the first attempt
(``TORCHELASTIC_RESTART_COUNT=0``) global rank 1 stops at ``--hang-at`` without
entering the step's all-reduce, so every other rank blocks in it (gloo's own
timeout is an hour: only kelastic's hang detection can end this). Later attempts
run ``--steps`` steps and exit 0 (so does the first with ``--hang-at -1``).
``--no-progress`` never reports progress; ``--sleep S`` idles S seconds first.
Writes ``<out>/done_r<RESTART>_rank<RANK>`` at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kelastic.agent import progress


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hang-at", type=int, default=5)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args()
    rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", timeout=timedelta(hours=1))
    time.sleep(a.sleep)
    steps = a.steps if restart > 0 or a.hang_at < 0 else 10**9
    for step in range(steps):
        if restart == 0 and rank == 1 and step == a.hang_at:
            time.sleep(3600)  # the others wait for this rank in the all-reduce below
        t = torch.ones(1)
        dist.all_reduce(t)
        if not a.no_progress:
            progress.update(step + 1)
        time.sleep(0.05)
    Path(a.out, f"done_r{restart}_rank{rank}").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
