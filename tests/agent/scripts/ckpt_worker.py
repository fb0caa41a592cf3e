"""A training script for the checkpoint tests: saves every step (or every ``--save-every``) to kelastic's memory checkpoint.

The state after step s is a pure function of s, so a test can tell a bit-identical restore
from a wrong one by its hash. Rank 0 appends one JSON line per event to ``OUT/events.jsonl``:
``saved`` (step, hash, node), ``restored`` (step, id, source, hash, world), ``trained``
(step, with ``--save-every`` above 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kelastic.checkpoint import MemoryReader, MemoryWriter

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--mib", type=int, default=8, help="size of the state")
p.add_argument("--step-time", type=float, default=0.2)
p.add_argument("--save-every", type=int, default=1, help="steps between saves")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = Path(args.out)
node = os.environ.get("KELASTIC_NODE_NAME", "?")


def emit(event: str, **fields: object) -> None:
    if rank == 0:
        with open(out / "events.jsonl", "a") as f:
            f.write(
                json.dumps({"event": event, "time": time.time(), "world": world, "node": node, **fields})
                + "\n"
            )


rows = max(1, args.mib * 2**20 // 4 // 1024 // 4)
state = {
    "model": {f"layer{i}": torch.zeros(rows, 1024) for i in range(4)},
    "opt": {"momentum": torch.zeros(rows, 1024, dtype=torch.float64)[: rows // 2]},
    "step": torch.zeros((), dtype=torch.int64),
    "extra": {"note": "kelastic"},
}


def digest() -> str:
    h = hashlib.sha256()
    for k in sorted(state["model"]):
        h.update(state["model"][k].numpy().tobytes())
    h.update(state["opt"]["momentum"].numpy().tobytes())
    h.update(str(int(state["step"])).encode())
    return h.hexdigest()[:16]


reader = MemoryReader()
began = time.monotonic()
if reader.exists():
    dcp.load(state, storage_reader=reader)
    assert reader.choice is not None
    emit(
        "restored",
        step=int(state["step"]),
        id=reader.choice.id,
        source=reader.choice.source.value,
        hash=digest(),
        seconds=time.monotonic() - began,
    )
for step in range(int(state["step"]), args.steps):
    t = torch.ones(1)
    dist.all_reduce(t)
    for i, k in enumerate(sorted(state["model"])):
        state["model"][k].add_(float(step + i + 1) * 1e-3)
    state["opt"]["momentum"].mul_(0.5).add_(float(step))
    state["step"].fill_(step + 1)
    if args.save_every > 1:
        emit("trained", step=step + 1)
    if (step + 1) % args.save_every == 0:
        saved = time.monotonic()
        dcp.save(state, storage_writer=MemoryWriter(step=step + 1))
        emit("saved", step=step + 1, hash=digest(), seconds=time.monotonic() - saved)
    time.sleep(args.step_time)
emit("finished", step=int(state["step"]), hash=digest())
dist.barrier()  # DCP's last broadcast released before the group goes (see examples/train.py)
dist.destroy_process_group()
