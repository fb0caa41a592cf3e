"""Whether the nodes' image imports fit on the disk, and how many nodes may import at once.

``ctr images import --local --discard-unpacked-layers`` first writes every blob into the
node's content store, then unpacks each layer into a snapshot beside it, and only then drops
the layers' blobs: a node holds about twice the images' bytes at its peak (the images are
uncompressed, so a layer unpacked is about its blob's size) and about once after. Nodes that
import side by side peak together; nodes that import one after another add only what the
earlier ones kept. Pure arithmetic: :meth:`.lane.RealNodeLane.start` measures and decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["HEADROOM", "ImportPlan", "NotEnoughSpace", "import_peak", "plan_imports"]

#: Bytes left free beyond the imports' peak: the nodes' logs, the containers' writable
#: layers and checkpoints, containerd's metadata, and the rest of the machine.
HEADROOM = 2 * 10**9


class NotEnoughSpace(RuntimeError):
    """The imports cannot fit in the free space; the message says how much is missing and what to delete."""


@dataclass(frozen=True)
class ImportPlan:
    """How many nodes import at once, and the most bytes the imports hold at any time."""

    side_by_side: int
    peak: int


def import_peak(image_bytes: int, nodes: int, side_by_side: int) -> int:
    """Bytes the nodes' content stores and snapshots hold at the worst moment when ``nodes``
    import ``image_bytes`` of blobs, ``side_by_side`` at a time: the last wave's nodes each
    hold blobs and snapshots (2x), every node before them its snapshots only (1x)."""
    wave = min(max(side_by_side, 1), nodes)
    return image_bytes * (2 * wave + (nodes - wave))


def plan_imports(
    image_bytes: int, nodes: int, free: int, where: Path, *, most: int | None = None, headroom: int = HEADROOM
) -> ImportPlan:
    """The most nodes (up to ``most``, else all: imports are mostly I/O) that may import side by
    side with ``headroom`` bytes left of ``free``. NotEnoughSpace when even one node at a
    time does not fit, saying the gigabytes needed and free on ``where``'s file system and what
    to delete."""
    for side_by_side in range(min(most or nodes, nodes), 0, -1):
        peak = import_peak(image_bytes, nodes, side_by_side)
        if peak + headroom <= free:
            return ImportPlan(side_by_side, peak)
    need = import_peak(image_bytes, nodes, 1) + headroom
    raise NotEnoughSpace(
        f"importing the images ({image_bytes / 1e9:.1f} GB of blobs) into {nodes} node(s), one at a time, "
        f"needs {need / 1e9:.1f} GB free on the file system of {where} (blobs and their unpacked layers, "
        f"{headroom / 1e9:.0f} GB to spare), and {free / 1e9:.1f} GB is free: free {(need - free) / 1e9:.1f} GB "
        "there (what an earlier lane left under it, if none runs: `python -m kelastic.localcluster.node.janitor`"
        " runs with each lane; BuildKit's cache in ~/.cache/kelastic/node/buildkit shrinks to its bound "
        "with `make image`; or move $KELASTIC_NODE_ROOT to a larger disk)"
    )
