"""The exit barrier's marks: which members of a round have finished their workers.

Each member that finished sets a key of its own, ``r/<R>/finished/<rank>``, and the
barrier passes once every rank of R has one. Keys of their own, so that a mark can be
written again: a store that restarts during the barrier starts empty, and every
waiting member writes its mark again on its new connection. A counter beside them,
``r/<R>/finished``, added to with each mark, spares each event's reading all N keys:
they are checked only once it reaches N (a member that reconnected to the same store
counts twice, so the keys, not the counter, decide). A member lost meanwhile (dead,
left, dropped) will never mark itself: the barrier ends there, without waiting for
its timeout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from .protocol import RunKeys, push_event, read_counter
from .rounds import Member

__all__ = ["FinishMark"]


class FinishMark:
    """This node's mark at one exit barrier; :meth:`all_finished` is asked on each store event.

    ``lost(store, r)``: whether a member of round r was lost (the handler's fate counters).
    """

    def __init__(self, keys: RunKeys, lost: Callable[[dist.TCPStore, int], bool]) -> None:
        self._keys = keys
        self._lost = lost
        self._on: dist.TCPStore | None = None  # the connection the mark was written on

    def all_finished(self, store: dist.TCPStore, member: Member) -> bool | None:
        """Mark ``member`` finished on ``store`` (once per connection). True once every
        member of its round is marked; False once one of them was lost before it was;
        else None (not yet). Reads O(1) keys until the count says all are marked, then N."""
        k, r = self._keys, member.round
        if self._on is not store:
            store.set(k.finished(r, member.rank), "1")
            store.add(k.finished_count(r), 1)
            push_event(store, k, f"finished {r} {member.rank}")  # wakes the others' barriers
            self._on = store
        if read_counter(store, k.finished_count(r)) >= member.size and store.check(
            [k.finished(r, i) for i in range(member.size)]
        ):
            return True
        return False if self._lost(store, r) else None
