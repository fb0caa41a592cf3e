"""Imported by multiprocessing's own fork server, the fallback of the warm start
(:func:`kelastic.agent.warm.prewarm_forkserver`), after torch: imports the training
script's modules named in ``$KELASTIC_WARM_IMPORTS`` through
:func:`kelastic.agent.warm.import_guarded`, so that one that fails or hangs is skipped
with a warning instead of ending the server (multiprocessing's own preload gives up on
anything but ImportError). Importing it anywhere else does nothing when the variable is
not set; it is removed from the environment, so the workers do not inherit it.
"""

from __future__ import annotations

import logging
import os
import sys

from kelastic.agent import warm

__all__: list[str] = []


def _preload() -> None:
    names = [n for n in os.environ.pop(warm.ENV_SCRIPT_IMPORTS, "").split(",") if n]
    if not names:
        return
    # The agent's log line format, at its LOGLEVEL: this interpreter has no logging set up.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname).1s %(asctime)s] %(message)s", "%H:%M:%S"))
    level = logging.getLevelName(os.environ.get("LOGLEVEL", "INFO").upper())
    warm.import_guarded(
        names, warm.server_logger([handler], level if isinstance(level, int) else logging.INFO)
    )


with warm.paused_gc():
    _preload()
