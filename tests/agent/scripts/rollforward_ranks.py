"""One rank of a group that rolls a state forward, without an agent: for
tests/agent/test_checkpoint_rollforward.py.

``rollforward_ranks.py RANK WORLD PORT OUT HELD [--odd-shape]``: joins a gloo group on
127.0.0.1:PORT, builds a state (tensors, one of them a non-contiguous view, a plain value, a
list and an object with ``state_dict``/``load_state_dict``), fills it as the state after
step HELD when HELD is a number ("-" for none: zeros), says it holds that step, calls
``kelastic.checkpoint.restore(state, replicated=True)`` and writes what it restored and the
state it ends with to OUT/rank<RANK>.json (or the exception's type and text).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import kelastic.inprocess
from kelastic.agent import inprocess
from kelastic.checkpoint import restore


class Counter:
    """A Stateful: its state is a dict with a tensor and a value."""

    def __init__(self) -> None:
        self.total = torch.zeros(3)
        self.label = "none"
        self.loaded = 0

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "label": self.label}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.total, self.label = sd["total"], sd["label"]
        self.loaded += 1


def main() -> None:
    rank, world, port, out, held = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        Path(sys.argv[4]),
        sys.argv[5],
    )
    odd = "--odd-shape" in sys.argv
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    base = torch.zeros(64, 32)
    counter = Counter()
    state: dict[str, Any] = {
        "model": {
            "w": torch.zeros(1000 + (1 if odd and rank == 0 else 0)),
            "t": base.t(),
        },  # .t(): not contiguous
        "step": 0,
        "history": [torch.zeros(2, dtype=torch.int64), "start"],
        "counter": counter,
    }
    if held != "-":
        s = int(held)
        with kelastic.inprocess.updating(s):
            state["model"]["w"].fill_(s)
            base.copy_(torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) + s)
            state["step"] = s
            state["history"][0].fill_(s)
            state["history"][1] = f"after {s}"
            counter.total.fill_(s / 2)
            counter.label = f"counted {s}"
    try:
        done = restore(state, replicated=True)
    except Exception as e:  # reported to the test
        result: dict[str, Any] = {"error": type(e).__name__, "text": str(e)}
    else:
        result = {
            "source": None if done is None else done.source,
            "step": None if done is None else done.step,
            "received": None if done is None else done.received_bytes,
            "held": inprocess.held_step(),
            "w": sorted(set(state["model"]["w"].tolist())),
            "t": [*state["model"]["t"].t().reshape(-1).tolist()[:3], float(base[63, 31])],
            "value": state["step"],
            "history": [state["history"][0].tolist(), state["history"][1]],
            "counter": [counter.total.tolist(), counter.label, counter.loaded],
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
