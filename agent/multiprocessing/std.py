"""Which standard streams of a rank are redirected to log files or teed to the console."""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = ["Std", "to_map", "to_std_map"]


class Std(enum.IntFlag):
    """Bitmask of standard streams: ``NONE``, ``OUT``, ``ERR`` or ``ALL`` (= ``OUT | ERR``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, value: str) -> Std | dict[int, Std]:
        """Parse torchrun's syntax: ``"3"`` (all ranks) or ``"0:1,1:2"`` (per local rank).

        Raises ``ValueError`` naming the offending part when it is not 0-3 or ``rank:0-3``.
        """

        def one(text: str) -> Std:
            try:
                number = int(text)
            except ValueError:
                number = -1
            if number not in (0, 1, 2, 3):
                raise ValueError(
                    f"invalid std stream mask {text!r} in {value!r}: use 0 (none), 1 (out), 2 (err) or 3 (all)"
                )
            return cls(number)

        value = value.strip()
        if ":" not in value:
            return one(value)
        result: dict[int, Std] = {}
        for part in value.split(","):
            rank, sep, mask = part.partition(":")
            if not sep or not rank.strip().isdigit():
                raise ValueError(
                    f"invalid per-rank std mask {part!r} in {value!r}: expected <local_rank>:<0-3>"
                )
            result[int(rank)] = one(mask)
        return result


def to_std_map(value: Std | int | Mapping[int, Std | int], nprocs: int) -> dict[int, Std]:
    """Expand a mask or a per-rank map to ``{local_rank: Std}`` for ranks ``0..nprocs-1``.

    Ranks missing from a map get ``Std.NONE``; a rank outside ``0..nprocs-1`` is a ``ValueError``.
    """
    if isinstance(value, Mapping):
        extra = sorted(set(value) - set(range(nprocs)))
        if extra:
            raise ValueError(
                f"std stream map names local ranks {extra} but there are only {nprocs} ranks (0..{nprocs - 1})"
            )
        return {rank: Std(value.get(rank, Std.NONE)) for rank in range(nprocs)}
    return dict.fromkeys(range(nprocs), Std(value))


#: torch's name for :func:`to_std_map` (``torch.distributed.elastic.multiprocessing.to_map``).
to_map = to_std_map
