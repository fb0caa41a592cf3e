"""``OverlappingSaver``: memory checkpoints whose copy runs while the next step computes.

Inside a worker that ``kelastic-agent`` started::

    from kelastic.checkpoint import OverlappingSaver

    saver = OverlappingSaver()                   # every rank: it makes a gloo group of its own
    for step in range(start, total):
        loss = model(next_batch()).sum()
        loss.backward()                          # meanwhile the previous save copies the weights
        saver.wait_staged()                      # before anything changes them
        optimizer.step()
        saver.save(state, step=step + 1)         # returns at once
    saver.close()                                # the last save is committed

As a context manager, leaving the ``with`` block closes the saver, and leaving it by an
exception (a lost peer's broken collective, :class:`kelastic.inprocess.Reform`) abandons it:
the save in flight is not waited for.

It is the same ``torch.distributed.checkpoint`` save into the same storage
(:class:`~kelastic.agent.checkpoint.storage.MemoryWriter`), run on a thread of the saver's
own over a process group of its own, so the training loop's collectives and the save's never
meet. What a caller may rely on:

* **When to wait.** :meth:`OverlappingSaver.save` returns as soon as the state is handed
  over; until :meth:`OverlappingSaver.wait_staged` returns the save may still be reading the
  state's tensors, so nothing may change them before it: call it before
  ``optimizer.step()`` (and before a forward that updates buffers in place, such as
  BatchNorm's running statistics in training mode). ``save`` itself first waits for the
  previous save to be committed, and raises what it failed with.
* **Complete or nothing.** The checkpoint is committed by the coordinating rank once every
  rank's copy is complete (DCP gathers the ranks' write results first), exactly as a
  ``dcp.save`` with ``MemoryWriter`` is; a fault before that (a rank killed in the middle of
  its copy, a node lost) leaves the previous checkpoint standing, and readers never see a
  torn one.
* **What is copied when.** ``Stateful`` values (``{"sampler": sampler}``) are turned into
  their ``state_dict()`` and every value that is not a tensor is deep-copied inside
  ``save``, on the caller's thread: the checkpoint holds them as they were then.
  Tensors on the CPU are copied by the background thread straight into the agent's memory
  (one copy, as with ``dcp.save``). Where the state holds CUDA tensors, ``save`` queues their
  copy into pinned host memory on a CUDA stream of the saver's own, after the work already
  queued on the caller's stream (an event), and CPU tensors are copied at once;
  ``wait_staged`` then only makes the caller's current stream wait for that copy, without
  blocking the host, and the background thread writes the pinned copy into the agent's memory.
  The pinned buffers (the size of the rank's CUDA state) are kept for the next saves.
* **As often as replicas keep up.** A save that finds a node still sending the previous
  checkpoint's replica to its peer (or writing an older one's durable copy) is skipped, by
  every rank together before anything is copied (:attr:`OverlappingSaver.skipped` counts
  them): a checkpoint lost with its node would have cost as much as waiting, and waiting
  would stop the step. So with saves every step and replicas slower than a step, the
  checkpoints that count come every few steps, and the step never waits for the network.
  ``skip_if_busy=False`` waits instead (up to ``timeout``), as :class:`MemoryWriter` does.
  While saves have been skipped for :data:`PROGRESS_EVERY` seconds on end, the training
  thread prints a line saying so, every :data:`PROGRESS_EVERY` seconds.
* **What became of a save.** The next ``save``, ``wait`` or ``close`` returns the ``step`` of
  the save before it once that one is committed (None if it was skipped, as too large or as
  busy), or raises what it failed with, on the training thread.
* Outside a kelastic worker the constructor raises
  :class:`~kelastic.agent.checkpoint.errors.NotInKelasticWorker`.

The module imports only the standard library and torch.
"""

from __future__ import annotations

import copy
import queue
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from kelastic.agent import progress
from kelastic.agent.checkpoint.storage import MemoryWriter, _agent

__all__ = ["OverlappingSaver"]

#: Seconds between the lines a long wait for a save prints.
PROGRESS_EVERY = 30.0


class _CopySignallingWriter(MemoryWriter):
    """A ``MemoryWriter`` that says when this rank's copy is over (written or failed)."""

    def __init__(self, copied: threading.Event, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._copied = copied

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return super().write_data(plan, planner)
        finally:
            self._copied.set()

    @property
    def refused(self) -> bool:
        """Whether a node refused this save (too large, or busy: :attr:`skipped`): then
        ``finish`` committed nothing."""
        return self._save is not None and self._save.refused is not None


@dataclass
class _Save:
    """One save handed to the background thread."""

    step: int | None
    state: dict[str, Any]
    planner: SavePlanner | None
    #: set once the save no longer reads the caller's CPU tensors (copied, or failed)
    copied: threading.Event = field(default_factory=threading.Event)
    #: set once the save is over (committed, skipped, or failed: ``error``)
    done: threading.Event = field(default_factory=threading.Event)
    #: the pinned copy of the CUDA tensors is complete once this CUDA event is
    cuda_ready: Any = None
    error: BaseException | None = None
    #: whether the save ended committed (not failed, nor skipped as too large or busy)
    committed: bool = False
    #: whether it was skipped because a node was still busy with the previous one (``skip_if_busy``)
    skipped: bool = False
    began: float = field(default_factory=time.monotonic)


def _uses_cuda(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, Mapping):
        return any(_uses_cuda(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_uses_cuda(v) for v in value)
    return False


def snapshot(value: Any) -> Any:
    """``value`` with its containers rebuilt and every leaf that is not a tensor deep-copied;
    tensors are kept by reference (pure: the caller may change ``value`` afterwards)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    return copy.deepcopy(value)


def resolve_stateful(state: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level ``Stateful`` values replaced by their ``state_dict()``, as DCP does."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


class _PinnedStager:
    """Copies a state into pinned host memory on a CUDA stream of its own.

    DCP's ``StateDictStager`` does the copy (it keeps one pinned buffer per source storage,
    reused by later saves, and handles tensor subclasses such as ``DTensor``). The copy is
    ordered after the work queued on the caller's stream when :meth:`stage` is called, and
    :meth:`stage` returns without waiting for it: the event it returns completes with it.
    """

    def __init__(self) -> None:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        self._stager = StateDictStager(pin_memory=True, share_memory=False)
        self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def stage(self, state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        ready = torch.cuda.current_stream().record_event()
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            staged: dict[str, Any] = self._stager.stage(state, non_blocking=True)
        return staged, self._stream.record_event()

    def close(self) -> None:
        self._stager.close()  # type: ignore[no-untyped-call]


class OverlappingSaver:
    """Memory checkpoints saved in the background; see the module docstring for the contract.

    ``process_group``: the group the saves' collectives use (default: a new gloo group of
    every rank, made here, so every rank constructs its saver at the same point, after
    ``init_process_group``). ``strict``, ``timeout`` and ``skip_if_busy`` are
    :class:`MemoryWriter`'s, but here a save skips a busy node by default.
    """

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup | None = None,
        strict: bool = False,
        timeout: float = 300.0,
        skip_if_busy: bool = True,
    ) -> None:
        _agent()  # NotInKelasticWorker outside a kelastic worker, here rather than at the first save
        self.strict = strict
        self.timeout = timeout
        self.skip_if_busy = skip_if_busy
        #: saves skipped because a node was still busy with the previous one's replica
        self.skipped = 0
        self._skipping_since: float | None = None  # when the saves began to be skipped, on end
        self._skip_told = 0.0
        self._no_dist = not (dist.is_available() and dist.is_initialized())
        self._group = process_group
        if self._group is None and not self._no_dist:
            # The saves' collectives run beside the training's (DDP's all-reduce): on one group
            # their order could differ between ranks; DCP's object collectives need a CPU backend.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout + 60))
        self._pinned: _PinnedStager | None = None
        self._current: _Save | None = None
        self._jobs: queue.Queue[_Save | None] = queue.Queue()
        # A daemon: a save blocked on a lost peer must not hold the process's exit.
        self._thread = threading.Thread(target=self._run, name="kelastic-overlapping-save", daemon=True)
        self._thread.start()
        self._closed = False

    # --- the training thread ---------------------------------------------------------------
    def save(
        self, state: Mapping[str, Any], *, step: int | None = None, planner: SavePlanner | None = None
    ) -> int | None:
        """Start saving ``state`` as the checkpoint of ``step``; returns once it is handed over.

        Waits first for the previous save to be over and raises its error, if any; returns
        what :meth:`wait` returns for it. Call :meth:`wait_staged` before anything changes the
        state's tensors.
        """
        if self._closed:
            raise RuntimeError("OverlappingSaver.save() after close()")
        began = time.monotonic()
        if self._no_dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "this OverlappingSaver was made before torch.distributed.init_process_group(): it would save "
                "this rank alone; make it after (every rank at the same point)"
            )
        previous = self._wait()
        plain = resolve_stateful(state)
        job = _Save(step, {}, planner)
        if _uses_cuda(plain):
            if self._pinned is None:
                self._pinned = _PinnedStager()
            job.state, job.cuda_ready = self._pinned.stage(plain)
            job.copied.set()  # the caller's CPU tensors were copied by stage()
        else:
            job.state = snapshot(plain)
        self._current = job
        self._jobs.put(job)
        # What the training thread waited here is the job's save stall (its goodput counts it).
        progress.stalled(time.monotonic() - began)
        return previous

    def wait_staged(self) -> None:
        """Return once the save in flight no longer reads the state's tensors (at once when
        none is in flight). With CUDA tensors the caller's current stream waits instead."""
        job = self._current
        if job is None:
            return
        if job.cuda_ready is not None and not job.done.is_set():
            torch.cuda.current_stream().wait_event(job.cuda_ready)
            return
        began = time.monotonic()
        self._await(job.copied, job, "copied")
        progress.stalled(time.monotonic() - began)

    def wait(self) -> int | None:
        """Return once the save in flight is over: its ``step`` when it was committed (the
        ``step`` it was given), None when it was skipped as too large or none was in flight;
        raise its error if it failed."""
        began = time.monotonic()
        try:
            return self._wait()
        finally:
            progress.stalled(time.monotonic() - began)

    def _wait(self) -> int | None:
        job, self._current = self._current, None
        if job is None:
            return None
        self._await(job.done, job, "committed")
        if job.error is not None:
            raise job.error
        self._count(job)
        return job.step if job.committed else None

    def _count(self, job: _Save) -> None:
        """Count a skipped save; say so while saves have been skipped for a while on end."""
        if not job.skipped:
            self._skipping_since = None
            return
        self.skipped += 1
        now = time.monotonic()
        if self._skipping_since is None:
            self._skipping_since = job.began
        elif now - self._skipping_since >= PROGRESS_EVERY and now - self._skip_told >= PROGRESS_EVERY:
            self._skip_told = now
            print(
                f"kelastic.checkpoint: no checkpoint for {now - self._skipping_since:.0f} s (step {job.step} "
                "skipped too): a node is still sending the previous checkpoint's replica (or writing a "
                "durable copy); the newest committed checkpoint stands",
                file=sys.stderr,
                flush=True,
            )

    @property
    def staged(self) -> bool:
        """Whether the state may change now without waiting (no save in flight reads it)."""
        job = self._current
        if job is None or job.done.is_set():
            return True
        return bool(job.cuda_ready.query()) if job.cuda_ready is not None else job.copied.is_set()

    @property
    def pending(self) -> bool:
        """Whether a save is in flight (handed over and not yet waited for)."""
        return self._current is not None and not self._current.done.is_set()

    def close(self) -> int | None:
        """Wait for the last save (what :meth:`wait` returns, or raises) and stop the
        background thread."""
        if self._closed:
            return None
        try:
            return self.wait()
        finally:
            self._closed = True
            self._jobs.put(None)
            if self._pinned is not None:
                self._pinned.close()

    def abandon(self) -> None:
        """Stop taking saves without waiting for the one in flight: for a group that broke
        (its collectives may never finish). That save commits or not as it would have; the
        background thread ends after it."""
        if not self._closed:
            self._closed, self._current = True, None
            self._jobs.put(None)

    def __enter__(self) -> OverlappingSaver:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Leaving the block closes the saver (waiting for the last save); leaving it by an
        exception abandons it instead: the exception may be the group's loss."""
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    @staticmethod
    def _await(event: threading.Event, job: _Save, what: str) -> None:
        while not event.wait(PROGRESS_EVERY):
            print(
                f"kelastic.checkpoint: waiting for the save of step {job.step} to be {what} "
                f"({time.monotonic() - job.began:.0f} s since it began)",
                file=sys.stderr,
                flush=True,
            )

    # --- the background thread -------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._save(job)

    def _save(self, job: _Save) -> None:
        try:
            if job.cuda_ready is not None:
                job.cuda_ready.synchronize()
            writer = _CopySignallingWriter(
                job.copied,
                step=job.step,
                strict=self.strict,
                timeout=self.timeout,
                skip_if_busy=self.skip_if_busy,
            )
            dcp.save(
                job.state,
                storage_writer=writer,
                planner=job.planner,
                process_group=self._group,
                no_dist=self._no_dist,
            )
            job.committed = not writer.refused
            job.skipped = writer.skipped
        except BaseException as e:  # handed to the training thread, which raises it
            job.error = e
        finally:
            job.copied.set()
            job.done.set()
