"""What a checkpoint service request costs, per request and per connection.

Starts a checkpoint service in this process (its own tmpfs folder, loopback, real sockets)
and times, on one kept connection, the requests of a save of one rank (``begin``,
``open``, ``done``, ``commit`` with a real DCP metadata of ``--tensors`` tensors) and a
small read (``inventory``), plus opening a connection (with this checkout's handshake);
then whole ``dcp.save`` calls of ``--state-mib`` MiB through ``MemoryWriter`` (one rank,
``no_dist``: the save's stall as a rank sees it, its copy into the agent's memory included).
Run it with another checkout's interpreter to compare (its protocol, whatever it is): it
adapts to the constructor of the checkout it imports. Prints medians and quartiles in
microseconds; asserts nothing.

    python bench/bench_checkpoint_requests.py [--rounds 300] [--tensors 64]
"""

from __future__ import annotations

import argparse
import inspect
import os
import pickle
import secrets
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300, help="saves timed (default 300)")
    p.add_argument("--tensors", type=int, default=64, help="tensors in the state (default 64)")
    p.add_argument("--connects", type=int, default=100, help="connections timed (default 100)")
    p.add_argument("--state-mib", type=int, default=64, help="state of the timed dcp.save calls (default 64)")
    p.add_argument("--saves", type=int, default=30, help="dcp.save calls timed (default 30)")
    a = p.parse_args()

    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    import kelastic.agent.checkpoint.service as service_module
    from kelastic.agent.checkpoint.settings import CheckpointSettings
    from kelastic.agent.checkpoint.storage import MemoryItem

    root = Path("/dev/shm") / f"kelastic-bench-{uuid.uuid4().hex[:8]}"
    settings = CheckpointSettings(root=root, node="bench", limit=2**30, replicas=0)
    params = inspect.signature(service_module.CheckpointService).parameters
    authenticated = "secret" in params
    tmp = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    if authenticated:
        from kelastic.agent.checkpoint.client import ServiceClient
        from kelastic.agent.secret import secret_from_file

        (tmp / "job-secret").write_text(secrets.token_hex(32))
        key = secret_from_file(str(tmp / "job-secret"))
        service = service_module.CheckpointService(settings, key, host="127.0.0.1").start()

        def client() -> Any:
            return ServiceClient(service.endpoint, key.key)
    else:
        service = service_module.CheckpointService(settings, host="127.0.0.1").start()

        def client() -> Any:
            return service_module.ServiceClient(service.endpoint)  # type: ignore[attr-defined]

    storage: dict[MetadataIndex, MemoryItem] = {}
    md: dict[str, TensorStorageMetadata] = {}
    for i in range(a.tensors):
        fqn = f"layer{i}.weight"
        size = torch.Size([1024, 256])
        md[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            size,
            [ChunkStorageMetadata(torch.Size([0, 0]), size)],
        )
        storage[MetadataIndex(fqn, torch.Size([0, 0]))] = MemoryItem(
            "__0.mem", i * 4096, 4096, "torch.float32", (32, 32)
        )
    blob = pickle.dumps(
        Metadata(state_dict_metadata=md, storage_data=storage), protocol=pickle.HIGHEST_PROTOCOL
    )  # type: ignore[arg-type]
    required = {"__0.mem": a.tensors * 4096}
    c = client()
    timings: dict[str, list[float]] = {
        k: [] for k in ("begin", "open", "done", "commit", "save", "inventory")
    }
    try:
        for cid in range(1, a.rounds + 1):
            t0 = time.perf_counter()
            c.call(
                {"op": "begin", "rank": 0, "bytes": required["__0.mem"], "timeout": 30, "pid": os.getpid()}
            )
            t1 = time.perf_counter()
            c.call({"op": "open", "id": cid, "name": "__0.mem", "size": required["__0.mem"], "rank": 0})
            t2 = time.perf_counter()
            c.call({"op": "done", "rank": 0})
            t3 = time.perf_counter()
            header = {"op": "commit", "id": cid, "required": required, "step": cid}
            if not authenticated:
                header.update({"ring": [service.endpoint], "coordinator": True})
            c.call(header, blob)
            t4 = time.perf_counter()
            c.call({"op": "inventory"})
            t5 = time.perf_counter()
            for name, dt in zip(
                ("begin", "open", "done", "commit", "save", "inventory"),
                (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, t5 - t4),
                strict=True,
            ):
                timings[name].append(dt * 1e6)
        connects: list[float] = []
        for _ in range(a.connects):
            fresh = client()
            t0 = time.perf_counter()
            fresh.call({"op": "done", "rank": 1})  # connect (and authenticate) + one small request
            connects.append((time.perf_counter() - t0) * 1e6)
            fresh.close()
        saves = time_saves(service, a.state_mib, a.saves)
    finally:
        c.close()
        service.stop(remove=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"checkpoint service of {service_module.__file__.rsplit('/agent/', 1)[0]} "
        f"({'authenticated' if authenticated else 'unauthenticated'} protocol), metadata {len(blob)} bytes, "
        f"{a.rounds} saves, load average {os.getloadavg()[0]:.2f}"
    )
    for name, values in [
        *timings.items(),
        ("connect + done", connects),
        (f"dcp.save {a.state_mib} MiB", saves),
    ]:
        q = statistics.quantiles(values, n=4)
        print(
            f"  {name:16s} median {statistics.median(values):8.1f} us   (quartiles {q[0]:8.1f} .. {q[2]:8.1f})"
        )


def time_saves(service: Any, state_mib: int, count: int) -> list[float]:
    """Microseconds of ``count`` whole saves of a ``state_mib`` MiB state (the first two,
    which allocate, left out)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from kelastic.agent.checkpoint.storage import MemoryWriter

    warnings.filterwarnings("ignore")
    os.environ.update(service.worker_env())
    rows = state_mib * 2**20 // 4 // 1024 // 12
    state = {f"t{i}": torch.randn(rows, 1024) for i in range(12)}
    out = []
    for i in range(count + 2):
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=MemoryWriter(step=i), no_dist=True)
        if i >= 2:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


if __name__ == "__main__":
    main()
