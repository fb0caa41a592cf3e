"""``kelastic local``: the command, and :class:`~.cluster.LocalCluster`, which composes the other parts.

:mod:`.cluster` starts an API server (the emulator or a real control plane) with the
kubelet and the controllers as its clients; :mod:`.cli` is the ``kelastic`` command
(``main`` is its console script's entry point); :mod:`.apply`, :mod:`.chart`,
:mod:`.completion`, :mod:`.jobsummary` and :mod:`.logrelay` are what ``kelastic local
run`` does with the cluster. This is the only part that may import every other one.
"""

from .cli import main

__all__ = ["main"]
