"""The member records an agent acts on, signed: heartbeats, slots, member lists, standbys.

Beside the fates and closes (:mod:`.protocol`), the agents act on a few records of each
member: its heartbeat (``hb/<name>``: whether its ring predecessor marks it dead), the slot
it took in a round (``r/<R>/slot/<name>``: whether it re-joined from that round), a round's
member list (``r/<R>/members``: whom the deciders watch while a round re-forms, what the
operator shows) and a parked standby's record (``standby/<name>``). Each is written with the
job's MAC over its key name (which holds the run, the round and the member's name) and its
value (:mod:`.records`), and a reader takes only a record whose MAC holds, so a record
copied to another key, round or member, or one a stranger wrote, is ignored as if absent.

A heartbeat is no counter anyone may add to: its value is a sequence number the node
signs, which only grows (it starts from the wall clock in milliseconds when the process
starts and counts one per beat, so a restarted agent starts above every number its
earlier process wrote). A watcher counts a beat only when it reads a signed number above
every one it read before, so a stranger can make a live node look frozen (by deleting its
heartbeat or writing an old one back, as it could by deleting it before) but never a
dead node look alive.

Without a job secret the values are written as they are and read as they are (the text
before a MAC, where there is one: a reader without the key, the operator's status).

The module imports nothing of :mod:`.protocol` (which uses it to re-establish a round on a
restarted store); ``keys`` is a :class:`~.protocol.RunKeys`, of which it names what it uses.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from typing import Protocol

import torch.distributed as dist

from .records import MARK, RecordSigner


class RunKeys(Protocol):
    """What this module uses of :class:`~.protocol.RunKeys` (which imports this module)."""

    @property
    def signer(self) -> RecordSigner: ...

    def sign(self, key: str, value: str) -> str: ...

    def verify(self, key: str, stored: bytes | str | None) -> bytes | None: ...

    def heartbeat(self, name: str) -> str: ...

    def slot(self, r: int, name: str) -> str: ...

    def members(self, r: int) -> str: ...

    def standby(self, name: str) -> str: ...


__all__ = [
    "Beats",
    "RunKeys",
    "beat",
    "member_value",
    "members_value",
    "read_members",
    "read_slot",
    "read_standby",
    "slot_value",
    "standby_value",
]

#: The process's heartbeat numbers: from the wall clock in ms at start, one per beat.
_SEQ = itertools.count(time.time_ns() // 1_000_000)


def member_value(keys: RunKeys, key: str, stored: bytes | str | None) -> bytes | None:
    """The value of a member record read from ``key``: with a job secret only when the job's
    MAC holds (else None, counted as a refused record), without one its text before any MAC."""
    if stored is None:
        return None
    if keys.signer.signing:
        return keys.verify(key, stored)
    raw = stored if isinstance(stored, bytes) else stored.encode()
    value, mark, _ = raw.rpartition(MARK)
    return value if mark else raw


def _get(store: dist.Store, key: str) -> bytes | None:
    return store.get(key) if store.check([key]) else None


def beat(store: dist.Store, keys: RunKeys, name: str) -> None:
    """Write ``name``'s next heartbeat: a signed number above every one this process wrote."""
    key = keys.heartbeat(name)
    store.set(key, keys.sign(key, str(next(_SEQ))))


class Beats:
    """What a watcher read of its peers' heartbeats: per peer, the highest signed number.

    :meth:`reading` answers the number to judge the peer by: the highest read so far, so a
    value a stranger wrote (unsigned, another key's, an old one written back) or a missing
    one reads as no beat (the peer's timer runs on), never as a new one.
    """

    #: The reading of a peer never seen to beat (absent, or nothing signed yet).
    NONE = -1

    def __init__(self) -> None:
        self._best: dict[str, int] = {}

    def reading(self, keys: RunKeys, name: str, stored: bytes | None) -> int:
        best = self._best.get(name, self.NONE)
        value = member_value(keys, keys.heartbeat(name), stored)
        try:
            number = int(value) if value is not None else self.NONE
        except ValueError:
            number = self.NONE
        if number > best:
            self._best[name] = best = number
        return best

    def retain(self, names: set[str]) -> None:
        """Forget peers no longer watched (a later watch starts from nothing)."""
        for name in list(self._best):
            if name not in names:
                del self._best[name]


def slot_value(keys: RunKeys, r: int, name: str, slot: int) -> str:
    """The stored value of ``name``'s slot in round r."""
    return keys.sign(keys.slot(r, name), str(slot))


def read_slot(store: dist.Store, keys: RunKeys, r: int, name: str) -> int | None:
    """The slot ``name`` took in round r; None when it took none (or the record is not the job's)."""
    value = member_value(keys, keys.slot(r, name), _get(store, keys.slot(r, name)))
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def members_value(keys: RunKeys, r: int, names: Sequence[str]) -> str:
    """The stored value of round r's member list (names by rank)."""
    return keys.sign(keys.members(r), json.dumps(list(names)))


def read_members(store: dist.Store, keys: RunKeys, r: int) -> list[str] | None:
    """Round r's members by rank; None while not written (or when the record is not the job's)."""
    value = member_value(keys, keys.members(r), _get(store, keys.members(r)))
    try:
        names = None if value is None else json.loads(value)
    except ValueError:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    return names


def standby_value(keys: RunKeys, name: str, r: int) -> str:
    """The stored value of ``name``'s standby record: parked for round r, since now."""
    return keys.sign(keys.standby(name), json.dumps({"round": r, "since": time.time()}))


def read_standby(store: dist.Store, keys: RunKeys, name: str) -> dict[str, object] | None:
    """``name``'s standby record; None when it is parked nowhere (or the record is not the job's)."""
    value = member_value(keys, keys.standby(name), _get(store, keys.standby(name)))
    try:
        record = None if value is None else json.loads(value)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
