"""A training script for the straggler test: CPU work per step, a collective, a memory checkpoint.

Each step does ``--work`` rounds of pure-Python arithmetic (a fixed amount of CPU work), then
an all-reduce counted as waiting on peers (``progress.waiting()``), reports the step and saves
it to kelastic's memory checkpoint every ``--save-every`` steps. While the file
``OUT/slow_<node>`` exists, the ranks of that node do ``--slow-factor`` times the work per
step: a slower node, as a slower device or a busier host makes one, which nothing but its
timing tells the agents about. Every rank appends ``time world rank step node`` to
``OUT/steps.log`` after each step; rank 0 appends JSON lines to ``OUT/events.jsonl``:
``saved`` (step) and ``restored`` (step, source).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kelastic.agent import progress
from kelastic.checkpoint import MemoryReader, MemoryWriter

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=100000)
p.add_argument("--work", type=int, default=200, help="rounds of CPU work per step")
p.add_argument("--save-every", type=int, default=2)
p.add_argument("--slow-factor", type=int, default=5, help="work per step while OUT/slow_<node> exists")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = Path(args.out)
node = os.environ.get("KELASTIC_NODE_NAME", "?")
slow = out / f"slow_{node}"


def emit(event: str, **fields: object) -> None:
    if rank == 0:
        with open(out / "events.jsonl", "a") as f:
            f.write(
                json.dumps({"event": event, "time": time.time(), "world": world, "node": node, **fields})
                + "\n"
            )


state = {"weights": torch.zeros(1024), "step": torch.zeros((), dtype=torch.int64)}
reader = MemoryReader()
if reader.exists():
    dcp.load(state, storage_reader=reader)
    assert reader.choice is not None
    emit("restored", step=int(state["step"]), source=reader.choice.source.value)

for step in range(int(state["step"]), args.steps):
    acc = 0
    for i in range(args.work * (args.slow_factor if slow.exists() else 1)):
        acc += sum(range(2000)) % (i + 7)
    t = torch.ones(1)
    with progress.waiting():
        dist.all_reduce(t)
    state["weights"].add_(1.0)
    state["step"].fill_(step + 1)
    progress.update(step + 1, args.steps)
    with open(out / "steps.log", "a") as f:
        f.write(f"{time.time():.3f} {world} {rank} {step + 1} {node}\n")
    if (step + 1) % args.save_every == 0:
        dcp.save(state, storage_writer=MemoryWriter(step=step + 1))
        emit("saved", step=step + 1)
dist.barrier()
dist.destroy_process_group()
