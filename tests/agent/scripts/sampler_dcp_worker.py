"""One rank of a gloo group that saves or loads an ElasticSampler with torch.distributed.checkpoint.

Run as ``RANK=r WORLD_SIZE=w python sampler_dcp_worker.py --init file:///... --ckpt DIR
--out DIR {save,load}``:

* ``save --steps K``: consumes K global steps (each rank drawing a few batches ahead, as a
  prefetching DataLoader would, without marking them consumed), then ``dcp.save``s
  ``{"sampler": sampler, "position": sampler.state_dict()}`` (the sampler as a Stateful,
  and its state as a plain dict) with a ``FileSystemWriter``.
* ``load``: ``dcp.load``s both into fresh samplers of this world size with a
  ``FileSystemReader``, then yields the rest of the epoch.

Each rank writes ``<out>/<mode>_rank<RANK>.json``: the states it saved or loaded, and the
batches it handed to the loop (``load``: the rest of the epoch).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kelastic.data import ElasticSampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--init", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dataset-len", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=3)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=a.init, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )

    def sampler() -> ElasticSampler:
        return ElasticSampler(a.dataset_len, a.batch_size, rank, world, seed=a.seed)

    s = sampler()
    record: dict[str, object] = {"rank": rank, "world_size": world}
    if a.mode == "save":
        it = iter(s)
        ahead = list(itertools.islice(it, a.steps + 2))  # two batches in flight beyond the consumed ones
        s.advance(a.steps)
        record["consumed_batches"] = ahead[: a.steps]
        record["state"] = s.state_dict()
        dcp.save({"sampler": s, "position": s.state_dict()}, storage_writer=dcp.FileSystemWriter(a.ckpt))
    else:
        plain = sampler()
        position = plain.state_dict()  # the structure to load into; its values are replaced
        loaded = {"sampler": s, "position": position}
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(a.ckpt))
        plain.load_state_dict(loaded["position"])
        record["state"] = s.state_dict()
        record["plain_state"] = plain.state_dict()
        record["rest"] = list(s)
    dist.barrier()
    Path(a.out, f"{a.mode}_rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
