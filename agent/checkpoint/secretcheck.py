"""Which node of a refused checkpoint handshake holds another job secret.

A refused handshake between two checkpoint services says only that the two hold different
secrets, not which one is wrong. Whichever node meets the refusal asks every other node of
its ring for a handshake: the node most of its peers refuse is the one whose
``--job-secret-file`` is not the job's (:func:`holds_another_secret`), and it stops, saying
so, rather than train on without the replicas its user asked for. With two nodes each is
refused by half the ring, so both stop: either may be the wrong one. The others go on; the
refusal they met is logged, and the odd node's own agent stops it.

This is what tells the odd node with torch's ``c10d`` backend, which has no peer link; with
kelastic's backend the signed join records and the peer link tell it first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kelastic.agent.checkpoint.errors import CheckpointError, SecretMismatch

__all__ = ["SecretVerdict", "holds_another_secret", "judge_secret"]


def holds_another_secret(refused: int, answered: int) -> bool:
    """True when this node is the odd one: more than half of the peers that gave an answer
    (a handshake accepted or refused; unreachable ones give none) refused it."""
    return refused > 0 and 2 * refused > refused + answered


@dataclass(frozen=True)
class SecretVerdict:
    """The handshakes with each peer of the ring: who refused this node, who accepted it."""

    refused: tuple[str, ...]
    answered: tuple[str, ...]

    @property
    def odd(self) -> bool:
        """This node holds another secret than the job's (:func:`holds_another_secret`)."""
        return holds_another_secret(len(self.refused), len(self.answered))

    def message(self, me: str) -> str:
        if self.odd:
            return (
                f"this node's checkpoint service ({me}) does not hold the job secret of its peers: "
                f"{len(self.refused)} of {len(self.refused) + len(self.answered)} refused its handshake "
                f"({', '.join(self.refused)}); give every agent of the job the same --job-secret-file"
            )
        return (
            f"the checkpoint service of {', '.join(self.refused)} does not hold this job's secret "
            f"({len(self.answered)} other peer(s) accepted this node); its agent stops it"
        )


def judge_secret(ring: Sequence[str], me: str, handshake: Callable[[str], None]) -> SecretVerdict:
    """Try ``handshake(endpoint)`` with every node of ``ring`` but ``me``: it returns when the
    peer accepted, raises :class:`SecretMismatch` when the two hold different secrets, and
    any other :class:`CheckpointError` (unreachable, cut off) counts as no answer."""
    refused: list[str] = []
    answered: list[str] = []
    for endpoint in dict.fromkeys(ring):
        if endpoint == me:
            continue
        try:
            handshake(endpoint)
        except SecretMismatch:
            refused.append(endpoint)
        except CheckpointError:
            continue
        else:
            answered.append(endpoint)
    return SecretVerdict(tuple(refused), tuple(answered))
