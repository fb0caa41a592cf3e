"""What the fates of a node's own round already decide, so that a re-form starts without waiting (pure).

Every member of a round R gets one fate once the round is over for it (``protocol.claim_fate``):
``rejoin`` when it joined the next round, ``dead``, ``left`` or ``dropped`` when it was lost.
``accounted`` (members with a fate) and ``lost`` (a fate other than rejoin, or a member
announcing its leave) answer three questions without a timer:

* :func:`loss_verdict`: after this node's workers failed, was it a member's loss?
* :func:`previous_loss_verdict`: after this node re-joined, was the round it left losing a member?
* :func:`round_over`: is the round over for the group, whatever nodes wait to join? A member
  with a fate re-joined the next round (its workers failed or it saw the group change) or is
  gone: the round makes no progress and commits no checkpoint any more, so a restart that
  waits for the group's next checkpoint before taking joining nodes in would wait for nothing
  (until the workers fail on their own, in a collective with the member that re-joined).
"""

from __future__ import annotations

__all__ = ["loss_verdict", "previous_loss_verdict", "round_over"]


def loss_verdict(accounted: int, lost: bool) -> bool | None:
    """True: a member was lost; False: a peer re-joined without a loss; None: neither yet."""
    if lost:
        return True
    return False if accounted > 0 else None


def previous_loss_verdict(accounted: int, lost: bool, size: int) -> bool | None:
    """About the round this node left (``size`` members): True once a member was lost (or nobody
    is accounted for, not even this node's own re-join: the store no longer knows the round);
    False once every member is accounted for without a loss; None until then."""
    if lost or accounted == 0:
        return True
    return False if accounted >= size else None


def round_over(accounted: int) -> bool:
    """Whether a member of the round has a fate (re-joined or lost): the round is over for the group."""
    return accounted > 0
