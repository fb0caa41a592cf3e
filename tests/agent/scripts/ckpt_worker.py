"""A training script for the checkpoint tests: saves every step (or every ``--save-every``) to kelastic's memory checkpoint.

The state after step s is a pure function of s, so a test can tell a bit-identical restore
from a wrong one by its hash. Rank 0 appends one JSON line per event to ``OUT/events.jsonl``:
``saved`` (step, hash, node), ``restored`` (step, id, source, hash, world), ``trained``
(step, with ``--save-every`` above 1).

``--overlap`` saves with ``OverlappingSaver`` (``saved`` then comes once the save is
committed, with the hash the state had when it was handed over). ``--hold-step N`` holds the
copy of step N's save on rank ``--hold-rank``, in the middle of its part (after its first
tensor is copied), once per job: that rank writes ``OUT/holding.json`` (its pid, node, step)
and waits there for the test to kill it or its node.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from kelastic.checkpoint import MemoryReader, MemoryWriter, OverlappingSaver

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--mib", type=int, default=8, help="size of the state")
p.add_argument("--step-time", type=float, default=0.2)
p.add_argument("--save-every", type=int, default=1, help="steps between saves")
p.add_argument("--overlap", action="store_true", help="save with OverlappingSaver")
p.add_argument("--hold-step", type=int, default=0, help="hold the copy of this step's save (with --overlap)")
p.add_argument("--hold-rank", type=int, default=-1, help="on this rank (default: the last)")
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


class Held(torch.Tensor):
    """A tensor whose copy into the checkpoint never ends: it tells the test, then waits to be killed."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and args[1] is not None and type(args[1]) is cls:
            note = {"pid": os.getpid(), "node": node, "rank": rank, "step": args_step[0]}
            tmp = out / "holding.tmp"
            tmp.write_text(json.dumps(note))
            os.replace(tmp, out / "holding.json")
            while True:
                time.sleep(1)
        return super().__torch_function__(func, types, args, kwargs or {})


class HoldingPlanner(DefaultSavePlanner):
    """Hands the writer its second tensor as a :class:`Held` one (the first is copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors = 0

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if write_item.type != WriteItemType.BYTE_IO:
            self.tensors += 1
            if self.tensors == 2:
                return data.as_subclass(Held)
        return data


args_step = [0]
hold_rank = args.hold_rank if args.hold_rank >= 0 else world - 1
saver = OverlappingSaver() if args.overlap else None
pending: tuple[int, str] | None = None  # (step, hash) of the overlapping save in flight

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
    if saver is not None and (step + 1) % args.save_every == 0:
        hold = step + 1 == args.hold_step and rank == hold_rank and not (out / "holding.json").exists()
        args_step[0] = step + 1
        saver.save(state, step=step + 1, planner=HoldingPlanner() if hold else None)
        if pending is not None:  # save() waited for it: committed
            emit("saved", step=pending[0], hash=pending[1])
        pending = (step + 1, digest())
    elif (step + 1) % args.save_every == 0:
        saved = time.monotonic()
        dcp.save(state, storage_writer=MemoryWriter(step=step + 1))
        emit("saved", step=step + 1, hash=digest(), seconds=time.monotonic() - saved)
    time.sleep(args.step_time)
    if saver is not None:
        saver.wait_staged()  # the next step changes the state
if saver is not None:
    saver.close()
    if pending is not None:
        emit("saved", step=pending[0], hash=pending[1])
emit("finished", step=int(state["step"]), hash=digest())
dist.barrier()  # DCP's last broadcast released before the group goes (see examples/train.py)
dist.destroy_process_group()
