"""Training that outlives a re-form in the same process (public name ``kelastic.inprocess``).

Inside a worker that ``kelastic-agent`` started::

    import kelastic.inprocess
    from kelastic.checkpoint import MemoryReader, OverlappingSaver

    model, optimizer = build()                    # once per process: imports, allocation

    def train() -> None:                          # once per group the process is a member of
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        reader = MemoryReader()
        if reader.exists():
            dcp.load(state, storage_reader=reader)
        with OverlappingSaver() as saver:
            for step in range(start, total):
                ...

    kelastic.inprocess.run(train)

When a peer is lost or a standby takes its place, the workers of the surviving nodes are not
stopped: :func:`run` leaves the process group, waits for its agent to hand it its rank in
the next group, joins it and calls ``train`` again. The process, its imports, its CUDA
context and the tensors it allocated stay; only the process group is new. What a caller may
rely on:

* **When ``fn`` is called.** After ``torch.distributed.init_process_group`` of each group
  (``backend``, ``timeout``; the variables ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and the
  rest are the new group's when it is called). ``fn`` restores its state at its start, every
  time: it may have been interrupted anywhere, and the group's newest checkpoint is what the
  members agree on. Its return value is :func:`run`'s.
* **How a call ends early.** A peer's loss usually breaks a collective (the exception
  propagates out of ``fn``); when the agent asks for a re-form while ``fn`` computes, a
  :class:`Reform` exception is raised in the main thread (from a ``SIGUSR2`` handler, only when
  the script has none of its own; else at the next :func:`check` or failed collective).
  Objects ``fn`` made over the old group (an ``OverlappingSaver``, a DDP wrapper, new groups)
  are left with it: make them inside ``fn``.
* **Any other exception out of ``fn``** parks the worker too, and its agent takes it as the
  rank's failure, as it takes a worker's exit: it spends one of ``--max-restarts`` (given back
  when a lost peer caused it), re-forms the group and hands the parked worker its rank in the
  next one, where ``fn`` is called again in the same process. When the agent gives up (no
  restart left) the exception is re-raised and the process ends with it, its traceback in the
  rank's error file as without this wrapper. Exceptions of the types in ``restart_process_on``
  are re-raised at once: the process ends and the agent starts a new one (for an error that
  leaves the process unusable). A worker that exits, crashes or is killed is started again,
  as without this wrapper.
* **Workers start early.** An agent whose script imports ``kelastic.inprocess`` starts its
  workers while its first rendezvous waits (a hot standby's, ``kelastic-agent --standby``,
  or a replacement's, while it waits for a place), with ``LOCAL_RANK`` and
  ``LOCAL_WORLD_SIZE`` but no ``RANK``, ``WORLD_SIZE`` or ``MASTER_ADDR``: the script runs up
  to :func:`run` (its imports, building the model) and parks there, so that taking a place
  costs only the process group and the restore. What the script does before :func:`run`
  must not need the group; a worker that exits meanwhile (one that reads ``RANK`` at import,
  say) is started again, the usual way, once the node has its group. When the agent stops
  before that, :func:`run` returns None without calling ``fn``. Spare workers
  (``KELASTIC_SPARE_WORKERS=1``, :mod:`kelastic.agent.spare`) start and wait the same way,
  to take the place of workers that crash.
* **Only the agent hands out groups.** The hand-off folder must be the agent's user's and
  writable by no one else (the agent makes it so); otherwise ``run`` says so and trains
  as it would elsewhere, once per process (a worker started early ends with that error).
* **What a process holds.** :func:`updating` marks the block in which the state becomes the
  state after a step; a process that ended one normally holds that step (:func:`held_step`),
  and ``kelastic.checkpoint.restore(state, replicated=True)`` copies a held state to the
  ranks of the next group that lack it instead of restoring a checkpoint.
* **Elsewhere.** Under ``torchrun`` or plain ``python`` (no agent to hand anything over),
  :func:`run` initializes the process group if needed, calls ``fn`` once and returns.

The module imports only the standard library and torch.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import TypeVar

import torch.distributed as dist

from kelastic.agent import progress
from kelastic.agent.handoff import (
    ENV_HANDOFF_DIR,
    ENV_HANDOFF_PARKED,
    Action,
    Report,
    Request,
    Stage,
    read_request,
    request_path,
    unsafe,
    write_report,
)

__all__ = ["Reform", "check", "generation", "held_step", "run", "updating"]

T = TypeVar("T")

#: The signal the agent sends to interrupt training for a re-form (when the script leaves it free).
REFORM_SIGNAL = signal.SIGUSR2
#: Seconds between looks at the request while parked.
POLL = 0.002


class Reform(Exception):
    """The agent re-forms the group: the current call of ``fn`` ends, the process stays."""


@dataclass
class _Session:
    folder: Path
    gen: int
    agent: int
    signal: int
    in_fn: bool = False
    #: the generation of the first group (1 for a worker started before its node had a group)
    first: int = 0
    #: the request file's identity when last read (inode, mtime): re-read only when it changed
    seen: tuple[int, int] | None = None
    request: Request | None = None

    def report(self, stage: Stage, reason: str = "") -> None:
        write_report(self.folder, Report(self.gen, os.getpid(), stage, self.signal, reason))

    def current(self) -> Request | None:
        try:
            st = os.stat(request_path(self.folder))
        except FileNotFoundError:
            return None
        ident = (st.st_ino, st.st_mtime_ns)
        if ident != self.seen:
            self.seen, self.request = ident, read_request(self.folder)
        return self.request

    def reform_asked(self) -> bool:
        request = self.current()
        return request is not None and request.gen > self.gen and request.action is not Action.EXIT


_session: _Session | None = None
#: The step this process's training state is at, when the script said so (see updating).
_held: int | None = None
#: Inside an updating block: a re-form asked meanwhile is raised when the block ends.
_updating = False


def generation() -> int:
    """How many re-forms this process has been through (0 in its first group, and outside
    :func:`run`)."""
    return _session.gen - _session.first if _session is not None else 0


def check() -> None:
    """Raise :class:`Reform` when the agent asks this worker's group to re-form; cheap (a
    ``stat``) otherwise. Call it between steps where the script blocks the re-form signal or
    has a ``SIGUSR2`` handler of its own. Inside :func:`updating` it waits for the block's end."""
    if _updating:
        return
    if _session is not None and _session.in_fn and _session.reform_asked():
        raise Reform(f"the agent re-forms the group (generation {_session.request.gen})")  # type: ignore[union-attr]


def held_step() -> int | None:
    """The step this process's training state is at: that of the last :func:`updating` block
    that ended normally (or of the last roll-forward this process received); None before
    one, and from the start of a block until it ends normally."""
    return _held


def _hold(step: int | None) -> None:
    global _held
    _held = step


@contextmanager
def updating(step: int) -> Iterator[None]:
    """The block in which the training state changes into the state after ``step`` (the
    optimizer's step): when it ends normally the process holds that step
    (:func:`held_step`), which lets ``kelastic.checkpoint.restore(state, replicated=True)``
    copy this state to the ranks of the next group that lack it instead of restoring a
    checkpoint. A re-form asked meanwhile is raised as :class:`Reform` once the block ended
    (the signal never interrupts an update halfway); an exception out of the block leaves the
    process holding no step. Keep collectives a lost peer could block out of it where the
    script can (a data-parallel all-reduce belongs to the backward, before the block)."""
    global _updating
    _hold(None)
    _updating = True
    try:
        yield
    finally:
        _updating = False
    _hold(step)
    check()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    check()


def _install_signal() -> int:
    try:
        if signal.getsignal(REFORM_SIGNAL) is not signal.SIG_DFL:
            return 0  # the script's own: never taken over
        signal.signal(REFORM_SIGNAL, _on_signal)
    except ValueError:  # not the main thread
        return 0
    return int(REFORM_SIGNAL)


def _join(backend: str | None, timeout: timedelta | None) -> None:
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)


def _leave() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peer is gone may fail to say goodbye: it is left anyway
            pass


def _await(session: _Session) -> Request | None:
    """The request that moves a parked worker on: GO for the next generation; None for EXIT
    or for an agent that is gone. REFORM (the agent forms the next group) waits on."""
    while True:
        request = session.current()
        if request is not None and request.gen > session.gen:
            if request.action is Action.GO:
                return request
            if request.action is Action.EXIT:
                return None
        if os.getppid() != session.agent:
            return None
        time.sleep(POLL)


def run(
    fn: Callable[[], T],
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    restart_process_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``fn`` in every group this process is a member of, until it returns; see the
    module docstring for the contract."""
    global _session
    folder = os.environ.get(ENV_HANDOFF_DIR)
    if folder and (why := unsafe(folder)) is not None:
        # A request names the group to join: one from a folder others can write is not the agent's.
        message = f"kelastic.inprocess: the hand-off folder {why}; this worker takes no group from it"
        if os.environ.get(ENV_HANDOFF_PARKED) == "1":
            raise RuntimeError(f"{message}, and was started before its group: it ends")
        print(f"{message} and is restarted at each re-form, not kept", file=sys.stderr, flush=True)
        folder = None
    if not folder:
        _join(backend, timeout)
        try:
            return fn()
        finally:
            _leave()
    session = _session = _Session(Path(folder), 0, os.getppid(), _install_signal())
    try:
        if (
            os.environ.get(ENV_HANDOFF_PARKED) == "1"
        ):  # started early (see Keeper.started_early): no group yet
            session.report(Stage.PARKED)
            request = _await(session)
            if request is None:
                return None  # type: ignore[return-value]  # the agent ended it before any group
            os.environ.update(request.env)
            os.environ.pop(ENV_HANDOFF_PARKED, None)
            session.gen = session.first = request.gen
        while True:
            _join(backend, timeout)
            session.report(Stage.RUNNING)
            session.in_fn = True
            try:
                result = fn()
            except Exception as exc:
                session.in_fn = False
                if isinstance(exc, restart_process_on):
                    raise
                _leave()
                reason = ""
                if not isinstance(exc, Reform):
                    # The rank's failure, told where a crash would tell it (its stderr), before
                    # the agent decides whether the group re-forms around it.
                    traceback.print_exc()
                    print(
                        f"kelastic.inprocess: the training raised {type(exc).__name__}; this rank waits "
                        "for its agent to re-form the group (or to end it)",
                        file=sys.stderr,
                        flush=True,
                    )
                    reason = f"{type(exc).__name__}: {exc}"[:500]
                session.report(Stage.PARKED, reason)
                request = _await(session)
                if request is None:
                    raise
                os.environ.update(request.env)
                session.gen = request.gen
                progress.new_incarnation()
                continue
            session.in_fn = False
            session.report(Stage.DONE)
            return result
    finally:
        session.in_fn = False
        _session = None
        _leave()
