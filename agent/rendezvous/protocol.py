"""The kelastic rendezvous protocol: key layout, store primitives and the close rule.

Everything the agents (``handler``), the operator (``control``) and the store
process (``server``) agree on lives here, so the layout of the store is written
down exactly once. See ``kelastic.agent.rendezvous.handler`` for the algorithm
that uses these keys.

Key layout (all under ``kelastic/<run_id>/``)::

    incarnation              random token set once per store lifetime (detects a restarted store)
    closed                   present once the job is finished (``set_closed``)
    ev                       event counter; ``ev/<n>`` is set for event n (wakes every watcher);
                             its value says what happened, e.g. ``closed <R> <value of r/R/size>``
    open                     counter; the round open for joining is ``open + 1`` (with a job
                             secret, only when the round ``open`` names has a signed close)
    latest                   the latest round closed, signed (read when ``open`` was moved)
    r/<R>/joined             counter; ``add`` returns the joiner's slot + 1 (slot = group rank);
                             ``SEALED`` in a round re-established on a restarted store (every
                             later joiner of R gets a slot past its size: it came too late)
    r/<R>/restored           counter of the members of R that re-established it on a restarted store
    r/<R>/node/<slot>        JSON {"name", "addr", "link", "local_world_size", "wstore"} of the
                             node in that slot; slot 0 (always rank 0) adds "wstore", the port of
                             the round's worker store it hosts
    r/<R>/slot/<name>        the slot ``name`` took in round R
    r/<R>/size               "N|closer|token|addr|port" once round R is closed with members in
                             slots 0..N-1: the closer's name and its handler's token (to know its
                             own win), then rank 0's worker store (port 0: not known to the closer)
    r/<R>/members            JSON list of member names by rank (written by the closer)
    r/<R>/fate/<name>        first claim wins: rejoin | dead | left | dropped (+ "|claimer")
    r/<R>/accounted          counter of members of R with a claimed fate
    r/<R>/fated/<i>          signed names of the members whose fate was claimed (how the
                             fates are found in a round re-established without a member's
                             join record)
    r/<R>/gone               counter of members of R with a fate other than rejoin
    r/<R>/leaving            counter of members of R that announced they are stopping their
                             workers to leave (before their fate ``left``)
    r/<R>/parked             counter of the nodes that parked (waited without a slot) for round R
    r/<R>/claimed            counter: places of round R claimed by parked nodes (``add`` hands the
                             claimer its ordinal; a claim past the places is given back with -1)
    r/<R>/arrived            counter of the claimers that took their slot in round R
    standby/<name>           JSON {"round", "since"} while ``name`` is parked as a standby, waiting
                             for round R without a slot (deleted when it takes one)
    hb/<name>                heartbeat counter, incremented by the node every keep-alive interval
    ctl/membership           JSON from the controller: {"nodes", "min_nodes", "max_nodes"}
    ctl/bounds               JSON {"min_nodes", "max_nodes", "count"}: the same without the names
    ctl/listed/<name>        present while the controller lists ``name``
    progress/<name>          JSON progress report of a node, signed (``control.publish_progress``)
    straggler                JSON straggler verdict of the group's rank 0, signed
                             (``control.publish_straggler``)
    agent/<R>/...            keys of the agent's own algorithms for round R (RendezvousInfo.store)

Every node reads O(1) keys of O(1) size per round; only a few nodes (the
*deciders*, slots 0-2 of the open round, and the joiner whose join completed
the controller's count) read O(N) data, and only when the round may close.

Standbys: a node that is no member of the current round R takes a slot in the
open round R+1 only for one of its *places*: ``max - (size(R) - gone(R))``, the
members R lost (dead, left, dropped) plus the room left under ``max`` (a node
started with ``standby=1`` takes only the places of lost members). It claims a
place with ``add(r/<R+1>/claimed, 1)`` (an ordinal past the places is given back)
and takes its slot; while no place is free it *parks*: it holds no slot and no
rank, counts itself once in ``r/<R+1>/parked``, writes ``standby/<name>`` and
waits for events (a loss, a scale, a close), warm and without a deadline. So a
full group is never re-formed by a node that arrives, and the loss of a member
is replaced in the same re-form by a parked node (:mod:`.standby` decides).
"""

from __future__ import annotations

import datetime
import enum
import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from .memberrecords import beat, members_value, slot_value
from .records import MARK, RecordSigner

_T = TypeVar("_T")

__all__ = [
    "CONTROLLER_DROPPED",
    "JOB_CLOSED_EVENT",
    "RECONNECT_TIMEOUT",
    "CloseAction",
    "CloseDecision",
    "ControllerBounds",
    "ControllerMembership",
    "Fate",
    "RoundClose",
    "RoundView",
    "RunKeys",
    "TimerKind",
    "claim_fate",
    "close_event",
    "connect_store",
    "controller_value",
    "count_fates",
    "decide_close",
    "fate_claimed",
    "fate_value",
    "first_line",
    "get_or_none",
    "job_closed",
    "listed",
    "mark_closed",
    "new_token",
    "node_record",
    "open_round",
    "parse_close_event",
    "parse_endpoint",
    "push_event",
    "read_bounds",
    "read_close",
    "read_counter",
    "read_fate",
    "read_fates",
    "read_membership",
    "read_optional",
    "read_size",
    "reconnect_backoff",
    "restore_round",
    "round_close",
    "round_moved_on",
    "set_job_closed",
]

KEY_ROOT = "kelastic"


class Fate(str, enum.Enum):
    """What became of a member of a closed round (claimed once, first claim wins)."""

    REJOIN = "rejoin"  # it joined the next round
    DEAD = "dead"  # its heartbeat stopped
    LEFT = "left"  # it shut down gracefully
    DROPPED = "dropped"  # the controller no longer lists it


@dataclass(frozen=True)
class RunKeys:
    """Names of every key of one rendezvous run (``kelastic/<run_id>/...``), and the signer of
    its records (:mod:`.records`; without a job secret, one that signs nothing)."""

    run_id: str
    signer: RecordSigner = field(default_factory=lambda: RecordSigner(None), compare=False, repr=False)
    #: A controlled run (rdzv-conf ``controlled=1``): with a job secret, the controller's
    #: records (``ctl/...`` and its ``dropped`` fates) are taken only when signed by the job.
    controlled: bool = field(default=False, compare=False)

    @property
    def controller_signed(self) -> bool:
        """Whether the controller's records must carry the job's MAC (controlled, with a secret)."""
        return self.controlled and self.signer.signing

    @property
    def prefix(self) -> str:
        return f"{KEY_ROOT}/{self.run_id}/"

    def name(self, key: str) -> str:
        """A key's name under the run's prefix: what a record's MAC covers (with the run in the key)."""
        return f"{self.run_id}:{key[len(self.prefix) :] if key.startswith(self.prefix) else key}"

    def sign(self, key: str, value: str) -> str:
        return self.signer.sign(self.name(key), value)

    def verify(self, key: str, stored: bytes | str | None) -> bytes | None:
        """The value of a record read from ``key``, None when absent or not signed by the job."""
        return self.signer.open(self.name(key), stored)

    def _k(self, rest: str) -> str:
        return self.prefix + rest

    @property
    def incarnation(self) -> str:
        return self._k("incarnation")

    @property
    def closed(self) -> str:
        return self._k("closed")

    @property
    def events(self) -> str:
        return self._k("ev")

    def event(self, n: int) -> str:
        return self._k(f"ev/{n}")

    @property
    def open(self) -> str:
        return self._k("open")

    @property
    def latest(self) -> str:
        return self._k("latest")

    def joined(self, r: int) -> str:
        return self._k(f"r/{r}/joined")

    def node(self, r: int, slot: int) -> str:
        return self._k(f"r/{r}/node/{slot}")

    def slot(self, r: int, name: str) -> str:
        return self._k(f"r/{r}/slot/{name}")

    def size(self, r: int) -> str:
        return self._k(f"r/{r}/size")

    def members(self, r: int) -> str:
        return self._k(f"r/{r}/members")

    def restored(self, r: int) -> str:
        return self._k(f"r/{r}/restored")

    def fate(self, r: int, name: str) -> str:
        return self._k(f"r/{r}/fate/{name}")

    def accounted(self, r: int) -> str:
        return self._k(f"r/{r}/accounted")

    def fated(self, r: int, i: int) -> str:
        return self._k(f"r/{r}/fated/{i}")

    def gone(self, r: int) -> str:
        return self._k(f"r/{r}/gone")

    def leaving(self, r: int) -> str:
        return self._k(f"r/{r}/leaving")

    def finished(self, r: int, rank: int) -> str:
        return self._k(f"r/{r}/finished/{rank}")

    def finished_count(self, r: int) -> str:
        return self._k(f"r/{r}/finished")

    def parked(self, r: int) -> str:
        return self._k(f"r/{r}/parked")

    def claimed(self, r: int) -> str:
        return self._k(f"r/{r}/claimed")

    def arrived(self, r: int) -> str:
        return self._k(f"r/{r}/arrived")

    def standby(self, name: str) -> str:
        return self._k(f"standby/{name}")

    def heartbeat(self, name: str) -> str:
        return self._k(f"hb/{name}")

    @property
    def membership(self) -> str:
        return self._k("ctl/membership")

    @property
    def bounds(self) -> str:
        return self._k("ctl/bounds")

    def listed(self, name: str) -> str:
        return self._k(f"ctl/listed/{name}")

    def progress(self, name: str) -> str:
        return self._k(f"progress/{name}")

    def straggler(self) -> str:
        return self._k("straggler")

    def agent_prefix(self, r: int) -> str:
        return self._k(f"agent/{r}/")


@dataclass(frozen=True)
class ControllerMembership:
    """What the controller (operator) published: the nodes it considers alive and the bounds."""

    nodes: tuple[str, ...]
    min_nodes: int
    max_nodes: int

    def to_json(self) -> str:
        return json.dumps(
            {"nodes": list(self.nodes), "min_nodes": self.min_nodes, "max_nodes": self.max_nodes}
        )

    @staticmethod
    def from_json(raw: bytes | str) -> ControllerMembership:
        data = json.loads(raw)
        return ControllerMembership(tuple(data["nodes"]), int(data["min_nodes"]), int(data["max_nodes"]))


@dataclass(frozen=True)
class ControllerBounds:
    """The controller's membership without the names: what every node reads (O(1) bytes)."""

    min_nodes: int
    max_nodes: int
    count: int  # how many nodes the controller lists

    def to_json(self) -> str:
        return json.dumps({"min_nodes": self.min_nodes, "max_nodes": self.max_nodes, "count": self.count})

    @staticmethod
    def from_json(raw: bytes | str) -> ControllerBounds:
        data = json.loads(raw)
        return ControllerBounds(int(data["min_nodes"]), int(data["max_nodes"]), int(data["count"]))


def first_line(exc: BaseException) -> str:
    """The first line of an exception message (torch store errors carry C++ backtraces)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def new_token() -> str:
    return secrets.token_hex(8)


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """Split ``host[:port]`` (``[v6]:port`` too); raise ValueError naming the bad endpoint."""
    text = endpoint.strip()
    if not text:
        raise ValueError("the rendezvous endpoint is empty; pass --rdzv-endpoint HOST:PORT")
    host, port_text = text, ""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError(f"rendezvous endpoint {endpoint!r}: unterminated '[' in IPv6 address")
        host, rest = text[1:close], text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"rendezvous endpoint {endpoint!r}: expected ':PORT' after ']'")
            port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    if not port_text:
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"rendezvous endpoint {endpoint!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"rendezvous endpoint {endpoint!r}: port {port} is outside 1..65535")
    return host, port


def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A client of the store at host:port; RendezvousConnectionError naming it if unreachable."""
    try:
        return dist.TCPStore(
            host,
            port,
            None,
            False,
            datetime.timedelta(seconds=max(timeout, 0.1)),
        )
    except (dist.DistError, RuntimeError, OSError) as exc:
        raise RendezvousConnectionError(
            f"could not reach the kelastic rendezvous store at {host}:{port} within {timeout:.1f}s: "
            f"{first_line(exc)}. Is `kelastic-rendezvous --host {host} --port {port}` running and "
            "reachable from this node?"
        ) from exc


#: Background threads retry a lost store with this connect timeout and a capped back-off.
RECONNECT_TIMEOUT = 2.0


def reconnect_backoff(failures: int) -> float:
    """Seconds before a background thread's next try after ``failures`` failed ones."""
    # Capped at 1 s: once a restarted store is back, every live node's keep-alive beats
    # there within a few seconds, well inside the heartbeat timeout its ring predecessor
    # applies to a heartbeat that is not there yet.
    return min(1.0, 0.1 * 2.0 ** min(failures, 6))


def read_counter(store: dist.Store, key: str) -> int:
    """Current value of an ``add`` counter (0 if never added)."""
    return int(store.add(key, 0))


def read_optional(store: dist.Store, key: str) -> bytes | None:
    """The value of ``key`` or None, without blocking on a missing key."""
    if not store.check([key]):
        return None
    return store.get(key)


#: A value no key ever holds: ``compare_set(key, _ABSENT, _ABSENT)`` reads without writing.
_ABSENT = "\x00absent"


def get_or_none(store: dist.Store, key: str) -> bytes | None:
    """The value of ``key`` or None in ONE round trip (``read_optional`` takes two).

    A compare-and-set whose expected value no key holds never writes: on a missing
    key it returns the expected value, else the current one. Only for keys nobody
    waits for: torch's libuv store (the default) wakes every client waiting for the
    key on any compare-and-set, even one that wrote nothing, and their read then
    finds no value.
    """
    got = store.compare_set(key, _ABSENT, _ABSENT)
    raw = got if isinstance(got, bytes) else str(got).encode()
    return None if raw == _ABSENT.encode() else raw


def open_round(store: dist.Store, keys: RunKeys) -> int:
    """The round currently open for joining (rounds are numbered from 1): the one after the
    latest closed round.

    Without a job secret, ``open`` + 1. With one, only signed closes count, since anyone may
    add to ``open``: its count is taken when the job signed that round's close, else (a
    count a stranger moved) the latest round the job marked closed (``latest``, signed); from
    either, rounds whose signed close is there already are passed over (a close whose count
    is not in yet, or a stale mark), so a moved counter costs reads, never a wrong round.
    """
    count = read_counter(store, keys.open)
    if not keys.signer.signing:
        return count + 1
    r = count if count > 0 and read_close(store, keys, count) is not None else _latest_closed(store, keys)
    while read_close(store, keys, r + 1) is not None:
        r += 1
    return r + 1


def _latest_closed(store: dist.Store, keys: RunKeys) -> int:
    """The latest round the job marked closed (``latest``), 0 when there is no signed mark."""
    value = keys.verify(keys.latest, read_optional(store, keys.latest))
    try:
        return max(0, int(value)) if value is not None else 0
    except ValueError:
        return 0


def mark_closed(store: dist.Store, keys: RunKeys, r: int) -> None:
    """Count round r closed: ``open`` (for every reader) and the signed ``latest`` mark (for
    readers that find ``open`` moved by someone else; see :func:`open_round`)."""
    store.add(keys.open, 1)
    if keys.signer.signing:
        store.set(keys.latest, keys.sign(keys.latest, str(r)))


@dataclass(frozen=True)
class RoundClose:
    """What closing a round fixed: its size, and rank 0's worker store (the closer read it).

    ``master_port`` 0: rank 0 had not published its worker store when the round
    closed; members then read it from rank 0's record.
    """

    size: int
    closer: str
    token: str
    master_addr: str = ""
    master_port: int = 0

    def to_value(self) -> str:
        """The value of ``r/<R>/size`` (and the tail of the round's close event)."""
        return f"{self.size}|{self.closer}|{self.token}|{self.master_addr}|{self.master_port}"

    @staticmethod
    def from_value(raw: bytes | str) -> RoundClose:
        text = raw.decode() if isinstance(raw, bytes) else raw
        parts = text.split("|")
        if len(parts) < 5:  # written without the worker store
            parts += [""] * (5 - len(parts))
        return RoundClose(int(parts[0]), parts[1], parts[2], parts[3], int(parts[4] or 0))


#: The event pushed by ``set_closed``: the job is finished.
JOB_CLOSED_EVENT = "closed-job"
#: Kind prefix of the event pushed when a round closes: ``closed <R> <RoundClose value>``.
_CLOSE_EVENT = "closed "


def close_event(r: int, close: RoundClose) -> str:
    """The event value announcing that round r closed: a woken waiter needs no further read."""
    return f"{_CLOSE_EVENT}{r} {close.to_value()}"


def parse_close_event(kind: bytes | str) -> tuple[int, RoundClose] | None:
    """(round, close) if ``kind`` announces a closed round, else None (any other event)."""
    text = kind.decode() if isinstance(kind, bytes) else kind
    if not text.startswith(_CLOSE_EVENT):
        return None
    try:
        r, value = text[len(_CLOSE_EVENT) :].split(" ", 1)
        return int(r), RoundClose.from_value(value)
    except ValueError:
        return None


def read_close(store: dist.Store, keys: RunKeys, r: int) -> RoundClose | None:
    """How round r closed, in one round trip; None while it is open (or r < 1)."""
    if r < 1:
        return None
    return round_close(keys, r, get_or_none(store, keys.size(r)))


def read_size(store: dist.Store, keys: RunKeys, r: int) -> int:
    """Number of members of round r, or 0 while it is still open (or r < 1)."""
    close = read_close(store, keys, r)
    return 0 if close is None else close.size


def push_event(store: dist.Store, keys: RunKeys, kind: str) -> int:
    """Wake every watcher of the run: take the next event number and set its key (signed)."""
    n = int(store.add(keys.events, 1))
    store.set(keys.event(n), keys.sign(keys.event(n), kind))
    return n


def set_job_closed(store: dist.Store, keys: RunKeys) -> None:
    """Mark the job finished (the ``closed`` key, signed) and tell every watcher."""
    store.set(keys.closed, keys.sign(keys.closed, "1"))
    push_event(store, keys, JOB_CLOSED_EVENT)


def job_closed(store: dist.Store, keys: RunKeys) -> bool:
    """Whether the job is finished: a ``closed`` mark signed by the job (a stranger's is ignored)."""
    if not keys.signer.signing:
        return bool(store.check([keys.closed]))
    return keys.verify(keys.closed, get_or_none(store, keys.closed)) is not None


def node_record(keys: RunKeys, r: int, slot: int, stored: bytes | str | None) -> dict[str, object] | None:
    """The join record of ``slot`` in round r as the job's member wrote it; None when absent, not
    signed by the job (a stranger's) or not a record."""
    value = keys.verify(keys.node(r, slot), stored)
    if value is None:
        return None
    try:
        data = json.loads(value)
    except ValueError:
        return None
    return data if isinstance(data, dict) and "name" in data else None


def round_close(keys: RunKeys, r: int, stored: bytes | str | None) -> RoundClose | None:
    """How round r closed, from ``r/<R>/size`` as the job's closer wrote it (else None: open)."""
    value = keys.verify(keys.size(r), stored)
    if value is None:
        return None
    try:
        return RoundClose.from_value(value)
    except (ValueError, UnicodeDecodeError):
        return None


#: The value of a fate the controller claims (``control.publish_membership``), before its MAC.
CONTROLLER_DROPPED = b"dropped|controller"


def fate_value(store: dist.Store, keys: RunKeys, key: str, stored: bytes | str | None) -> bytes | None:
    """The value of a fate read from ``key`` when the job claimed it; None when absent or a
    stranger's. A node that does not require the controller's records signed
    (:attr:`RunKeys.controller_signed`) also takes the controller's unsigned ``dropped`` when a
    controller published its bounds (a controller without the job's secret)."""
    if (
        stored is not None
        and _bytes(stored) == CONTROLLER_DROPPED
        and not keys.controller_signed
        and (keys.controlled or get_or_none(store, keys.bounds) is not None)
    ):
        return CONTROLLER_DROPPED
    return keys.verify(key, stored)


def read_fate(store: dist.Store, keys: RunKeys, r: int, name: str) -> Fate | None:
    """The fate of member ``name`` of round r as claimed by the job (one not signed: None)."""
    value = fate_value(store, keys, keys.fate(r, name), get_or_none(store, keys.fate(r, name)))
    if value is None:
        return None
    try:
        return Fate(value.decode().split("|", 1)[0])
    except ValueError:
        return None


def read_fates(store: dist.Store, keys: RunKeys, r: int, size: int, *, first: bool = False) -> list[Fate]:
    """The signed fates of round r's members (the names from their join records); O(size) reads.
    ``first``: stop at the first one found.

    What the counters ``accounted`` and ``gone`` claim, checked: anyone may add to a counter.
    """
    node_keys = [keys.node(r, i) for i in range(size)]
    if size < 1:
        return []
    if store.check(node_keys):
        records = [node_record(keys, r, i, raw) for i, raw in enumerate(store.multi_get(node_keys))]
        # A record that is not the member's own (a stranger's): that member's fate cannot be looked up.
        names = [str(rec["name"]) for rec in records if rec is not None]
    else:
        # A round re-established on a restarted store where a member's join record is not
        # back (that member never came back, or not yet): the claims name their members.
        names = _fated_names(store, keys, r, size)
    fates: list[Fate] = []
    for name in names:
        fate = read_fate(store, keys, r, name)
        if fate is not None:
            fates.append(fate)
            if first:
                break
    return fates


def _fated_names(store: dist.Store, keys: RunKeys, r: int, size: int) -> list[str]:
    """The names of round r's members whose fate was claimed, as the claimers signed them in
    ``r/<R>/fated/<i>`` (i < ``size``: a round has no more members; an entry the job did not
    sign is none)."""
    names: list[str] = []
    for i in range(size):
        key = keys.fated(r, i)
        value = keys.verify(key, read_optional(store, key))
        if value is not None and value.decode() not in names:
            names.append(value.decode())
    return names


def _index_fated(store: dist.Store, keys: RunKeys, r: int, name: str) -> None:
    """Put ``name`` in the first entry of ``r/<R>/fated/<i>`` that is free or not the job's
    (a stranger's bytes count as free, as for a fate); at most one entry per member, so the
    round's members fit below its size; bounded, should a job without a secret find every
    entry taken by names a stranger wrote)."""
    for i in range(1 << 16):
        key = keys.fated(r, i)
        mine = keys.sign(key, name)
        got = _bytes(store.compare_set(key, "", mine))
        if got == mine.encode():
            return
        held = keys.verify(key, got)
        if held is None and _bytes(store.compare_set(key, got, mine)) == mine.encode():  # type: ignore[arg-type]
            return
        if held is not None and held.decode() == name:
            return


def claim_fate(store: dist.Store, keys: RunKeys, r: int, name: str, fate: Fate, claimer: str) -> bool:
    """Record what became of member ``name`` of round r; only the first claim counts.

    The winner increments ``r/<R>/accounted`` and pushes an event when the claim
    changes what others wait for (any claim but a rejoin, and the first claim of a
    round, which tells the round's members it is no longer current).
    Returns whether this call won.
    """
    key = keys.fate(r, name)
    mine = keys.sign(key, f"{fate.value}|{claimer}")
    got = _bytes(store.compare_set(key, "", mine))
    if got != mine.encode() and (
        # A value the job did not sign (a stranger's, any bytes) counts as absent: take its place.
        fate_value(store, keys, key, got) is not None
        or _bytes(store.compare_set(key, got, mine)) != mine.encode()  # type: ignore[arg-type]
    ):
        return False
    # The member's name, indexed: a round re-established on a restarted store lacks the join
    # record of a member that never came back, which is where readers find names otherwise.
    _index_fated(store, keys, r, name)
    # A loss is counted in ``gone`` before ``accounted``, so that whoever reads
    # ``accounted`` and then ``gone`` sees every loss the first count includes.
    if fate is not Fate.REJOIN:
        store.add(keys.gone(r), 1)
    accounted = int(store.add(keys.accounted(r), 1))
    if fate is not Fate.REJOIN or accounted == 1:
        push_event(store, keys, f"{fate.value} {r} {name}")
    return True


def count_fates(store: dist.Store, keys: RunKeys, r: int, size: int) -> tuple[int, bool]:
    """Round r's (``size`` members) members accounted for, and whether one was lost (or is leaving).

    The counters first (``claim_fate`` counts a loss in ``gone`` before ``accounted``: read
    in this order, a loss ``accounted`` includes is always seen in ``gone``); with a job
    secret, what they claim is checked against the signed fates (anyone may add to a counter).
    """
    accounted = read_counter(store, keys.accounted(r))
    gone = read_counter(store, keys.gone(r))
    leaving = read_counter(store, keys.leaving(r))
    if (accounted > 0 or gone > 0) and keys.signer.signing:
        fates = read_fates(store, keys, r, size)
        accounted, gone = len(fates), sum(1 for f in fates if f is not Fate.REJOIN)
    return accounted, gone > 0 or leaving > 0


def fate_claimed(store: dist.Store, keys: RunKeys, r: int, size: int, *, seen: bool) -> bool:
    """Whether a fate was claimed in round r (``size`` members): its counter says so and, with a
    job secret, a signed fate does (``seen``: a signed fate event told it, no read needed)."""
    if read_counter(store, keys.accounted(r)) == 0:
        return False
    return not keys.signer.signing or seen or bool(read_fates(store, keys, r, size, first=True))


def round_moved_on(store: dist.Store, keys: RunKeys, r: int, size: int, *, seen: bool) -> bool:
    """Whether round r (``size`` members) is no longer current by the store: a newer round
    closed, or a fate was claimed in r (``seen``: see :func:`fate_claimed`). With a job secret
    only signed records count: anyone may add to ``open`` and the fates' counters."""
    if open_round(store, keys) > r + 1 and (
        not keys.signer.signing or read_close(store, keys, r + 1) is not None
    ):
        return True
    return fate_claimed(store, keys, r, size, seen=seen)


#: The value of ``r/<R>/joined`` in a re-established round: far past any round's size.
SEALED = 1 << 40


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _bytes(raw: bytes | str) -> bytes:
    return raw if isinstance(raw, bytes) else raw.encode()


def restore_round(
    store: dist.Store,
    keys: RunKeys,
    r: int,
    close: RoundClose,
    rank: int,
    record: str,
    names: Sequence[str] | None = None,
) -> bool:
    """Re-establish closed round r, of which this node is member ``rank``, on a restarted store.

    Called by every member that reaches a new store (a new ``incarnation``) with the
    round it belongs to; each call writes what the member knows, so the round is
    whole once every member came back: ``open`` raised to r (joiners go to r+1),
    ``r/<R>/joined`` sealed (a joiner of r comes too late), ``r/<R>/size`` with the
    very value the round closed with, the member's record and slot, its heartbeat,
    and the member list (from ``names`` when the caller closed the round, else by
    the member whose restore completed the count, from the records).

    False when the new store already holds another round r: a node joined r afresh
    before any member came back, or r closed differently. The round is then not
    current any more and its members re-form (as after any membership change).
    """
    cur = read_counter(store, keys.open)
    while cur < r:  # raise, never lower: a later round may be re-established already
        got = _text(store.compare_set(keys.open, str(cur), str(r)))
        cur = int(got) if got != str(r) else r
    if keys.signer.signing and _latest_closed(store, keys) < r:
        store.set(keys.latest, keys.sign(keys.latest, str(r)))
    # Absent, or 0 where a reader of the counter (the operator's status) created it.
    sealed = str(SEALED)
    if _text(store.compare_set(keys.joined(r), "", sealed)) != sealed and (
        _text(store.compare_set(keys.joined(r), "0", sealed)) != sealed
    ):
        return False  # a node joined r in this store: r is a new round here
    value = keys.sign(keys.size(r), close.to_value())
    held = _bytes(store.compare_set(keys.size(r), "", value))
    if held != value.encode() and (
        # A close the job did not sign (a stranger's) counts as absent: take its place.
        round_close(keys, r, held) is not None
        or _bytes(store.compare_set(keys.size(r), held, value)) != value.encode()  # type: ignore[arg-type]
    ):
        return False
    name = json.loads(record)["name"]
    signed = keys.sign(keys.node(r, rank), record)
    # torch implements Store.multi_set; its stubs do not declare it.
    store.multi_set([keys.node(r, rank), keys.slot(r, name)], [signed, slot_value(keys, r, name, rank)])  # type: ignore[attr-defined]
    beat(store, keys, name)
    count = int(store.add(keys.restored(r), 1))
    if names is not None:
        store.set(keys.members(r), members_value(keys, r, names))
    elif count == close.size:
        node_keys = [keys.node(r, i) for i in range(close.size)]
        if store.check(node_keys):
            records = [node_record(keys, r, i, v) for i, v in enumerate(store.multi_get(node_keys))]
            if all(rec is not None for rec in records):
                members = [str(rec["name"]) for rec in records if rec is not None]
                store.set(keys.members(r), members_value(keys, r, members))
    push_event(store, keys, f"restored {r} {name}")
    return True


def controller_value(keys: RunKeys, key: str, stored: bytes | str | None) -> bytes | None:
    """The value of the controller's record read from ``key``: with
    :attr:`RunKeys.controller_signed`, only when the job's key signed it (else None, counted as
    a refused record); otherwise its text, without a MAC if it carries one."""
    if stored is None:
        return None
    if keys.controller_signed:
        return keys.verify(key, stored)
    value, mark, _ = _bytes(stored).rpartition(MARK)
    return value if mark else _bytes(stored)


def read_membership(store: dist.Store, keys: RunKeys) -> ControllerMembership | None:
    """The controller's full membership (O(N) bytes: for the few nodes that decide); None when
    absent or not the controller's (:func:`controller_value`)."""
    raw = controller_value(keys, keys.membership, read_optional(store, keys.membership))
    return None if raw is None else _parsed(ControllerMembership.from_json, raw)


def read_bounds(store: dist.Store, keys: RunKeys) -> ControllerBounds | None:
    """The controller's bounds and node count in one round trip (None: no controller, or
    bounds that are not the controller's)."""
    raw = controller_value(keys, keys.bounds, get_or_none(store, keys.bounds))
    return None if raw is None else _parsed(ControllerBounds.from_json, raw)


def listed(store: dist.Store, keys: RunKeys, name: str) -> bool:
    """Whether the controller lists ``name`` (its ``ctl/listed/<name>``, signed where required)."""
    key = keys.listed(name)
    if not keys.controller_signed:
        return bool(store.check([key]))
    return controller_value(keys, key, get_or_none(store, key)) is not None


def _parsed(parse: Callable[[bytes], _T], raw: bytes) -> _T | None:
    """``parse(raw)``, None for a value that is no such record (garbage a stranger wrote)."""
    try:
        return parse(raw)
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------
# The close rule (pure)


class CloseAction(enum.Enum):
    WAIT = "wait"  # nothing to do until an event arrives
    CLOSE = "close"  # close now with ``size`` members
    TIMER = "timer"  # close with all joiners when the ``timer`` expires


class TimerKind(enum.Enum):
    LAST_CALL = "last_call"  # first round: wait a short while for more nodes once min is reached
    REJOIN = "rejoin"  # some members of the previous round are not yet accounted for
    CONTROLLER = "controller"  # the controller lists a node that has not joined


@dataclass(frozen=True)
class RoundView:
    """What a waiter observed about the open round and the round before it."""

    joined: int
    min_nodes: int
    max_nodes: int
    prev_size: int  # 0 if there is no previous round
    prev_accounted: int
    controlled: bool  # a controller membership is published
    # Every node the controller lists has joined or is known gone: it has a fate other
    # than rejoin in the previous round (dead, left, dropped). False if not controlled.
    listed_all_joined: bool
    # Standbys (read only without a controller, when the previous round lost members and
    # the round is below max): members of the previous round lost, nodes parked for this
    # round, places they claimed, and claimers that took their slot.
    prev_gone: int = 0
    parked: int = 0
    claimed: int = 0
    arrived: int = 0
    # A controlled node (``controlled=1``) in a store without the controller's bounds (one
    # restarted under it): nothing closes the round until the controller publishes them.
    awaiting_controller: bool = False

    @property
    def standbys_on_their_way(self) -> bool:
        """Parked nodes will take lost members' places here: the round waits for them.

        Only without a controller (with one, a listed standby that has not joined already
        holds the round). The places they fill: the members lost, at most what ``max``
        leaves beside the survivors and at most the nodes parked; a claim whose slot is
        not taken yet is on its way too.
        """
        if self.controlled or self.prev_gone <= 0 or self.joined >= self.max_nodes:
            return False
        survivors = self.prev_size - self.prev_gone
        expected = min(self.parked, self.prev_gone, max(0, self.max_nodes - survivors))
        return self.arrived < max(expected, self.claimed)


@dataclass(frozen=True)
class CloseDecision:
    action: CloseAction
    size: int = 0
    timer: TimerKind | None = None


def decide_close(view: RoundView) -> CloseDecision:
    """Whether the open round may close now, later (timer), or not yet.

    A round never closes while the previous round is intact (it has members and
    none of them is accounted for): nodes that arrive then are spare and wait.
    Nor while a controlled node does not know the controller's bounds: its own
    ``max`` may be above the controller's. Otherwise it closes at once when ``max``
    nodes joined, when every node the controller lists joined or is known gone (a
    dead node the controller still lists never delays the round), or when every
    member of the previous round is accounted for; else a timer starts once ``min``
    is reached.
    """
    if view.awaiting_controller or view.joined < 1 or (view.prev_size > 0 and view.prev_accounted == 0):
        return CloseDecision(CloseAction.WAIT)
    if view.joined >= view.max_nodes:
        return CloseDecision(CloseAction.CLOSE, size=view.max_nodes)
    if view.joined < view.min_nodes:
        return CloseDecision(CloseAction.WAIT)
    if view.standbys_on_their_way:
        # Parked standbys take the lost members' places in this very round; they were
        # woken by the same loss and are claiming them (bounded by the rejoin timer).
        return CloseDecision(CloseAction.TIMER, timer=TimerKind.REJOIN)
    if view.controlled:
        if view.listed_all_joined:
            return CloseDecision(CloseAction.CLOSE, size=view.joined)
        return CloseDecision(CloseAction.TIMER, timer=TimerKind.CONTROLLER)
    if view.prev_size > 0:
        if view.prev_accounted >= view.prev_size:
            return CloseDecision(CloseAction.CLOSE, size=view.joined)
        return CloseDecision(CloseAction.TIMER, timer=TimerKind.REJOIN)
    return CloseDecision(CloseAction.TIMER, timer=TimerKind.LAST_CALL)


def listed_all_joined(
    store: dist.Store, keys: RunKeys, r: int, joined: int, nodes: Sequence[str], wait: float = 0.0
) -> bool:
    """Whether each of ``nodes`` is in one of the first ``joined`` slots of round r or is gone.

    Gone: its fate in round r-1 is dead, left or dropped, whatever the controller
    still lists (the controller may be down and its list stale). O(N) data in two
    round trips plus one per listed node that did not join; callers first check
    the O(1) precondition ``joined + gone(r-1) >= len(nodes)``. A joiner's record
    that is not written yet is waited for up to ``wait`` seconds; then (or at once
    with ``wait`` 0) the answer is False and the deciders evaluate again later.
    """
    if not nodes:
        return False
    node_keys = [keys.node(r, i) for i in range(joined)]
    if node_keys and not store.check(node_keys):
        if wait <= 0:
            return False
        try:
            store.wait(node_keys, datetime.timedelta(seconds=wait))
        except dist.DistStoreError:
            return False
    records = (
        [node_record(keys, r, i, raw) for i, raw in enumerate(store.multi_get(node_keys))]
        if node_keys
        else []
    )
    here = {rec["name"] for rec in records if rec is not None}
    for name in nodes:
        if name in here:
            continue
        fate = read_fate(store, keys, r - 1, name) if r > 1 else None
        if fate is None or fate is Fate.REJOIN:
            return False
    return True
