"""A data-parallel worker that restores with ``kelastic.checkpoint.restore(state,
replicated=True)``: for tests/agent/test_inprocess_agents.py.

Its state (weights and a step) after step s is a pure function of s: every weight is s.
Each call of ``train`` restores, writes ``<out>/r<generation>_<node>_<pid>.json`` (where the
state came from, the step, whether the weights match it, the bytes received), then steps:
an all-reduce, a short sleep, the update inside ``kelastic.inprocess.updating`` and a memory
checkpoint every 4 steps (``<out>/step_<node>``: the step reached), until a rank sees ``<out>/stop``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import kelastic.inprocess
from kelastic.checkpoint import MemoryWriter, restore


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    node = os.environ.get("KELASTIC_NODE_NAME", "?")
    weights = torch.zeros(256, 1024)  # 1 MiB, once per process
    step = torch.zeros((), dtype=torch.int64)
    (a.out / f"before_{node}_{os.getpid()}").touch()

    def train() -> None:
        state: dict[str, Any] = {"weights": weights, "step": step}
        done = restore(state, replicated=True)
        s = int(state["step"])
        record = {
            "node": node,
            "pid": os.getpid(),
            "gen": kelastic.inprocess.generation(),
            "world": dist.get_world_size(),
            "source": None if done is None else done.source,
            "step": s,
            "consistent": bool((weights == float(s)).all()),
            "received": 0 if done is None else done.received_bytes,
        }
        (a.out / f"r{record['gen']}_{node}_{os.getpid()}.json").write_text(json.dumps(record))
        while True:
            x = torch.tensor([float((a.out / "stop").exists())])
            dist.all_reduce(x)
            if x[0] > 0:
                return
            time.sleep(0.05)
            s += 1
            with kelastic.inprocess.updating(s):
                weights.fill_(float(s))
                state["step"].fill_(s)
            if s % 4 == 0:
                dcp.save(state, storage_writer=MemoryWriter(step=s))
            (a.out / f"step_{node}").write_text(str(s))

    kelastic.inprocess.run(train, backend="gloo", timeout=timedelta(seconds=60))


if __name__ == "__main__":
    main()
