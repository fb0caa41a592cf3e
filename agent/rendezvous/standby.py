"""Standbys: whether a node takes a slot in the open round, claims a place first, or parks (pure).

A node that is no member of the current (latest closed) round R does not take a slot
in the open round R+1 just because it arrived: the members of a full group would
re-form for it, and a slot it holds makes it a member of whatever round closes next,
dead or not. It takes a slot only for one of the open round's *places*:

* ``max - (size(R) - gone(R))``: the members R lost (dead, left or dropped, so far)
  plus the room ``max`` leaves beside them (a scale-up, a group below its maximum);
* for a node started as a standby (``--standby``, rdzv-conf ``standby=1``) only the
  places of lost members: it never grows a group, it replaces.

Claiming a place is ``add(r/<R+1>/claimed, 1)``: an ordinal within the places wins
and the node takes its slot; a larger one gives the claim back (``add -1``) and
parks. A node that parks holds no slot and no rank: it waits for the next event (a
member lost, new bounds from the controller, a round closed) and decides again. So
the loss of a member wakes the parked nodes with the survivors, a parked node takes
the lost member's place in the round they re-form, and the group re-forms once at
its old size instead of shrinking and growing again.

A member of R (re-joining after its workers failed or the membership changed) always
takes its slot at once, in the store's open round, or in R+1 when the store says R is
still open and holds no close of R the job signed (:func:`round_to_join`). Before the first round closed there is no group: a node
joins the first round (extra nodes come too late and park behind it), but a node
started as a standby waits for the group to form without it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["GroupView", "Move", "claim_won", "decide", "places", "round_to_join"]


class Move(enum.Enum):
    """What a node about to join does."""

    JOIN = "join"  # take a slot in the open round now
    CLAIM = "claim"  # claim one of the open round's places, then take a slot (or park)
    PARK = "park"  # hold no slot: wait for the next event and decide again


@dataclass(frozen=True)
class GroupView:
    """What a node about to join knows of the current round (O(1) reads).

    ``current``: the latest closed round (0: none yet); ``size`` its members and
    ``gone`` those lost (fates dead, left, dropped); ``max_nodes`` the bounds in force
    (the controller's when it publishes them); ``claimed``: places of the open round
    claimed so far; ``member``: this node is a member of ``current``; ``standby``:
    this node replaces lost members only.
    """

    current: int
    size: int
    gone: int
    max_nodes: int
    claimed: int
    member: bool
    standby: bool


def places(view: GroupView) -> int:
    """Slots of the open round for nodes that are no members of the current round."""
    survivors = max(0, view.size - view.gone)
    room = max(0, view.max_nodes - survivors)
    return min(room, view.gone) if view.standby else room


def decide(view: GroupView) -> Move:
    """JOIN for members and for the first round, CLAIM while places are unclaimed, else PARK."""
    if view.member:
        return Move.JOIN
    if view.current < 1:
        return Move.PARK if view.standby else Move.JOIN
    return Move.CLAIM if view.claimed < places(view) else Move.PARK


def claim_won(view: GroupView, ordinal: int) -> bool:
    """Whether the claim that got ``ordinal`` (1-based, from ``add``) holds one of the places."""
    return 1 <= ordinal <= places(view)


def round_to_join(opened: int, last: int | None, last_closed: bool) -> int:
    """The round a node about to join takes: the store's open round ``opened``, or the one
    after ``last`` (the latest round this node was a member of, None: none) when the store
    says ``last`` is still open (``opened <= last``) and holds no close of it that the job
    signed (``last_closed`` False: deleted, overwritten, or never there in a restarted store).

    The node knows ``last`` closed (it was a member): a store that says otherwise lost that
    round's close and the job's ``latest`` mark to a stranger (who may delete any key), and
    its open round would park the node behind a round that never closes again. Whenever the
    store holds the close, or opens a later round, the node goes where the store says, as
    every other joiner does: the nodes of a group never split on their own memories.
    """
    if last is not None and opened <= last and not last_closed:
        return last + 1
    return opened
