"""Warm worker starts: fork workers from a server that has already imported torch.

Starting a worker as ``python train.py`` pays for a fresh interpreter and for
``import torch`` on every (re)start, which dominates the time to recover from a
lost or added node. With ``kelastic-agent --warm-start`` the agent instead
starts ``multiprocessing``'s fork server once, early (while the rendezvous is
still going on), has it import :data:`PRELOAD`, and every worker start is a
``fork`` of that server running the script through :func:`run_script` (or
:func:`run_module` for ``-m``), i.e. ``runpy`` with ``__name__ == "__main__"``,
``sys.argv`` and ``sys.path[0]`` as ``python`` would set them.

Differences from a fresh interpreter a script may notice: torch is already
imported (so environment variables that torch reads at import time come from
the agent's environment; the agent sets ``OMP_NUM_THREADS=1`` in its own
environment first when several ranks share the node, as for regular starts),
and the ``__main__`` module is runpy's. Scripts that need a pristine
interpreter should not use ``--warm-start``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys

__all__ = ["PRELOAD", "prewarm_forkserver", "run_module", "run_script"]

#: Modules the fork server imports once, so that workers do not.
PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "kelastic.agent.multiprocessing.child")


def run_script(script: str, *args: str) -> None:
    """Run ``script`` as ``python script args...`` would, in the current process."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def run_module(module: str, *args: str) -> None:
    """Run ``module`` as ``python -m module args...`` would, in the current process."""
    sys.argv = [module, *args]
    sys.path.insert(0, os.getcwd())
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def prewarm_forkserver(preload: tuple[str, ...] = PRELOAD) -> None:
    """Start the fork server now and have it import ``preload`` (idempotent; returns at once)."""
    multiprocessing.set_forkserver_preload(list(preload))
    multiprocessing.forkserver.ensure_running()
