"""A small elastic training script: a linear-regression MLP on synthetic data.

Runs unchanged under ``kelastic-agent`` (or an ElasticJob), under plain
``torchrun``, or as a single process (``python train.py``).

What it shows:

* ``torch.distributed`` with gloo on CPU, data-parallel (DDP).
* The same training at any world size (``kelastic.data``): every optimizer step takes
  ``--global-batch`` samples of one seeded stream over the dataset, whatever the world
  size; ``ElasticSampler`` gives each rank its share cut into micro-batches of at most
  ``--micro-batch`` (gradients accumulated, synchronised on the last), and its position
  goes into the checkpoint, so a group that re-forms at another size carries on with the
  very samples the old one would have taken next.
* Progress per step through ``kelastic.agent.progress.update`` (shown by the
  agent, and in the ElasticJob's PROGRESS column). The import is guarded, so the
  script also runs where kelastic is not installed.
* Checkpoints in the kelastic agent's memory (``kelastic.checkpoint``): under
  ``kelastic-agent`` every ``--checkpoint-every`` steps the model, the optimizer and
  the data position go to an ``OverlappingSaver``, whose copy runs while the next
  step's forward and backward do (the step waits for it only before
  ``optimizer.step()``); the agents keep a replica on a peer, and a restarted group
  restores them with ``MemoryReader`` at whatever world size it has, from memory, a
  peer's replica, or the durable copy.
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
  completed after it, each checkpoint (a memory checkpoint once it is committed) and
  the end. Tests and curious users read it to see exactly what happened across
  restarts; ``--loss-log FILE`` adds every step's loss (the mean over its global batch).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:  # kelastic's progress reports; a no-op outside a kelastic agent.
    from kelastic.agent.progress import update as report_progress
except ImportError:  # plain torchrun or python without kelastic installed

    def report_progress(step: int, total: int | None = None, **metrics: float) -> None:
        """Stand-in for ``kelastic.agent.progress.update`` when kelastic is absent."""


try:  # the data position that survives a resize; anywhere kelastic is installed
    from kelastic.data import ElasticSampler
except ImportError:
    ElasticSampler = None  # type: ignore[assignment,misc]

try:  # kelastic's memory checkpoint: only inside a worker that kelastic-agent started
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from kelastic.checkpoint import MemoryReader, NotInKelasticWorker, OverlappingSaver
except ImportError:  # plain torchrun or python without kelastic installed
    MemoryReader = OverlappingSaver = None  # type: ignore[assignment,misc]

CHECKPOINT_FILE = "checkpoint.pt"
HISTORY_FILE = "history.jsonl"
INPUT_DIM = 32

#: One micro-batch: inputs, targets, and the factor for its mean loss (see MicroBatch.scale).
Micro = tuple[torch.Tensor, torch.Tensor, float]


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
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps to train in total")
    parser.add_argument(
        "--global-batch", type=int, default=128, help="samples per optimizer step, all ranks together"
    )
    parser.add_argument(
        "--micro-batch", type=int, default=32, help="most samples a rank puts through one forward pass"
    )
    parser.add_argument("--dataset-size", type=int, default=8192, help="samples in the synthetic dataset")
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
    parser.add_argument("--loss-log", default="", help="rank 0 appends every step's loss here (JSON lines)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds a collective may wait for peers"
    )
    args = parser.parse_args(argv)
    if args.durable_every < 0:
        parser.error(f"--durable-every must be >= 0, got {args.durable_every}")
    for name in ("steps", "global_batch", "micro_batch", "checkpoint_every", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dataset_size < args.global_batch:
        parser.error(
            f"--dataset-size ({args.dataset_size}) must be at least --global-batch ({args.global_batch})"
        )
    return args


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(INPUT_DIM, 64), nn.ReLU(), nn.Linear(64, 1))


def synthetic_dataset(seed: int, size: int) -> TensorDataset:
    """``size`` samples of a hidden linear map with a little noise; the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(INPUT_DIM, 1, generator=generator)
    inputs = torch.randn(size, INPUT_DIM, generator=generator)
    return TensorDataset(inputs, inputs @ weights + 0.01 * torch.randn(size, 1, generator=generator))


def elastic_steps(sampler: ElasticSampler, loader: DataLoader) -> Iterator[list[Micro]]:
    """Each optimizer step's micro-batches on this rank, epoch after epoch (the sampler moves
    to the next epoch by itself, and counts a step consumed as its last micro-batch comes)."""
    step: list[Micro] = []
    while True:
        for (inputs, targets), micro in sampler.accumulate(loader):
            step.append((inputs, targets, micro.scale))
            if micro.last:
                yield step
                step = []


def plain_steps(
    dataset: TensorDataset, args: argparse.Namespace, where: Rank, start: int
) -> Iterator[list[Micro]]:
    """Without kelastic: step s takes the next ``--global-batch`` samples of a seeded
    permutation per epoch, this rank a contiguous share of them in one micro-batch."""
    inputs, targets = dataset.tensors
    per_epoch = len(dataset) // args.global_batch
    for step in itertools.count(start):
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed + epoch))
        mine = order[k * args.global_batch : (k + 1) * args.global_batch].tensor_split(where.world_size)[
            where.rank
        ]
        yield [(inputs[mine], targets[mine], len(mine) * where.world_size / args.global_batch)]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[Micro],
    saver: OverlappingSaver | None,
) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches (DDP synchronises the gradients on
    the last); returns this rank's part of the step's mean loss."""
    total = torch.zeros(())
    for i, (inputs, targets, scale) in enumerate(micro_batches):
        accumulate = i < len(micro_batches) - 1 and isinstance(model, nn.parallel.DistributedDataParallel)
        with model.no_sync() if accumulate else contextlib.nullcontext():
            loss = nn.functional.mse_loss(model(inputs), targets) * scale
            loss.backward()
        total += loss.detach()
    if saver is not None:
        saver.wait_staged()  # the previous save may still be copying the weights: they change next
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def save_checkpoint(
    directory: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: ElasticSampler | None,
) -> None:
    """Write ``checkpoint.pt`` so that readers see the old file or the new one, never a torn one."""
    final = directory / CHECKPOINT_FILE
    partial = directory / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if sampler is not None:
        state["sampler"] = sampler.state_dict()
    with partial.open("wb") as out:
        torch.save(state, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, final)
    # Make the rename itself durable before the step counts as checkpointed.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler | None
) -> int:
    """Restore model, optimizer and data position from ``checkpoint.pt``; returns the step it
    holds (0 when none)."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if sampler is not None and "sampler" in state:
        sampler.load_state_dict(state["sampler"])
    return int(state["step"])


def memory_checkpoints() -> bool:
    """Whether this worker can use kelastic's memory checkpoint (it runs under kelastic-agent)."""
    if MemoryReader is None:
        return False
    try:
        MemoryReader()
    except NotInKelasticWorker:
        return False
    return True


def model_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler, step: int
) -> dict[str, object]:
    """What a memory checkpoint holds: FQN-keyed model and optimizer state (DCP's own helpers,
    which also see through the DDP wrapper), the data position and the step."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "sampler": sampler, "step": step}


def restore_from_memory(
    model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ElasticSampler
) -> int | None:
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
    state = model_state(model, optimizer, sampler, 0)
    dcp.load(state, storage_reader=reader)  # the sampler is a Stateful: DCP loads it in place
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
    dataset = synthetic_dataset(args.seed, args.dataset_size)
    sampler = None
    if ElasticSampler is not None:
        sampler = ElasticSampler(
            len(dataset), args.micro_batch, where.rank, where.world_size,
            seed=args.seed, drop_last=True, global_batch=args.global_batch,
        )  # fmt: skip
    in_memory = memory_checkpoints()
    source = "checkpoint file"
    restored = restore_from_memory(model, optimizer, sampler) if in_memory else None
    if restored is None:
        start = load_checkpoint(checkpoints, model, optimizer, sampler) if checkpoints is not None else 0
        start = agreed_step(start, distributed)
    else:
        start, source = restored, "memory checkpoint"
    if sampler is not None:
        steps = elastic_steps(sampler, DataLoader(dataset, batch_sampler=sampler))
    else:
        steps = plain_steps(dataset, args, where, start)
    # Every rank makes it at the same point: its saves run over a process group of their own.
    saver = OverlappingSaver() if in_memory else None
    durable_every = args.durable_every or args.checkpoint_every
    # DDP broadcasts rank 0's parameters, so every rank starts from the same weights.
    ddp: nn.Module = nn.parallel.DistributedDataParallel(model) if distributed else model

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
        loss = train_step(ddp, optimizer, next(steps), saver)
        if distributed:
            dist.all_reduce(loss)  # the mean over the step's global batch, whatever the world size
        loss /= where.world_size
        if args.step_delay > 0:
            time.sleep(args.step_delay)
        report_progress(step, args.steps, loss=loss.item())
        if leader and step == start + 1:
            # When the group trains again after a (re)start: what restart latency is measured by.
            record(checkpoints, "first_step", step=step, world_size=where.world_size, restart=where.restart)
        if leader and args.loss_log:
            with open(args.loss_log, "a") as out:
                out.write(
                    json.dumps({"step": step, "loss": loss.item(), "world_size": where.world_size}) + "\n"
                )
        due = step % args.checkpoint_every == 0 or step == args.steps
        if saver is not None and due:
            # Every rank: DCP copies each rank's part into its agent's memory, in the background.
            assert sampler is not None
            committed = saver.save(model_state(model, optimizer, sampler, step), step=step)
            if leader and committed is not None:  # the previous save, now complete
                record(checkpoints, "checkpoint", step=committed, world_size=where.world_size, memory=True)
        if (
            leader
            and checkpoints is not None
            and ((step % (durable_every if in_memory else args.checkpoint_every) == 0) or step == args.steps)
        ):
            save_checkpoint(checkpoints, step, model, optimizer, sampler)
            if not in_memory:
                record(checkpoints, "checkpoint", step=step, world_size=where.world_size, memory=False)
        if leader and (step % args.log_every == 0 or step == args.steps):
            print(
                f"[train] step {step}/{args.steps} loss {float(loss):.5f} world {where.world_size}",
                flush=True,
            )

    if saver is not None:
        committed = saver.close()  # the last save is complete
        if leader and committed is not None:
            record(checkpoints, "checkpoint", step=committed, world_size=where.world_size, memory=True)
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
