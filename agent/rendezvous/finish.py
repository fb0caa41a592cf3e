"""The exit barrier's marks: which members of a round have finished their workers.

Each member that finished sets a key of its own, ``r/<R>/finished/<rank>``, and the
barrier passes once every rank of R has one. Keys of their own, not a shared counter:
a store that restarts during the barrier starts empty, and every waiting member
writes its mark again on its new connection, where a counter would start over at
zero and hold everyone to the timeout.
"""

from __future__ import annotations

import torch.distributed as dist

from .protocol import RunKeys, push_event
from .rounds import Member

__all__ = ["FinishMark"]


class FinishMark:
    """This node's mark at one exit barrier; :meth:`all_finished` is asked on each store event."""

    def __init__(self, keys: RunKeys) -> None:
        self._keys = keys
        self._on: dist.Store | None = None  # the connection the mark was written on

    def all_finished(self, store: dist.Store, member: Member) -> bool | None:
        """Mark ``member`` finished on ``store`` (once per connection); True once every
        member of its round is marked, else None (not yet). Reads O(N) keys."""
        k, r = self._keys, member.round
        if self._on is not store:
            store.set(k.finished(r, member.rank), "1")
            push_event(store, k, f"finished {r} {member.rank}")  # wakes the others' barriers
            self._on = store
        return True if store.check([k.finished(r, i) for i in range(member.size)]) else None
