"""The checkpoint service's decisions, as pure functions over what the nodes hold.

Which checkpoint a restarted group restores (:func:`choose_restore`), which nodes hold a
node's replicas (:func:`successors` on the ring, :func:`standby_holders` on the hot
standbys, both together :meth:`ReplicaPlan.holders`), the next checkpoint's number
(:func:`next_id`) and whether a save fits in a node's memory (:func:`memory_needed`). No I/O: the service and the
storage classes gather the facts and apply the answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "HeldCheckpoint",
    "Inventory",
    "ReplicaPlan",
    "RestoreChoice",
    "Source",
    "StandbyHolder",
    "choose_restore",
    "memory_needed",
    "next_id",
    "replica_refusal",
    "standby_holders",
    "successors",
]


class Source(str, Enum):
    """Where a restored checkpoint came from, as the agent reports it."""

    #: Every part from the memory of the node that wrote it.
    MEMORY = "memory"
    #: At least one part only from a peer's replica (its writer is gone).
    REPLICA = "replica"
    #: The durable directory.
    DURABLE = "durable"


@dataclass(frozen=True)
class HeldCheckpoint:
    """What one node holds of checkpoint ``id``.

    ``files``: complete files held (name -> bytes), its own and replicas alike;
    ``replicas``: which of them are copies of another node's part; ``required``: the
    checkpoint's manifest (every file it consists of), known once the node has its metadata,
    that is once the checkpoint was committed; ``step``: the training step it was saved at,
    when the script said so.
    """

    id: int
    files: Mapping[str, int]
    replicas: frozenset[str] = frozenset()
    required: Mapping[str, int] | None = None
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "files": dict(self.files),
            "replicas": sorted(self.replicas),
            "required": None if self.required is None else dict(self.required),
            "step": self.step,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HeldCheckpoint:
        required = d.get("required")
        return cls(
            id=int(d["id"]),
            files={str(k): int(v) for k, v in dict(d.get("files") or {}).items()},
            replicas=frozenset(str(x) for x in d.get("replicas") or ()),
            required=None if required is None else {str(k): int(v) for k, v in dict(required).items()},
            step=None if d.get("step") is None else int(d["step"]),
        )


@dataclass(frozen=True)
class Inventory:
    """One node's answer to "what can you give a restoring group?"."""

    node: str
    endpoint: str
    held: tuple[HeldCheckpoint, ...] = ()
    #: Complete durable copies this node can read: (checkpoint id, directory).
    durable: tuple[tuple[int, str], ...] = ()
    #: The newest checkpoint number this node has seen (held, begun, restored or durable).
    newest: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "endpoint": self.endpoint,
            "held": [h.to_json() for h in self.held],
            "durable": [[i, p] for i, p in self.durable],
            "newest": self.newest,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Inventory:
        return cls(
            node=str(d["node"]),
            endpoint=str(d["endpoint"]),
            held=tuple(HeldCheckpoint.from_json(h) for h in d.get("held") or ()),
            durable=tuple((int(i), str(p)) for i, p in d.get("durable") or ()),
            newest=int(d.get("newest") or 0),
        )


@dataclass(frozen=True)
class RestoreChoice:
    """The checkpoint a group restores, and where each of its files can be read.

    ``holders`` maps every file of a memory checkpoint to the endpoints of the nodes that
    hold it, the writer's own copy first; ``metadata_from`` lists the endpoints holding its
    metadata. For a durable choice both are empty and ``durable_path`` names the directory
    (readable with torch.distributed.checkpoint's ``FileSystemReader`` alone).
    """

    id: int
    source: Source
    holders: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    metadata_from: tuple[str, ...] = ()
    durable_path: str | None = None
    step: int | None = None

    def describe(self) -> str:
        where = {
            Source.MEMORY: "the nodes' memory",
            Source.REPLICA: "memory, with parts from peers' replicas",
            Source.DURABLE: f"the durable directory {self.durable_path}",
        }[self.source]
        step = f" (step {self.step})" if self.step is not None else ""
        return f"checkpoint {self.id}{step} from {where}"


def choose_restore(inventories: Sequence[Inventory]) -> RestoreChoice | None:
    """The newest complete checkpoint the group can reach, or None when there is none.

    A checkpoint in memory is complete when some node holds its metadata (it was committed,
    which happens only after every rank's part was written) and every file its manifest
    names is held, whole, by some node of the group. A durable copy is complete by
    construction (it appears under its final name only once whole). The newest number wins;
    on a tie memory beats the durable directory (it is faster to read). Deterministic: every
    rank computing it from the same inventories gets the same answer.
    """
    best: RestoreChoice | None = None
    manifests: dict[int, tuple[Mapping[str, int], int | None]] = {}
    for inv in inventories:
        for h in inv.held:
            if h.required is not None and h.id not in manifests:
                manifests[h.id] = (h.required, h.step)
    for cid in sorted(manifests, reverse=True):
        required, step = manifests[cid]
        own: dict[str, list[str]] = {}
        copies: dict[str, list[str]] = {}
        meta: list[str] = []
        for inv in inventories:
            for h in inv.held:
                if h.id != cid:
                    continue
                if h.required is not None:
                    meta.append(inv.endpoint)
                for name, size in h.files.items():
                    if required.get(name) is not None and size >= required[name]:
                        (copies if name in h.replicas else own).setdefault(name, []).append(inv.endpoint)
        if all(name in own or name in copies for name in required):
            holders = {
                name: tuple(own.get(name, []))
                + tuple(e for e in copies.get(name, []) if e not in own.get(name, []))
                for name in sorted(required)
            }
            source = Source.MEMORY if all(name in own for name in required) else Source.REPLICA
            best = RestoreChoice(cid, source, holders, tuple(meta), None, step)
            break
    durable = max((d for inv in inventories for d in inv.durable), default=None)
    if durable is not None and (best is None or durable[0] > best.id):
        return RestoreChoice(durable[0], Source.DURABLE, durable_path=durable[1])
    return best


def successors(ring: Sequence[str], me: str, replicas: int) -> list[str]:
    """The nodes after ``me`` on the ring that hold copies of its part (pure).

    The ring is the group's nodes in rank order; ``replicas`` copies go to the next nodes,
    never to ``me`` itself, so a ring of one node keeps no replica. ``me`` not on the ring
    (it joined after the save began): none.
    """
    if me not in ring or replicas <= 0:
        return []
    i = ring.index(me)
    after = [ring[(i + k) % len(ring)] for k in range(1, len(ring))]
    return after[:replicas]


@dataclass(frozen=True)
class StandbyHolder:
    """A hot standby's checkpoint service, as it announced itself: ``endpoint`` (``HOST:PORT``)
    and ``limit``, the bytes of checkpoint memory it may hold (its ``--checkpoint-memory``)."""

    endpoint: str
    limit: int


def standby_holders(
    ring: Sequence[str],
    standbys: Sequence[StandbyHolder],
    part_bytes: int,
    likeliest: Sequence[str] = (),
) -> dict[str, tuple[str, ...]]:
    """Which standbys hold a copy of each ring node's part (pure): ring node -> standby endpoints.

    Every standby holds every node's part when its memory allows it. A standby holds at most
    ``limit // part_bytes`` parts (parts are assumed to be about equal across nodes, as
    :func:`memory_needed` assumes; every sender computes the same answer from its own size
    when they are). With less room, the nodes come in ``likeliest`` order (the ones a standby
    is likeliest to replace first; nodes it does not name follow in ring order), and the
    standbys share them out before any holds a second copy: pass ``d`` gives node ``i`` to
    standby ``(i + d) mod S`` when it has room (else the next standby with room that does not
    hold it yet), so the standbys together cover as many nodes as they can. A standby that is
    on the ring (it replaced a member) is none any more, and holds nothing here.
    Deterministic: every node computing it from the same facts gets the same answer.
    """
    members = list(dict.fromkeys(ring))
    order = [m for m in dict.fromkeys(likeliest) if m in members]
    order += [m for m in members if m not in order]
    spare: list[StandbyHolder] = []
    for s in standbys:  # one entry per endpoint (its first), none on the ring
        if s.endpoint not in members and all(s.endpoint != t.endpoint for t in spare):
            spare.append(s)
    held: dict[str, list[str]] = {m: [] for m in members}
    if not spare or not order:
        return {m: () for m in members}
    room = {s.endpoint: (s.limit // part_bytes if part_bytes > 0 else len(order)) for s in spare}
    for depth in range(len(spare)):
        for i, m in enumerate(order):
            for k in range(len(spare)):
                target = spare[(i + depth + k) % len(spare)].endpoint
                if room[target] > 0 and target not in held[m]:
                    held[m].append(target)
                    room[target] -= 1
                    break
    return {m: tuple(s.endpoint for s in spare if s.endpoint in held[m]) for m in members}


@dataclass(frozen=True)
class ReplicaPlan:
    """Where the parts of one round's checkpoints go: ``replicas`` copies of each node's part on
    the next nodes of ``ring`` (:func:`successors`) and one on each standby that
    :func:`standby_holders` gives it. The one answer both ends use: a sender sends its part
    to :meth:`holders` of itself, and a receiver can refuse a part whose sender did not
    assign it there. A receiver that does not know the sender's part size checks with
    ``part_bytes=0``: every standby then counts as assigned, a superset of what any sender
    with a size assigns (a standby short of memory is given fewer parts, never others)."""

    ring: tuple[str, ...]
    replicas: int
    standbys: tuple[StandbyHolder, ...] = ()
    #: the bytes of the sender's part (0: unknown, every standby takes every part); a receiver
    #: checking a part it is sent passes that part's size, as its sender did
    part_bytes: int = 0
    likeliest: tuple[str, ...] = ()

    def peers(self, sender: str) -> list[str]:
        """The ring nodes that hold ``sender``'s part, in the order it sends to them."""
        return successors(self.ring, sender, self.replicas)

    def standbys_of(self, sender: str) -> list[str]:
        """The standbys that hold ``sender``'s part (none for a sender off the ring)."""
        return list(
            standby_holders(self.ring, self.standbys, self.part_bytes, self.likeliest).get(sender, ())
        )

    def holders(self, sender: str) -> frozenset[str]:
        """Every node assigned a copy of ``sender``'s part: its ring successors and its standbys."""
        return frozenset(self.peers(sender)) | frozenset(self.standbys_of(sender))


def next_id(newest: Sequence[int]) -> int:
    """The number of the next checkpoint: one more than the newest any node has seen, so
    numbers only grow across restarts, resizes and restores (a returning node that kept an
    old number cannot make a new checkpoint look older)."""
    return max(newest, default=0) + 1


def memory_needed(kept: int, new_part: int, replicas: int) -> int:
    """Bytes a node needs while it writes a new checkpoint (pure).

    ``kept``: what it must keep meanwhile (the newest complete checkpoint: its own part and
    its replicas of peers' parts); ``new_part``: the bytes its ranks write now. Its peers'
    parts of the new checkpoint arrive as replicas too; parts are assumed to be about equal
    across nodes, so each of ``replicas`` incoming copies counts as one more ``new_part``.
    """
    return kept + new_part * (1 + replicas)


def replica_refusal(
    ring: Sequence[str], me: str, sender: str | None, sender_host: str | None, source: str, replicas: int
) -> str | None:
    """Why this node (``me``) refuses a replica that names ``sender`` (the endpoint of the node
    that sends it, as on the ring; ``sender_host`` its host) and comes from address
    ``source``; None when it takes it (pure).

    A node takes replicas only from the nodes whose parts the round's ring assigns to it
    (those it is among the ``replicas`` successors of), and only over a connection from that
    node's address: a peer that holds the job's secret cannot put a part it was not assigned,
    one from a previous round's ring, or one in another node's name. An empty ring (a service
    that no agent told a round's ring) takes every replica. A node off the ring it knows (a
    hot standby, or a node that stepped aside or found the group full: every member sends it
    its parts, see :func:`standby_holders`, and the ring it knows may be an older round's) takes
    a replica from any node of the job that names itself and sends from its own address.
    """
    if not ring:
        return None
    if sender is None:
        return "a replica must name the node that sends it ('from'), a node of this round's ring"
    if me not in ring:
        return (
            None
            if sender_host == source
            else f"the replica in {sender}'s name comes from {source}, another address"
        )
    if sender not in ring:
        return f"{sender} is no node of this round's checkpoint ring"
    if me not in successors(ring, sender, replicas):
        return f"this round's ring gives {sender}'s parts to other nodes, not to {me}"
    if sender_host != source:
        return f"the replica in {sender}'s name comes from {source}, another address"
    return None
