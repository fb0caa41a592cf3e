"""``kelastic local``: the command, and :class:`~.cluster.LocalCluster`, which composes the other parts.

:mod:`.cluster` starts an API server (the emulator or a real control plane) with the
kubelet and the controllers as its clients; :mod:`.cli` is the ``kelastic`` command
(:func:`main` here is its console script's entry point: it checks that the ``local``
extra is installed before importing it); :mod:`.apply`, :mod:`.chart`, :mod:`.completion`,
:mod:`.jobsummary` and :mod:`.logrelay` are what ``kelastic local run`` does with the
cluster. This is the only part that may import every other one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..common.extra import missing_extra_message, missing_local_dependencies

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The ``kelastic`` command; without the ``local`` extra it says which extra to install (exit 1)."""
    missing = missing_local_dependencies()
    if missing:
        print(f"kelastic: {missing_extra_message(missing)}", file=sys.stderr)
        return 1
    from .cli import main as run

    return run(argv)
