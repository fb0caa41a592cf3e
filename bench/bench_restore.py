"""Where a restore's time goes: ``dcp.load`` with ``MemoryReader`` on a group of nodes.

Starts ``--nodes`` checkpoint services (one per node, each with its own tmpfs folder, on the
ring with ``--replicas`` replica(s)) and one gloo rank per node; the ranks save a replicated
state of ``--tensors`` float32 tensors (``--mib`` MiB in all) with ``MemoryWriter``, wait
until every replica is sent, then restore it into zeroed tensors ``--loads`` times. Prints,
per rank and load, the phases of the restore (choosing the checkpoint: inventory and
all_gather; the metadata; the reads) and the bytes read from the node's own memory and
fetched from peers; ``--profile`` adds each rank's top functions by cumulative time.
Figures only: nothing is asserted but that the restored bytes equal the saved ones.

    python bench/bench_restore.py [--nodes 3] [--mib 512] [--tensors 12] [--loads 3] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _state(n: int, numel: int, fill: bool) -> dict[str, torch.Tensor]:
    if not fill:
        return {f"t{i}": torch.zeros(numel) for i in range(n)}
    return {f"t{i}": torch.arange(numel, dtype=torch.float32).add_(i * 0.5) for i in range(n)}


def _worker(rank: int, args: argparse.Namespace, envs: list[dict[str, str]], port: int, go: Any) -> None:
    os.environ.update(envs[rank])
    import torch.distributed.checkpoint as dcp

    from kelastic.checkpoint import MemoryReader, MemoryWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nodes)
    numel = args.mib * 2**20 // 4 // args.tensors
    saved = _state(args.tensors, numel, True)
    dcp.save(saved, storage_writer=MemoryWriter(step=1))
    dist.barrier()
    if rank == 0:
        go.saved.set()
    go.ready.wait()
    dist.barrier()
    for n in range(args.loads):
        target = _state(args.tensors, numel, False)
        reader = MemoryReader()
        dist.barrier()
        t0 = time.monotonic()
        c0 = time.process_time()
        prof = cProfile.Profile() if args.profile and n == args.loads - 1 else None
        if prof:
            prof.enable()
        found = reader.exists()
        t1 = time.monotonic()
        dcp.load(target, storage_reader=reader)
        t2 = time.monotonic()
        cpu = time.process_time() - c0
        if prof:
            prof.disable()
        dist.barrier()
        t3 = time.monotonic()
        ok = found and all(torch.equal(target[k], saved[k]) for k in saved)
        print(
            f"load {n} rank {rank}: choose {1000 * (t1 - t0):6.0f} ms, load {1000 * (t2 - t1):6.0f} ms, "
            f"all ranks done {1000 * (t3 - t0):6.0f} ms, cpu {1000 * cpu:4.0f} ms; local {reader.local_bytes / 2**20:6.1f} MiB, "
            f"fetched {reader.fetched_bytes / 2**20:6.1f} MiB, identical {ok}",
            flush=True,
        )
        if prof:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
            print(f"--- rank {rank} profile (last load) ---\n{out.getvalue()}", flush=True)
        del target
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--tensors", type=int, default=12)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()

    from kelastic.agent.checkpoint.service import CheckpointService
    from kelastic.agent.checkpoint.settings import CheckpointSettings
    from kelastic.agent.contract import ENV_JOB_SECRET_FILE
    from kelastic.agent.secret import secret_from_file

    with tempfile.TemporaryDirectory(prefix="bench-restore-", dir="/dev/shm") as tmp:
        secret_file = Path(tmp) / "job-secret"
        secret_file.write_text(secrets.token_hex(32) + "\n")
        secret_file.chmod(0o600)
        os.environ[ENV_JOB_SECRET_FILE] = str(secret_file)
        secret = secret_from_file(str(secret_file))
        services = [
            CheckpointService(
                CheckpointSettings(
                    root=Path(tmp) / f"node{i}",
                    node=f"node{i}",
                    limit=4 * args.mib * 2**20,
                    replicas=args.replicas,
                ),
                secret,
                host=f"127.0.0.{i + 1}",
                advertise=f"127.0.0.{i + 1}",
            ).start()
            for i in range(args.nodes)
        ]
        try:
            ring = [s.endpoint for s in services]
            for s in services:
                s.set_ring(ring)
            envs = [{**s.worker_env(), ENV_JOB_SECRET_FILE: str(secret_file)} for s in services]
            ctx = mp.get_context("spawn")
            go = argparse.Namespace(saved=ctx.Event(), ready=ctx.Event())
            print(
                f"{args.nodes} nodes x 1 rank, {args.mib} MiB in {args.tensors} float32 tensors, "
                f"{args.replicas} replica(s); load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            port = _free_port()
            procs = [ctx.Process(target=_worker, args=(r, args, envs, port, go)) for r in range(args.nodes)]
            for proc in procs:
                proc.start()
            while not go.saved.wait(0.05):
                if not all(proc.is_alive() for proc in procs):
                    sys.exit("a rank died before its save")
            t0 = time.monotonic()
            for s in services:
                while s.keeper._outgoing or s.keeper._pinned:
                    time.sleep(0.01)
            print(f"saved; replicas sent within {time.monotonic() - t0:.2f} s", flush=True)
            served = time.process_time()
            go.ready.set()
            for proc in procs:
                proc.join()
            if any(proc.exitcode for proc in procs):
                sys.exit("a rank failed (its error is above)")
            print(
                f"the services' cpu over the {args.loads} loads: {1000 * (time.process_time() - served):.0f} ms",
                flush=True,
            )
        finally:
            for s in services:
                s.stop(remove=True)


if __name__ == "__main__":
    main()
