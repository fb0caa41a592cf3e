"""Helpers of the launcher's tests: rank functions in a module that spawned and forkserver
ranks can import by name (``tests/agent/scripts`` on ``sys.path``) without importing torch."""

from __future__ import annotations

import os
import time
from pathlib import Path


def return_when(rank: int, marker: str, go: str) -> int:
    """Wait (up to 60 s) until the file ``go`` exists (when given), write ``marker``, return ``rank``."""
    deadline = time.monotonic() + 60
    while go and not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    return rank


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a zombie has already died)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"
