"""The kelastic rendezvous protocol: key layout, store primitives and the close rule.

Everything the agents (``handler``), the operator (``control``) and the store
process (``server``) agree on lives here, so the layout of the store is written
down exactly once. See ``kelastic.agent.rendezvous.handler`` for the algorithm
that uses these keys.

Key layout (all under ``kelastic/<run_id>/``)::

    incarnation              random token set once per store lifetime (detects a restarted store)
    closed                   present once the job is finished (``set_closed``)
    ev                       event counter; ``ev/<n>`` is set for event n (wakes every watcher)
    open                     counter; the round open for joining is ``open + 1``
    r/<R>/joined             counter; ``add`` returns the joiner's slot + 1 (slot = group rank)
    r/<R>/node/<slot>        JSON {"name", "addr"} of the node in that slot
    r/<R>/slot/<name>        the slot ``name`` took in round R
    r/<R>/size               "N|closer" once round R is closed with members in slots 0..N-1
    r/<R>/members            JSON list of member names by rank (written by the closer)
    r/<R>/wstore             "addr:port" of the worker store hosted by rank 0 of round R
    r/<R>/fate/<name>        first claim wins: rejoin | dead | left | dropped (+ "|claimer")
    r/<R>/accounted          counter of members of R with a claimed fate
    hb/<name>                heartbeat counter, incremented by the node every keep-alive interval
    ctl/membership           JSON from the controller: {"nodes", "min_nodes", "max_nodes"}
    progress/<name>          JSON progress report of a node (see ``control``)
    agent/<R>/...            keys of the agent's own algorithms for round R (RendezvousInfo.store)
"""

from __future__ import annotations

import datetime
import enum
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

__all__ = [
    "CloseAction",
    "CloseDecision",
    "ControllerMembership",
    "Fate",
    "RoundView",
    "RunKeys",
    "TimerKind",
    "claim_fate",
    "connect_store",
    "decide_close",
    "first_line",
    "new_token",
    "open_round",
    "parse_endpoint",
    "push_event",
    "read_counter",
    "read_membership",
    "read_optional",
    "read_size",
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
    """Names of every key of one rendezvous run (``kelastic/<run_id>/...``)."""

    run_id: str

    @property
    def prefix(self) -> str:
        return f"{KEY_ROOT}/{self.run_id}/"

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

    def worker_store(self, r: int) -> str:
        return self._k(f"r/{r}/wstore")

    def fate(self, r: int, name: str) -> str:
        return self._k(f"r/{r}/fate/{name}")

    def accounted(self, r: int) -> str:
        return self._k(f"r/{r}/accounted")

    def heartbeat(self, name: str) -> str:
        return self._k(f"hb/{name}")

    @property
    def membership(self) -> str:
        return self._k("ctl/membership")

    def progress(self, name: str) -> str:
        return self._k(f"progress/{name}")

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


def read_counter(store: dist.Store, key: str) -> int:
    """Current value of an ``add`` counter (0 if never added)."""
    return int(store.add(key, 0))


def read_optional(store: dist.Store, key: str) -> bytes | None:
    """The value of ``key`` or None, without blocking on a missing key."""
    if not store.check([key]):
        return None
    return store.get(key)


def open_round(store: dist.Store, keys: RunKeys) -> int:
    """The round currently open for joining (rounds are numbered from 1)."""
    return read_counter(store, keys.open) + 1


def read_size(store: dist.Store, keys: RunKeys, r: int) -> int:
    """Number of members of round r, or 0 while it is still open (or r < 1)."""
    if r < 1:
        return 0
    raw = read_optional(store, keys.size(r))
    if raw is None:
        return 0
    return int(raw.decode().split("|", 1)[0])


def push_event(store: dist.Store, keys: RunKeys, kind: str) -> int:
    """Wake every watcher of the run: take the next event number and set its key."""
    n = int(store.add(keys.events, 1))
    store.set(keys.event(n), kind)
    return n


def claim_fate(store: dist.Store, keys: RunKeys, r: int, name: str, fate: Fate, claimer: str) -> bool:
    """Record what became of member ``name`` of round r; only the first claim counts.

    The winner increments ``r/<R>/accounted`` and pushes an event when the claim
    changes what others wait for (any claim but a rejoin, and the first claim of a
    round, which tells the round's members it is no longer current).
    Returns whether this call won.
    """
    mine = f"{fate.value}|{claimer}"
    got = store.compare_set(keys.fate(r, name), "", mine)
    if (got.decode() if isinstance(got, bytes) else got) != mine:
        return False
    accounted = int(store.add(keys.accounted(r), 1))
    if fate is not Fate.REJOIN or accounted == 1:
        push_event(store, keys, f"{fate.value} {r} {name}")
    return True


def read_membership(store: dist.Store, keys: RunKeys) -> ControllerMembership | None:
    raw = read_optional(store, keys.membership)
    return None if raw is None else ControllerMembership.from_json(raw)


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
    listed_all_joined: bool  # every node the controller lists has joined (False if not controlled)


@dataclass(frozen=True)
class CloseDecision:
    action: CloseAction
    size: int = 0
    timer: TimerKind | None = None


def decide_close(view: RoundView) -> CloseDecision:
    """Whether the open round may close now, later (timer), or not yet.

    A round never closes while the previous round is intact (it has members and
    none of them is accounted for): nodes that arrive then are spare and wait.
    Otherwise it closes at once when ``max`` nodes joined, when the controller's
    listed nodes all joined, or when every member of the previous round is
    accounted for; else a timer starts once ``min`` is reached.
    """
    if view.joined < 1 or (view.prev_size > 0 and view.prev_accounted == 0):
        return CloseDecision(CloseAction.WAIT)
    if view.joined >= view.max_nodes:
        return CloseDecision(CloseAction.CLOSE, size=view.max_nodes)
    if view.joined < view.min_nodes:
        return CloseDecision(CloseAction.WAIT)
    if view.controlled:
        if view.listed_all_joined:
            return CloseDecision(CloseAction.CLOSE, size=view.joined)
        return CloseDecision(CloseAction.TIMER, timer=TimerKind.CONTROLLER)
    if view.prev_size > 0:
        if view.prev_accounted >= view.prev_size:
            return CloseDecision(CloseAction.CLOSE, size=view.joined)
        return CloseDecision(CloseAction.TIMER, timer=TimerKind.REJOIN)
    return CloseDecision(CloseAction.TIMER, timer=TimerKind.LAST_CALL)


def listed_all_joined(store: dist.Store, keys: RunKeys, r: int, nodes: Sequence[str]) -> bool:
    return bool(nodes) and bool(store.check([keys.slot(r, n) for n in nodes]))
