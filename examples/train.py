"""A small elastic training script: a linear-regression MLP on synthetic data.

Runs unchanged under ``kelastic-agent`` (or an ElasticJob), under plain
``torchrun``, or as a single process (``python train.py``).

What it shows:

* ``torch.distributed`` with gloo on CPU, data-parallel (DDP).
* Elastic-safe data: the batch of global step ``s`` for rank ``r`` of ``W`` is a
  pure function of ``(seed, s, r, W)``, so a group that re-forms at another
  world size just carries on from the step it resumed at.
* Progress per step through ``kelastic.agent.progress.update`` (shown by the
  agent, and in the ElasticJob's PROGRESS column). The import is guarded, so the
  script also runs where kelastic is not installed.
* Checkpoints in the kelastic agent's memory (``kelastic.checkpoint``): under
  ``kelastic-agent`` every ``--checkpoint-every`` steps the model and optimizer go
  to ``MemoryWriter`` (a memory copy; the agents keep a replica on a peer), and a
  restarted group restores them with ``MemoryReader`` at whatever world size it has,
  from memory, a peer's replica, or the durable copy.
* Checkpoint files in a shared directory (``--checkpoint-dir`` or env
  ``KELASTIC_CHECKPOINT_DIR``): rank 0 writes ``checkpoint.pt`` atomically
  (temporary file, fsync, rename) every ``--durable-every`` steps (default: every
  checkpoint); every rank loads it at start when no newer memory checkpoint
  exists (always, under plain torchrun), so a group that lost every node still
  resumes. ``{run_id}`` in the directory is replaced by ``TORCHELASTIC_RUN_ID``
  (an ElasticJob's UID), so every job gets a directory of its own on a volume that
  outlives it.
* A history file, ``history.jsonl`` in the checkpoint directory, where rank 0
  records each start (resumed step, world size, restart count), the first step
  completed after it, each checkpoint and the end. Tests and curious users read it to see exactly what
  happened across restarts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

try:  # kelastic's progress reports; a no-op outside a kelastic agent.
    from kelastic.agent.progress import update as report_progress
except ImportError:  # plain torchrun or python without kelastic installed

    def report_progress(step: int, total: int | None = None, **metrics: float) -> None:
        """Stand-in for ``kelastic.agent.progress.update`` when kelastic is absent."""


try:  # kelastic's memory checkpoint: only inside a worker that kelastic-agent started
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from kelastic.checkpoint import MemoryReader, MemoryWriter, NotInKelasticWorker
except ImportError:  # plain torchrun or python without kelastic installed
    MemoryReader = MemoryWriter = None  # type: ignore[assignment,misc]

CHECKPOINT_FILE = "checkpoint.pt"
HISTORY_FILE = "history.jsonl"
INPUT_DIM = 32


@dataclass(frozen=True)
class Rank:
    """Where this process sits in the current group."""

    rank: int
    world_size: int
    restart: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="kelastic example: elastic DDP training with checkpoint/resume"
    )
    parser.add_argument("--steps", type=int, default=300, help="global steps to train in total")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("KELASTIC_CHECKPOINT_DIR", ""),
        help="shared directory for checkpoint.pt and history.jsonl; {run_id} stands for TORCHELASTIC_RUN_ID "
        "(default: env KELASTIC_CHECKPOINT_DIR; empty: no checkpoints)",
    )
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument(
        "--durable-every",
        type=int,
        default=0,
        help="steps between checkpoint files in --checkpoint-dir under kelastic, where the memory "
        "checkpoint is taken every --checkpoint-every steps (default 0: at every checkpoint)",
    )
    parser.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="seconds to sleep per step, to stand in for real work (demos and failure drills)",
    )
    parser.add_argument("--log-every", type=int, default=20, help="rank 0 prints a line every N steps")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a collective may wait for peers"
    )
    args = parser.parse_args(argv)
    if args.durable_every < 0:
        parser.error(f"--durable-every must be >= 0, got {args.durable_every}")
    for name in ("steps", "batch_size", "checkpoint_every", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(INPUT_DIM, 64), nn.ReLU(), nn.Linear(64, 1))


def target_weights(seed: int) -> torch.Tensor:
    """The hidden linear map the model learns; the same on every rank and every restart."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(INPUT_DIM, 1, generator=generator)


def batch(
    seed: int, step: int, where: Rank, batch_size: int, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of global step ``step`` for rank ``where.rank`` of ``where.world_size``.

    A pure function of its arguments, so a resumed or re-sized group draws
    well-defined, non-overlapping data for each step.
    """
    mixed = ((seed * 1_000_003 + step) * 1_009 + where.world_size) * 1_013 + where.rank
    generator = torch.Generator().manual_seed(mixed & 0x7FFF_FFFF_FFFF)
    inputs = torch.randn(batch_size, INPUT_DIM, generator=generator)
    noise = 0.01 * torch.randn(batch_size, 1, generator=generator)
    return inputs, inputs @ weights + noise


def save_checkpoint(directory: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``checkpoint.pt`` so that readers see the old file or the new one, never a torn one."""
    final = directory / CHECKPOINT_FILE
    partial = directory / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
    with partial.open("wb") as out:
        torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, final)
    # Make the rename itself durable before the step counts as checkpointed.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model and optimizer from ``checkpoint.pt``; returns the step it holds (0 when none)."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def memory_checkpoints() -> bool:
    """Whether this worker can use kelastic's memory checkpoint (it runs under kelastic-agent)."""
    if MemoryWriter is None:
        return False
    try:
        MemoryReader()
    except NotInKelasticWorker:
        return False
    return True


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, object]:
    """What a memory checkpoint holds: FQN-keyed model and optimizer state (DCP's own helpers,
    which also see through the DDP wrapper) and the step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def restore_from_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    """Restore the newest complete memory checkpoint; its step, or None when there is none.

    A collective: every rank calls it. The optimizer's state is created first (one step with
    zero gradients changes nothing) so that DCP has tensors to load its momentum into.
    """
    reader = MemoryReader()
    if not reader.exists():
        return None
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = model_state(model, optimizer, 0)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])  # type: ignore[call-overload]


def record(directory: Path | None, event: str, **fields: object) -> None:
    """Append one event to ``history.jsonl`` (rank 0 only; a no-op without a checkpoint dir)."""
    if directory is None:
        return
    line = json.dumps({"event": event, "time": time.time(), **fields})
    with (directory / HISTORY_FILE).open("a") as out:
        out.write(line + "\n")
        out.flush()
        os.fsync(out.fileno())


def checkpoint_directory(template: str) -> Path | None:
    """The checkpoint directory for this run: ``{run_id}`` becomes ``TORCHELASTIC_RUN_ID``."""
    if not template:
        return None
    return Path(template.replace("{run_id}", os.environ.get("TORCHELASTIC_RUN_ID", "local")))


def current_rank() -> Rank:
    return Rank(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


def agreed_step(step: int, distributed: bool) -> int:
    """Rank 0's resume step, so every rank starts the same global step."""
    if not distributed:
        return step
    value = torch.tensor([step], dtype=torch.int64)
    dist.broadcast(value, src=0)
    return int(value.item())


def train(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # many small workers share a few cores
    where = current_rank()
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
    checkpoints = checkpoint_directory(args.checkpoint_dir)
    if checkpoints is not None:
        checkpoints.mkdir(parents=True, exist_ok=True)
    leader = where.rank == 0

    torch.manual_seed(args.seed)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    in_memory = memory_checkpoints()
    source = "checkpoint file"
    restored = restore_from_memory(model, optimizer) if in_memory else None
    if restored is None:
        start = load_checkpoint(checkpoints, model, optimizer) if checkpoints is not None else 0
        start = agreed_step(start, distributed)
    else:
        start, source = restored, "memory checkpoint"
    durable_every = args.durable_every or args.checkpoint_every
    # DDP broadcasts rank 0's parameters, so every rank starts from the same weights.
    ddp: nn.Module = nn.parallel.DistributedDataParallel(model) if distributed else model
    weights = target_weights(args.seed)
    loss_fn = nn.MSELoss()

    if leader:
        record(
            checkpoints,
            "start",
            step=start,
            world_size=where.world_size,
            restart=where.restart,
            source=source,
        )
        print(
            f"[train] world size {where.world_size}, restart {where.restart}: "
            + (f"resumed from the {source} at step {start}" if start else "starting from scratch")
            + f", training to step {args.steps}",
            flush=True,
        )

    loss = torch.tensor(0.0)
    for step in range(start + 1, args.steps + 1):
        inputs, targets = batch(args.seed, step, where, args.batch_size, weights)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(inputs), targets)
        loss.backward()
        loss = loss.detach()
        optimizer.step()
        if args.step_delay > 0:
            time.sleep(args.step_delay)
        report_progress(step, args.steps, loss=loss.item())
        if leader and step == start + 1:
            # When the group trains again after a (re)start: what restart latency is measured by.
            record(checkpoints, "first_step", step=step, world_size=where.world_size, restart=where.restart)
        due = step % args.checkpoint_every == 0 or step == args.steps
        if in_memory and due:
            # Every rank: DCP writes each rank's part into its agent's memory (a copy).
            dcp.save(model_state(model, optimizer, step), storage_writer=MemoryWriter(step=step))
        if (
            leader
            and checkpoints is not None
            and ((step % (durable_every if in_memory else args.checkpoint_every) == 0) or step == args.steps)
        ):
            save_checkpoint(checkpoints, step, model, optimizer)
        if leader and due and (in_memory or checkpoints is not None):
            record(checkpoints, "checkpoint", step=step, world_size=where.world_size, memory=in_memory)
        if leader and (step % args.log_every == 0 or step == args.steps):
            print(
                f"[train] step {step}/{args.steps} loss {float(loss):.5f} world {where.world_size}",
                flush=True,
            )

    if leader:
        record(checkpoints, "done", step=args.steps, world_size=where.world_size, loss=float(loss))
        print(f"[train] done: {args.steps} steps, final loss {float(loss):.5f}", flush=True)
    if distributed:
        # Every collective queued before, DCP's broadcast of its last save included, is done and
        # released by gloo's worker thread before the group goes: destroying DDP's reducer joins
        # that thread while holding the GIL, which a release still pending would need.
        dist.barrier()
        del ddp
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    return train(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
