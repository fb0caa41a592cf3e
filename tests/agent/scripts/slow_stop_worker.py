"""A worker whose stop the test holds: for the re-form test (test_agent_reform_e2e.py).

It joins the gloo group, writes ``<out>/w<WORLD_SIZE>_<node>_<pid>.json``, then:

* while ``<out>/second`` does not exist (the first group): idles without collectives (so a
  lost peer does not fail it) until a termination signal, on which it waits for
  ``<out>/release`` (at most ``--max-wait`` s) before it exits: a stop that takes as long as
  the test wants;
* once ``<out>/second`` exists (the re-formed group): one barrier, then it exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-wait", type=float, default=60.0)
    a = p.parse_args()
    second = (a.out / "second").exists()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    node = os.environ.get("KELASTIC_NODE_NAME", "?")
    record = {"node": node, "pid": os.getpid(), "world": dist.get_world_size(), "rank": dist.get_rank()}
    (a.out / f"w{dist.get_world_size()}_{node}_{os.getpid()}.json").write_text(json.dumps(record))
    if second:
        dist.barrier()
        dist.destroy_process_group()
        return

    def slow_stop(signum: int, frame: FrameType | None) -> None:
        deadline = time.monotonic() + a.max_wait
        while not (a.out / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(143)

    signal.signal(signal.SIGTERM, slow_stop)
    deadline = time.monotonic() + a.max_wait
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit("never stopped")


if __name__ == "__main__":
    main()
