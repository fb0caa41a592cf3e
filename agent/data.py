"""A data position that survives any resize of the group (``kelastic.data``).

:class:`ElasticSampler` is a batch sampler for a map-style dataset whose position is
*global*: the same on every rank and meaningful at every world size, so a checkpoint
taken by a group of W ranks resumes in a group of any other size without skipping or
repeating a sample.

The model
---------
Each epoch has one global stream: a permutation of ``range(dataset_len)`` drawn with a
``torch.Generator`` seeded with ``seed + epoch`` (the same permutation
``torch.utils.data.DistributedSampler`` draws), or ``range(dataset_len)`` itself with
``shuffle=False``. The stream is cut into *global steps* of ``world_size * batch_size``
samples; in each global step rank ``r`` takes the contiguous slice
``[r * batch_size, (r + 1) * batch_size)`` of it. The position is the pair
``(epoch, consumed)``: ``consumed`` counts the samples of the epoch's stream that the
training loop has finished with. Nothing in it depends on the world size, the rank or
the batch size, so :meth:`ElasticSampler.state_dict` is identical on every rank and loads
into a sampler of any world size, rank or batch size.

What a caller may rely on
-------------------------
* **Exactly once per epoch.** Across all ranks, all restarts and all resizes, every
  index of an epoch is yielded to the training loop as part of a consumed step exactly
  once, as long as the sampler's state is saved and restored with the rest of the
  training state (the same checkpoint): steps after the checkpoint are redone with the
  model they were lost with. Every rank holds the same state, so any rank's copy will do. With ``drop_last=True`` "every
  index" is every index but the epoch's final short step (fewer than
  ``world_size * batch_size`` samples at the world size of that moment), which no rank
  yields; nothing is yielded twice either way.
* **Consumed, not yielded.** The position moves only when the training loop says a step
  is done: :meth:`ElasticSampler.advance`, or :meth:`ElasticSampler.track` which calls it
  for each batch it hands to the loop. Iterating the sampler does not move it, so a
  ``DataLoader`` that prefetches (``num_workers > 0``, ``prefetch_factor``) and has drawn
  batches ahead of the loop changes nothing: those batches are *in flight*, and in
  flight batches are redone after a restart, never skipped. Every new iteration
  (``iter(sampler)``, a DataLoader's next ``for``) starts at the consumed position.
* **The tail.** No batch is ever larger than ``batch_size``. With ``drop_last=False``
  (the default) the epoch's last global step may be short: its
  ``R < world_size * batch_size`` samples are split evenly over the ranks (sizes differ
  by at most one, lower ranks take the larger shares). Where a full step would leave
  fewer samples than ranks (``0 < R < world_size``) and ``batch_size >= 2``, the step
  before the last takes ``world_size`` samples fewer (split evenly too), so the last one
  gives each rank one sample: in a group that does not change size, with
  ``batch_size >= 2`` and at least ``world_size`` samples, no rank ever gets an empty
  batch. An empty batch ``[]`` remains possible where nothing else keeps exactly-once
  within ``batch_size``: ``batch_size == 1``, a dataset smaller than the group, or a
  resume into a larger group with fewer samples left than ranks. Every rank still gets
  that step, so all ranks run the same number of steps and their collectives stay
  matched; ``torch.utils.data.default_collate`` cannot collate an empty list, so in
  those cases give the DataLoader a ``collate_fn`` that can, or use ``drop_last=True``.
  With ``drop_last=True`` a step is yielded only when it is full; the epoch ends when
  fewer samples than a full step remain, and those are not yielded.
* **Epochs advance by themselves.** Marking the epoch's last step consumed moves the
  position to ``(epoch + 1, 0)``. :meth:`ElasticSampler.set_epoch` exists for loops
  written for ``DistributedSampler``: ``set_epoch(e)`` with ``e`` the current epoch keeps
  the position (so a resumed loop that calls it does not rewind); another ``e`` starts
  epoch ``e`` from its beginning. Resume with ``for epoch in range(sampler.epoch, E)``.
  An epoch with no step at all (``drop_last=True`` and fewer samples than one step)
  yields nothing and ends only by ``set_epoch``.
* **One batch per global step, every rank.** ``len(sampler)`` is the number of steps left
  in the current epoch from the consumed position, the same on every rank.
* **Checkpoints.** :meth:`ElasticSampler.state_dict` returns plain ints and bools
  (``epoch``, ``consumed``, ``dataset_len``, ``seed``, ``shuffle``); the sampler is a
  ``torch.distributed.checkpoint`` ``Stateful``, so ``{"sampler": sampler}`` (or
  ``{"sampler": sampler.state_dict()}``) saves with ``dcp.save`` beside the model and
  loads with ``dcp.load`` at any world size, every rank reading the same position.
  :meth:`ElasticSampler.load_state_dict` refuses a state of another ``dataset_len``,
  ``seed`` or ``shuffle`` (another stream: exactly-once would not hold).

A fixed global batch
--------------------
With a fixed per-rank ``batch_size`` the global step follows the world size, so a resize
changes the optimisation. ``global_batch=G`` fixes it instead: every optimizer step takes
the next ``G`` samples of the stream (the epoch's last step fewer, with ``drop_last=False``),
which do not depend on the world size; ``batch_size`` becomes the most samples a rank puts
through one forward pass. In a step of ``S`` samples each rank takes its even share
(contiguous; shares differ by one at most) and cuts it into ``accumulation`` micro-batches,
``ceil(ceil(S / world_size) / batch_size)``, the same count on every rank, their sizes as
even as possible. :meth:`ElasticSampler.accumulate` hands each micro-batch out with a
:class:`MicroBatch` (its index, the count, whether it is the step's last, and ``scale``,
the factor for its mean loss), and marks the step consumed as its last micro-batch is
handed out::

    sampler = ElasticSampler(len(ds), micro_batch, rank, world_size, global_batch=256)
    loader = DataLoader(ds, batch_sampler=sampler)
    for (x, y), micro in sampler.accumulate(loader):
        with contextlib.nullcontext() if micro.last else ddp.no_sync():
            (loss_fn(ddp(x), y) * micro.scale).backward()
        if micro.last:
            optimizer.step()
            optimizer.zero_grad()

With DDP's averaging over the ranks the accumulated gradient is then the gradient of the
mean loss over the step's ``S`` samples at every world size: a resized job trains as one
that never resized, up to floating-point rounding (the same sums in another order). The
position, its state and exactly-once are as above. ``global_batch`` smaller than the world
size is refused. A micro-batch is empty only where a rank's share is smaller than the count
(``batch_size == 1`` and shares of unequal size, or an epoch's last step with fewer samples
than ranks); the rank must still run it (DDP expects every rank's backward), with a loss
that is a sum, scaled by ``world_size / step_samples``.

Use behind a DataLoader (``num_workers`` may be anything; keep ``in_order=True``, the
default)::

    sampler = ElasticSampler(len(ds), batch_size, rank, world_size, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=4)
    # resume: dcp.load({"model": ..., "sampler": sampler}, ...) before iterating
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in sampler.track(loader):   # counts each batch consumed as it is handed out
            train_step(batch)
            if time_to_checkpoint:            # after the step: the state includes this batch
                dcp.save({"model": ..., "sampler": sampler}, ...)

This module imports only the standard library and torch (it ships with the injected
agent into torch-only images).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["ElasticSampler", "MicroBatch"]

_T = TypeVar("_T")

# The keys of ElasticSampler.state_dict(); the last three pin the stream the position is in.
_POSITION_KEYS = ("epoch", "consumed")
_STREAM_KEYS = ("dataset_len", "seed", "shuffle")


def _step_size(remaining: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Samples the next global step takes when ``remaining`` are left in the epoch (0: none)."""
    full = world_size * batch_size
    if remaining < full:
        return 0 if drop_last else remaining
    leftover = remaining - full
    if drop_last or leftover == 0 or leftover >= world_size or batch_size == 1:
        return full
    # A full step would leave fewer samples than ranks, and the last step would hand some
    # rank an empty batch. Take world_size fewer now (every rank still gets at least one,
    # as batch_size >= 2), so that the last step gives each rank one. With batch_size 1
    # no split avoids it without a batch larger than batch_size, which might not fit.
    return remaining - world_size


def _rank_slice(step: int, world_size: int, batch_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` within a global step of ``step`` samples.

    A full step gives each rank ``batch_size`` contiguous samples; a short one (the tail)
    is split evenly, lower ranks taking the one extra sample, so no rank gets more than
    one sample more than another.
    """
    if step == world_size * batch_size:
        return rank * batch_size, (rank + 1) * batch_size
    base, extra = divmod(step, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _global_step_size(remaining: int, global_batch: int, drop_last: bool) -> int:
    """Samples the next optimizer step takes with a fixed global batch (0: none left).

    Unlike :func:`_step_size` the cut does not depend on the world size: every step but an
    epoch's last (short, with ``drop_last=False``) holds ``global_batch`` samples.
    """
    if remaining >= global_batch:
        return global_batch
    return 0 if drop_last else remaining


def _accumulation(step: int, world_size: int, batch_size: int) -> int:
    """Micro-batches of at most ``batch_size`` per rank for a step of ``step`` samples, the
    same on every rank (each rank's share differs from another's by one sample at most)."""
    largest_share = -(-step // world_size)
    return max(1, -(-largest_share // batch_size))


def _micro_slices(start: int, stop: int, count: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into ``count`` contiguous slices whose sizes differ by one at most
    (the larger first); a slice is empty only where there are fewer samples than slices."""
    base, extra = divmod(stop - start, count)
    slices = []
    for i in range(count):
        stop_i = start + base + (1 if i < extra else 0)
        slices.append((start, stop_i))
        start = stop_i
    return slices


@dataclass(frozen=True)
class MicroBatch:
    """Where a micro-batch sits in its optimizer step (:meth:`ElasticSampler.accumulate`).

    ``index`` of ``count`` micro-batches this rank runs for the step (the same ``count`` on
    every rank); ``size`` samples in it; ``step_samples`` samples in the whole step, all
    ranks together; ``world_size`` ranks.
    """

    index: int
    count: int
    size: int
    step_samples: int
    world_size: int

    @property
    def last(self) -> bool:
        """Whether this is the step's last micro-batch: synchronise gradients, then step."""
        return self.index == self.count - 1

    @property
    def scale(self) -> float:
        """Multiply the micro-batch's *mean* loss by this before ``backward()``.

        With DDP (which averages gradients over the ranks) the accumulated gradient is then
        the gradient of the mean loss over the step's ``step_samples`` samples, whatever the
        world size and however the step is cut. (For a loss summed over the micro-batch
        multiply by ``world_size / step_samples`` instead; that one also holds for an empty
        micro-batch.)
        """
        return self.size * self.world_size / self.step_samples if self.step_samples else 0.0


class ElasticSampler(Sampler[list[int]]):
    """This rank's list of indices for each global step; a position that resumes at any world size.

    Pass it as ``batch_sampler=`` to a ``DataLoader`` (or iterate it directly). See the
    module's docstring for the contract: the stream, the tail, epochs, how the consumed
    position is driven (:meth:`advance`, :meth:`track` or :meth:`accumulate`), and a fixed
    ``global_batch`` (then each global step is an optimizer step of that many samples, cut
    into micro-batches of at most ``batch_size`` per rank).
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        global_batch: int | None = None,
    ) -> None:
        if global_batch is not None and global_batch < world_size:
            raise ValueError(
                f"global_batch ({global_batch}) is smaller than the world size ({world_size}): some ranks "
                "would get no sample in any step; raise global_batch or lower the most nodes the job may grow to"
            )
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.global_batch = global_batch
        self._epoch = 0
        self._consumed = 0
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its shuffled stream)
        # For the warning about a loop that never marks a step consumed: the position an
        # iteration started at, and whether that iteration ran to the epoch's end.
        self._iter_start: tuple[int, int] | None = None
        self._iter_exhausted = False
        self._iter_generation = 0

    # -- the position ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the position is in (starts at 0)."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of the epoch's global stream consumed so far (all ranks together)."""
        return self._consumed

    def _step_at(self, consumed: int) -> int:
        """Samples the global step that starts at ``consumed`` takes (0: the epoch is over)."""
        remaining = self.dataset_len - consumed
        if self.global_batch is not None:
            return _global_step_size(remaining, self.global_batch, self.drop_last)
        return _step_size(remaining, self.world_size, self.batch_size, self.drop_last)

    def _next_step(self) -> int:
        return self._step_at(self._consumed)

    def _micro_batches(self, step: int) -> list[tuple[int, int]]:
        """This rank's micro-batches of a global step of ``step`` samples: ``[start, stop)``
        within the step. One, its whole share, without a global batch."""
        lo, hi = _rank_slice(step, self.world_size, self.batch_size, self.rank)
        if self.global_batch is None:
            return [(lo, hi)]
        return _micro_slices(lo, hi, _accumulation(step, self.world_size, self.batch_size))

    @property
    def accumulation(self) -> int:
        """Micro-batches every rank runs for the optimizer step at the position (1 without a
        global batch; with one, the same on every rank, and for every full step)."""
        step = self._next_step() or self._step_at(0)
        return len(self._micro_batches(step)) if step else 1

    def advance(self, steps: int = 1) -> None:
        """Mark ``steps`` more global steps consumed (every rank calls it at the same steps).

        Call it once per batch after the training step that used it (with a global batch:
        once per optimizer step, after its micro-batches), or let :meth:`track` or
        :meth:`accumulate` do it. Marking the epoch's last step consumed moves the position to the start of
        the next epoch; further steps count in that one.
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        for _ in range(steps):
            step = self._next_step()
            if step == 0:
                # Only after load_state_dict or set_epoch put the position at an epoch's end
                # (advance itself moves on at once): this step is the next epoch's first.
                self._epoch, self._consumed = self._epoch + 1, 0
                step = self._next_step()
            self._consumed += step
            if self._next_step() == 0:
                self._epoch, self._consumed = self._epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless the position is already in it.

        For loops written for ``DistributedSampler``: calling it with the current epoch
        keeps a resumed mid-epoch position.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._consumed = epoch, 0

    # -- the stream -----------------------------------------------------------------------

    def _indices(self, epoch: int, start: int, stop: int) -> list[int]:
        """The epoch's stream from ``start`` to ``stop``."""
        if not self.shuffle:
            return list(range(start, stop))
        if self._order is None or self._order[0] != epoch:
            # Kept as a tensor (8 bytes an index, where a list of ints takes about 36), drawn
            # once per epoch however many iterations and restarts of the loop read it.
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(self.dataset_len, generator=g))
        indices: list[int] = self._order[1][start:stop].tolist()
        return indices

    def __iter__(self) -> Iterator[list[int]]:
        start = (self._epoch, self._consumed)
        if self._iter_exhausted and self._iter_start == start:
            warnings.warn(
                "ElasticSampler: a new iteration starts where the last one started, although that "
                "one ran to the end of the epoch: no step was marked consumed. Call "
                "sampler.advance() after each step, or iterate through sampler.track(loader).",
                RuntimeWarning,
                stacklevel=2,
            )
        self._iter_start, self._iter_exhausted = start, False
        self._iter_generation += 1
        return self._iterate(*start, self._iter_generation)

    def _iterate(self, epoch: int, consumed: int, generation: int) -> Iterator[list[int]]:
        # Its own cursor: the position moves only by advance(), so an iteration that a
        # DataLoader runs ahead of the training loop leaves the position where it was.
        yielded = False
        while True:
            step = self._step_at(consumed)
            if step == 0:
                break
            for lo, hi in self._micro_batches(step):
                yield self._indices(epoch, consumed + lo, consumed + hi)
            yielded = True
            consumed += step
        if yielded and generation == self._iter_generation:  # not replaced by a later iteration
            self._iter_exhausted = True

    def __len__(self) -> int:
        """Batches this rank yields from the consumed position to the epoch's end: global steps
        left (the same on every rank), or with a global batch their micro-batches."""
        remaining = self.dataset_len - self._consumed
        if self.global_batch is not None:
            full, tail = divmod(remaining, self.global_batch)
            per_full = _accumulation(self.global_batch, self.world_size, self.batch_size)
            last = _accumulation(tail, self.world_size, self.batch_size) if tail and not self.drop_last else 0
            return full * per_full + last
        full = self.world_size * self.batch_size
        return remaining // full if self.drop_last else -(-remaining // full)

    def track(self, batches: Iterable[_T]) -> Iterator[_T]:
        """Yield ``batches`` (a DataLoader over this sampler), marking each consumed as it is handed out.

        A checkpoint taken in the loop's body after the step therefore includes the
        batch of that step; batches the DataLoader prefetched but the loop never received
        are not counted, and are redone after a restart. Refuses a DataLoader whose
        ``batch_sampler`` is not this sampler or that may reorder batches
        (``in_order=False``): the count would not match the stream.
        """
        for batch, _ in self.accumulate(batches):
            yield batch

    def accumulate(self, batches: Iterable[_T]) -> Iterator[tuple[_T, MicroBatch]]:
        """Yield each batch of ``batches`` (a DataLoader over this sampler) with its
        :class:`MicroBatch`: where it sits in its optimizer step, and how to scale its loss.

        Marks a step consumed as its last micro-batch is handed out (as :meth:`track` does),
        so a checkpoint taken after the optimizer step includes it; a step broken off in the
        middle is redone from its first micro-batch. Without a global batch every batch is
        a whole step (``count`` 1). Refuses what :meth:`track` refuses.
        """
        if isinstance(batches, DataLoader):
            if batches.batch_sampler is not self:
                raise ValueError("track() needs DataLoader(dataset, batch_sampler=<this sampler>)")
            if not getattr(batches, "in_order", True):
                raise ValueError(
                    "track() needs a DataLoader with in_order=True: batches must arrive in order"
                )
        index = 0
        for batch in batches:
            # After load_state_dict or set_epoch at an epoch's end, the step is the next epoch's first.
            step = self._next_step() or self._step_at(0)
            micro = self._micro_batches(step)
            lo, hi = micro[index]
            info = MicroBatch(index, len(micro), hi - lo, step, self.world_size)
            index += 1
            if index == len(micro):
                self.advance()
                index = 0
            yield batch, info

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The consumed position and the stream it is in; identical on every rank."""
        return {
            "epoch": self._epoch,
            "consumed": self._consumed,
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a position saved by a sampler of any world size, rank or batch size.

        Raises ``ValueError`` for a state of another stream (``dataset_len``, ``seed`` or
        ``shuffle`` differ) or a position outside the dataset.
        """
        missing = [k for k in (*_POSITION_KEYS, *_STREAM_KEYS) if k not in state_dict]
        if missing:
            raise ValueError(f"ElasticSampler state lacks {missing}")
        ours = {"dataset_len": self.dataset_len, "seed": self.seed, "shuffle": self.shuffle}
        theirs = {k: _plain(state_dict[k]) for k in _STREAM_KEYS}
        if theirs != ours:
            raise ValueError(
                f"ElasticSampler state is of another stream: saved {theirs}, this sampler {ours}; "
                "resuming it would not yield each index exactly once"
            )
        epoch, consumed = int(_plain(state_dict["epoch"])), int(_plain(state_dict["consumed"]))
        if epoch < 0 or not 0 <= consumed <= self.dataset_len:
            raise ValueError(f"ElasticSampler state out of range: epoch {epoch}, consumed {consumed}")
        self._epoch, self._consumed = epoch, consumed
        self._iter_start, self._iter_exhausted = None, False


def _plain(value: Any) -> Any:
    """A value as saved: DCP may hand back a 0-d tensor where an int was written."""
    return value.item() if isinstance(value, torch.Tensor) else value
