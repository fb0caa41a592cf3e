"""Restore by rolling forward: a replicated state is copied from a survivor's live memory.

Inside a worker under :func:`kelastic.inprocess.run`::

    from kelastic.checkpoint import restore

    def train() -> None:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
        restore(state, replicated=True)             # every rank calls it: it is a collective
        for ...:
            ...                                     # forward, backward, the all-reduce
            with kelastic.inprocess.updating(step):
                optimizer.step()                    # the state becomes that after `step`

What a caller may rely on:

* **When it rolls forward.** With ``replicated=True`` (every rank holds the same state: data
  parallel, DDP) the ranks first compare what they hold: a worker kept across the re-form
  knows the step its state is at (the last :func:`kelastic.inprocess.updating` block that
  ended normally, or the last roll-forward it received). When some rank holds a step at
  least as new as the group's newest checkpoint, and every rank's state has the same keys,
  shapes and dtypes, the ranks holding the newest step send their state, tensor by tensor
  over the group's own backend, to every rank that holds anything else (a replacement, a
  standby, a spare, a survivor one step behind). Nothing is read from the checkpoint and no
  step is redone: the ranks that already hold the newest step copy nothing.
* **Otherwise** (``replicated=False``, no rank held a state, a newer checkpoint, states of
  different shapes) it restores the newest checkpoint with :class:`MemoryReader` as
  ``dcp.load`` would, or leaves the state alone when there is none.
* **What comes back.** A :class:`Restored` naming the source (``"live"``, or the checkpoint's
  source: ``"memory"``, ``"replica"``, ``"durable"``), the step restored when known, and the
  bytes copied; None when nothing was restored.
* **What a state may hold.** Dicts and lists of tensors and other values, and objects with
  ``state_dict()``/``load_state_dict()`` (torch.distributed.checkpoint's ``Stateful``), as
  for ``dcp.load``. Tensors are received in place; other values are replaced by the
  sender's.
* **Failure.** A peer lost during the copy breaks it as it breaks any collective (the
  exception propagates; under :func:`kelastic.inprocess.run` the group re-forms and a rank
  that was receiving holds no step until it restores again).

The decision is the pure :func:`plan_roll_forward`; the module imports only the standard
library and torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kelastic.agent import inprocess

__all__ = ["Restored", "RollForward", "plan_roll_forward", "restore"]


@dataclass(frozen=True)
class Restored:
    """What :func:`restore` did."""

    #: ``"live"`` for a roll-forward, else the checkpoint's source (``"memory"``, ``"replica"``,
    #: ``"durable"``).
    source: str
    #: The step the state is at after the restore, when known.
    step: int | None
    #: The checkpoint restored (None for a roll-forward).
    checkpoint: int | None = None
    #: Bytes this rank received from a peer's live state (a roll-forward).
    received_bytes: int = 0
    #: Bytes this rank read from its own node's checkpoint memory, and fetched from others.
    local_bytes: int = 0
    fetched_bytes: int = 0


@dataclass(frozen=True)
class RollForward:
    """A roll-forward every rank agreed on: the step, and who sends to whom."""

    step: int
    #: (sending rank, receiving rank), each receiving rank once.
    sends: tuple[tuple[int, int], ...]


def plan_roll_forward(
    held: Sequence[int | None], shapes: Sequence[str], newest_checkpoint_step: int | None, checkpoint: bool
) -> RollForward | None:
    """The roll-forward of a group whose rank ``r`` holds step ``held[r]`` (None: no state it
    can vouch for) with a state of shape digest ``shapes[r]``, or None when the group must
    restore its checkpoint instead: no rank holds a step; the ranks' states differ in shape;
    or a checkpoint exists (``checkpoint``) that is newer than every held step or whose step is
    unknown. The ranks holding the newest step send, in turn, to the others."""
    steps = [h for h in held if h is not None]
    if not steps or len(set(shapes)) != 1:
        return None
    top = max(steps)
    if checkpoint and (newest_checkpoint_step is None or newest_checkpoint_step > top):
        return None
    senders = [r for r, h in enumerate(held) if h == top]
    receivers = [r for r, h in enumerate(held) if h != top]
    return RollForward(top, tuple((senders[i % len(senders)], r) for i, r in enumerate(receivers)))


# the state's leaves ---------------------------------------------------------------------------


@dataclass
class _Leaves:
    """A state flattened in a fixed order: its tensors, its other values (with how to set
    them) and the ``load_state_dict`` calls that complete a receive."""

    tensors: list[tuple[str, torch.Tensor]]
    values: list[tuple[str, Any, Callable[[Any], None]]]
    after: list[Callable[[], None]]

    def shape(self) -> str:
        h = hashlib.sha256()
        for path, t in self.tensors:
            h.update(f"{path}|{tuple(t.shape)}|{t.dtype}|{t.device.type}\n".encode())
        for path, _, _ in self.values:
            h.update(f"{path}|value\n".encode())
        return h.hexdigest()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


def _flatten(state: Any) -> _Leaves:
    leaves = _Leaves([], [], [])

    def setter(container: Any, key: Any) -> Callable[[Any], None]:
        def put(v: Any) -> None:
            container[key] = v

        return put

    def walk(path: str, value: Any, put: Callable[[Any], None] | None) -> None:
        if isinstance(value, torch.Tensor):
            leaves.tensors.append((path, value))
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(f"{path}/{k}", value[k], setter(value, k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{path}/{i}", v, setter(value, i))
        elif callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)
        ):
            sd = value.state_dict()
            walk(f"{path}@", sd, None)
            leaves.after.append(lambda: value.load_state_dict(sd))
        elif put is not None:
            leaves.values.append((path, value, put))
        else:
            # a value no container holds (a Stateful's state_dict() that is not a dict):
            # its shape still counts, so that two different ones never pair
            leaves.values.append((path, value, lambda v: None))

    walk("", state, None)
    return leaves


def _send(leaves: _Leaves, dst: int) -> list[Any]:
    dist.send_object_list([[v for _, v, _ in leaves.values]], dst)
    return [dist.isend(t.contiguous(), dst) for _, t in leaves.tensors]


def _receive(leaves: _Leaves, src: int) -> int:
    objects: list[Any] = [None]
    dist.recv_object_list(objects, src)
    works, copies = [], []
    for _, t in leaves.tensors:
        buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        works.append(dist.irecv(buf, src))
        if buf is not t:
            copies.append((t, buf))
    for w in works:
        if w is not None:  # None only for a rank outside the group
            w.wait()
    for t, buf in copies:
        t.copy_(buf)
    for (_, _, put), v in zip(leaves.values, objects[0], strict=True):
        put(v)
    for call in leaves.after:
        call()
    return leaves.nbytes()


def _newest_checkpoint() -> Any:
    """This node's inventory (without waiting for the parts its agent is pulling, which stop),
    or None outside a kelastic worker."""
    from kelastic.agent.checkpoint import storage
    from kelastic.agent.checkpoint.errors import NotInKelasticWorker

    try:
        endpoint, _ = storage._agent()
    except NotInKelasticWorker:
        return None
    # pull: false: this node's agent pulls no part ahead of restores that copy live state
    local, _ = storage._client(endpoint).call({"op": "inventory", "wait": False, "pull": False})
    return local["inventory"]


def _roll_forward(state: Any) -> tuple[RollForward, _Leaves] | None:
    from kelastic.agent.checkpoint.storage import choose_from

    leaves = _flatten(state)
    mine = {"held": inprocess.held_step(), "shape": leaves.shape(), "inventory": _newest_checkpoint()}
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    inventories = [g["inventory"] for g in gathered if g["inventory"] is not None]
    choice = choose_from(inventories) if inventories else None
    plan = plan_roll_forward(
        [g["held"] for g in gathered],
        [g["shape"] for g in gathered],
        None if choice is None else choice.step,
        choice is not None,
    )
    return None if plan is None else (plan, leaves)


def restore(state: Any, *, replicated: bool = False, reader: Any = None) -> Restored | None:
    """Bring ``state`` (in place) to the newest step the group can reach; a collective: every
    rank of the default group calls it together. See the module docstring for the contract.
    ``reader`` is the checkpoint's storage reader (default: a new :class:`MemoryReader`)."""
    if replicated and dist.is_initialized():
        agreed = _roll_forward(state)
        if agreed is not None:
            plan, leaves = agreed
            rank = dist.get_rank()
            received = 0
            works: list[Any] = []
            for src, dst in plan.sends:
                if dst == rank:
                    inprocess._hold(None)  # half a state is no state: held again once whole
                    received = _receive(leaves, src)
                elif src == rank:
                    works.extend(_send(leaves, dst))
            for w in works:
                if w is not None:
                    w.wait()
            inprocess._hold(plan.step)
            return Restored("live", plan.step, received_bytes=received)
    import torch.distributed.checkpoint as dcp

    from kelastic.agent.checkpoint.storage import MemoryReader

    if reader is None:
        reader = MemoryReader()
    if not reader.exists():
        return None
    inprocess._hold(None)
    dcp.load(state, storage_reader=reader)
    choice = reader.choice
    return Restored(
        str(choice.source.value),
        choice.step,
        checkpoint=choice.id,
        local_bytes=reader.local_bytes,
        fetched_bytes=reader.fetched_bytes,
    )
