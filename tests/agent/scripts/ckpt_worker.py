"""A training script for the checkpoint tests: saves every step (or every ``--save-every``) to kelastic's memory checkpoint.

The state after step s is a pure function of s, so a test can tell a bit-identical restore
from a wrong one by its hash. Rank 0 appends one JSON line per event to ``OUT/events.jsonl``:
``saved`` (step, hash, node), ``restored`` (step, id, source, hash, world), ``trained``
(step, with ``--save-every`` above 1).

``--overlap`` saves with ``OverlappingSaver`` (``saved`` then comes once the save is
committed, with the hash the state had when it was handed over). ``--hold-step N`` holds the
copy of step N's save on rank ``--hold-rank``, in the middle of its part (after its first
tensor is copied), once per job: that rank writes ``OUT/holding.json`` (its pid, node, step)
and waits there for the test to kill it or its node. With ``--overlap`` the state holds NaN
through each step's work, from ``wait_staged()`` on, and is put back before the update: a
copy that was still reading it would save NaN, and the restore's hash would say so.

``--device cuda`` keeps the state on the GPU (the step counter on the CPU); the GPU spins
before each update, so a staging copy not ordered after the queued work would save the state
before the update. The first overlapping save reports ``staged`` (``pinned``: whether the
saver staged every CUDA tensor into pinned host memory).
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
p.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
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
device = torch.device(args.device)
state = {
    "model": {f"layer{i}": torch.zeros(rows, 1024, device=device) for i in range(4)},
    "opt": {"momentum": torch.zeros(rows, 1024, dtype=torch.float64, device=device)[: rows // 2]},
    "step": torch.zeros((), dtype=torch.int64),  # on the CPU, as Adam keeps its step
    "extra": {"note": "kelastic"},
}
#: GPU cycles (tens of milliseconds) the device spins before each update
SLEEP_CYCLES = 100_000_000


def digest() -> str:
    h = hashlib.sha256()
    for k in sorted(state["model"]):
        h.update(state["model"][k].cpu().numpy().tobytes())
    h.update(state["opt"]["momentum"].cpu().numpy().tobytes())
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


def spoiled() -> list[torch.Tensor]:
    """Fill the state with NaN, keeping a copy to put back (:func:`restore`): a save still
    reading it (a wait_staged() that returned too early) would hold NaN."""
    tensors = [*state["model"].values(), state["opt"]["momentum"]]
    kept = [x.clone() for x in tensors]
    for x in tensors:
        x.fill_(float("nan"))
    return kept


def restore(kept: list[torch.Tensor]) -> None:
    for x, k in zip([*state["model"].values(), state["opt"]["momentum"]], kept, strict=True):
        x.copy_(k)


args_step = [0]
hold_rank = args.hold_rank if args.hold_rank >= 0 else world - 1
# A save held on purpose must happen: a save may not skip a node still sending a replica then.
saver = OverlappingSaver(skip_if_busy=args.hold_step == 0) if args.overlap else None

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
pending: int | None = None  # the step of the overlapping save in flight
pending_hash: str | None = None  # its state's hash, taken before the next step changes it
for step in range(int(state["step"]), args.steps):
    t = torch.ones(1)
    dist.all_reduce(t)
    if saver is not None:
        saver.wait_staged()  # the state changes next: through the step's work it holds NaN
        kept = spoiled()
        time.sleep(args.step_time)
        restore(kept)
        if pending is not None and pending_hash is None:
            pending_hash = digest()
    else:
        time.sleep(args.step_time)
    if device.type == "cuda":
        torch.cuda._sleep(SLEEP_CYCLES)  # a staging copy not ordered after it would see the old state
    for i, k in enumerate(sorted(state["model"])):
        state["model"][k].add_(float(step + i + 1) * 1e-3)
    state["opt"]["momentum"].mul_(0.5).add_(float(step))
    state["step"].fill_(step + 1)
    if args.save_every > 1:
        emit("trained", step=step + 1)
    if saver is not None and (step + 1) % args.save_every == 0:
        hold = step + 1 == args.hold_step and rank == hold_rank and not (out / "holding.json").exists()
        args_step[0] = step + 1
        committed = saver.save(state, step=step + 1, planner=HoldingPlanner() if hold else None)
        if pending is not None and committed == pending:  # save() waited for it: committed
            emit("saved", step=pending, hash=pending_hash)
        elif device.type == "cuda":  # the first save here: what it staged (the saver's own record)
            job = saver._current
            assert job is not None
            staged = [*job.state["model"].values(), job.state["opt"]["momentum"]]
            emit("staged", pinned=all(t.is_pinned() and not t.is_cuda for t in staged))
        pending, pending_hash = step + 1, None
    elif (step + 1) % args.save_every == 0:
        saved = time.monotonic()
        dcp.save(state, storage_writer=MemoryWriter(step=step + 1))
        emit("saved", step=step + 1, hash=digest(), seconds=time.monotonic() - saved)
last = saver.close() if saver is not None else None
if pending is not None and last == pending:
    emit("saved", step=pending, hash=digest())
emit("finished", step=int(state["step"]), hash=digest())
dist.barrier()  # DCP's last broadcast released before the group goes (see examples/train.py)
dist.destroy_process_group()
