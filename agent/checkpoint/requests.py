"""The checkpoint service's requests, parsed and range-checked (pure).

:func:`parse` turns an authenticated header (and its payload's length and sealing) into one
of the request types below, or raises :class:`BadRequest` saying what is wrong. Nothing a
request says reaches the keeper unchecked: every number is an integer (not a boolean, not a
float) within its range, every file name a plain name, every payload within its
operation's cap, and a header naming a field the operation does not have is refused (a
commit cannot bring a ring: the service uses the ring of the current rendezvous round).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kelastic.agent.checkpoint.plan import Source

__all__ = [
    "MAX_FILES",
    "MAX_ID",
    "MAX_PID",
    "MAX_RANK",
    "MAX_SIZE",
    "MAX_WAIT",
    "BadRequest",
    "Begin",
    "Commit",
    "Done",
    "Get",
    "InventoryRequest",
    "MetadataRequest",
    "Open",
    "Put",
    "Request",
    "Restored",
    "check_name",
    "parse",
]

#: Checkpoint numbers are 1 .. MAX_ID (they grow by one per save).
MAX_ID = 2**62
#: Ranks of a job: 0 .. MAX_RANK - 1.
MAX_RANK = 2**24
#: Linux's largest process id (PID_MAX_LIMIT).
MAX_PID = 2**22
#: A file, an offset or a reservation: at most this many bytes (1 PiB).
MAX_SIZE = 2**50
#: Files a checkpoint may consist of (one per rank that wrote bytes).
MAX_FILES = 2**20
#: Seconds a ``begin`` may wait for the previous checkpoint's replica.
MAX_WAIT = 3600.0
#: A step number, like a checkpoint number, fits in 63 bits.
_MAX_STEP = 2**62

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


class BadRequest(ValueError):
    """A request the service refuses without acting on it (the reply says why)."""


@dataclass(frozen=True)
class Begin:
    rank: int
    nbytes: int
    timeout: float
    pid: int


@dataclass(frozen=True)
class Open:
    id: int
    name: str
    size: int
    rank: int


@dataclass(frozen=True)
class Done:
    rank: int


@dataclass(frozen=True)
class Commit:
    """Its payload (the metadata, sealed) follows the header."""

    id: int
    required: dict[str, int]
    step: int | None
    length: int


@dataclass(frozen=True)
class Put:
    """Its payload (a replica of a part, ``size`` bytes) follows the header."""

    id: int
    name: str
    size: int
    #: The endpoint of the node that sends it, as on the round's ring (``from``).
    sender: str | None = None


@dataclass(frozen=True)
class InventoryRequest:
    #: a worker's restore: after this node's pulls under way (``prefetch``)
    wait: bool = False
    #: a worker's word on pulls ahead of its restores: False when its restores copy a peer's
    #: live state (a roll-forward) and need none; None says nothing
    pull: bool | None = None


@dataclass(frozen=True)
class MetadataRequest:
    id: int


@dataclass(frozen=True)
class Get:
    id: int
    name: str
    offset: int
    length: int


@dataclass(frozen=True)
class Restored:
    id: int
    source: Source
    seconds: float
    step: int | None
    pid: int
    #: bytes the rank read from its own node's memory, and fetched from other nodes
    local: int = 0
    fetched: int = 0


Request = Begin | Open | Done | Commit | Put | InventoryRequest | MetadataRequest | Get | Restored

_FIELDS: dict[str, frozenset[str]] = {
    "begin": frozenset({"rank", "bytes", "timeout", "pid"}),
    "open": frozenset({"id", "name", "size", "rank"}),
    "done": frozenset({"rank"}),
    "commit": frozenset({"id", "required", "step"}),
    "put": frozenset({"id", "name", "from"}),
    "inventory": frozenset({"wait", "pull"}),
    "metadata": frozenset({"id"}),
    "get": frozenset({"id", "name", "offset", "length"}),
    "restored": frozenset({"id", "source", "seconds", "step", "pid", "local", "fetched"}),
}


def _int(h: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    value = h.get(key)
    if type(value) is not int:
        raise BadRequest(f"{key} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise BadRequest(f"{key}={value} is out of range {lo}..{hi}")
    return value


def _optional_int(h: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    return None if h.get(key) is None else _int(h, key, lo, hi)


def _seconds(h: Mapping[str, Any], key: str, hi: float) -> float:
    value = h.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"{key} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or not 0 <= value <= hi:
        raise BadRequest(f"{key}={value!r} is out of range 0..{hi:g} seconds")
    return float(value)


def _sender(value: object) -> str | None:
    """A replica's ``from``: absent, or an endpoint ``HOST:PORT`` of at most 300 characters."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 300 or ":" not in value:
        raise BadRequest(f"from must be the sender's endpoint HOST:PORT, got {value!r:.80}")
    return value


def check_name(name: object) -> str:
    """A part's file name: a plain name (no path, not hidden, at most 128 characters)."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise BadRequest(f"not a checkpoint file name: {name!r}")
    return name


def _required(value: object) -> dict[str, int]:
    if not isinstance(value, dict):
        raise BadRequest("required must be a map of file name to bytes")
    if len(value) > MAX_FILES:
        raise BadRequest(f"required names {len(value)} files; at most {MAX_FILES}")
    out: dict[str, int] = {}
    for name, size in value.items():
        if type(size) is not int or not 0 <= size <= MAX_SIZE:
            raise BadRequest(f"required[{name!r}] must be a size in bytes, got {size!r}")
        out[check_name(name)] = size
    return out


def parse(
    header: Mapping[str, Any], length: int, sealed: bool, *, max_metadata: int, max_part: int
) -> Request:
    """The request ``header`` describes (with a payload of ``length`` bytes, ``sealed`` or
    not); BadRequest for anything out of the rules (module docstring)."""
    op = header.get("op")
    fields = _FIELDS.get(op) if isinstance(op, str) else None
    if fields is None:
        raise BadRequest(f"unknown operation {op!r}")
    extra = sorted(set(header) - fields - {"op"})
    if extra:
        raise BadRequest(f"{op} takes no {', '.join(extra)}")
    if op == "commit":
        if not 0 < length <= max_metadata:
            raise BadRequest(f"a commit's metadata is 1..{max_metadata} bytes, got {length}")
        if not sealed:
            raise BadRequest("a commit's metadata must be sealed")
        return Commit(
            _int(header, "id", 1, MAX_ID),
            _required(header.get("required")),
            _optional_int(header, "step", -_MAX_STEP, _MAX_STEP),
            length,
        )
    if op == "put":
        if length > max_part:
            raise BadRequest(f"a part of {length} bytes is more than this node holds ({max_part})")
        return Put(
            _int(header, "id", 1, MAX_ID), check_name(header.get("name")), length, _sender(header.get("from"))
        )
    if length:
        raise BadRequest(f"{op} takes no payload, got {length} bytes")
    if op == "begin":
        return Begin(
            _int(header, "rank", 0, MAX_RANK - 1),
            _int(header, "bytes", 0, MAX_SIZE),
            _seconds(header, "timeout", MAX_WAIT),
            _int(header, "pid", 1, MAX_PID),
        )
    if op == "open":
        return Open(
            _int(header, "id", 1, MAX_ID),
            check_name(header.get("name")),
            _int(header, "size", 0, MAX_SIZE),
            _int(header, "rank", 0, MAX_RANK - 1),
        )
    if op == "done":
        return Done(_int(header, "rank", 0, MAX_RANK - 1))
    if op == "inventory":
        wait = header.get("wait", False)
        if type(wait) is not bool:
            raise BadRequest(f"wait must be true or false, got {type(wait).__name__}")
        pull = header.get("pull")
        if pull is not None and type(pull) is not bool:
            raise BadRequest(f"pull must be true or false, got {type(pull).__name__}")
        return InventoryRequest(wait, pull)
    if op == "metadata":
        return MetadataRequest(_int(header, "id", 1, MAX_ID))
    if op == "get":
        return Get(
            _int(header, "id", 1, MAX_ID),
            check_name(header.get("name")),
            _int(header, "offset", 0, MAX_SIZE),
            _int(header, "length", 0, MAX_SIZE),
        )
    source = header.get("source")
    try:
        src = Source(source)
    except (TypeError, ValueError):
        raise BadRequest(f"source must be one of {[s.value for s in Source]}, got {source!r}") from None
    return Restored(
        _int(header, "id", 1, MAX_ID),
        src,
        _seconds(header, "seconds", 10.0**9),
        _optional_int(header, "step", -_MAX_STEP, _MAX_STEP),
        _int(header, "pid", 1, MAX_PID),
        _optional_int(header, "local", 0, 2**62) or 0,
        _optional_int(header, "fetched", 0, 2**62) or 0,
    )
