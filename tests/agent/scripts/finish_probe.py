"""Runs gloo jobs whose ranks end without ``destroy_process_group``, many times.

    python finish_probe.py launcher --impl kelastic --runs 6 --ranks 8
    python finish_probe.py agent --impl kelastic --runs 4

``launcher``: ``start_processes(..., start_method="spawn")`` of ``--ranks`` callable ranks,
each ``init_process_group("gloo")``, one ``all_reduce``, return. ``agent``: torch's
homogeneous distributed-sum scenario, two agents (processes) of four spawned ranks each
over torch's c10d rendezvous. ``--impl torch`` runs torch's launcher and agent instead.
Prints one line per run and exits 1 when any run failed (its failures are printed).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist


def dist_sum() -> int:
    """One rank: gloo, one all_reduce of the rank, a check, return (no destroy_process_group)."""
    dist.init_process_group("gloo")
    t = torch.tensor([int(os.environ["RANK"])])
    dist.all_reduce(t)
    expected = sum(range(int(os.environ["WORLD_SIZE"])))
    if int(t.item()) != expected:
        raise RuntimeError(f"all_reduce gave {int(t.item())}, expected {expected}")
    return int(os.environ["RANK"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mp(impl: str) -> Any:
    if impl == "torch":
        import torch.distributed.elastic.multiprocessing as mp
    else:
        import kelastic.agent.multiprocessing as mp
    return mp


def launcher_run(impl: str, ranks: int) -> str:
    """One run of the launcher probe; "" when it succeeded, else what failed."""
    mp = _mp(impl)
    port = _free_port()
    envs = {
        r: {
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        for r in range(ranks)
    }
    specs = mp.DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="finish_probe_"), redirects=mp.Std.ALL)
    ctx = mp.start_processes("probe", dist_sum, {r: () for r in range(ranks)}, envs, logs_specs=specs)
    try:
        result = ctx.wait(timeout=300, period=0.05)
    finally:
        ctx.close()
    if result is None:
        return "did not finish within 300 s"
    if result.is_failed():
        return _describe(result.failures, result.stderrs)
    if result.return_values != {r: r for r in range(ranks)}:
        return f"return values {result.return_values}"
    return ""


def _describe(failures: dict[int, Any], stderrs: dict[int, str]) -> str:
    codes = {r: f.exitcode for r, f in sorted(failures.items())}
    aborted = [r for r, f in failures.items() if f.exitcode == -6]
    tail = ""
    if aborted and stderrs.get(aborted[0]):
        with open(stderrs[aborted[0]], errors="replace") as f:
            tail = f.read()[-600:]
    return f"exit codes {codes}{' ' + tail if tail else ''}"


def c10d_spec(
    worker_spec: Any,
    fn: Any,
    args: tuple[Any, ...],
    endpoint: str,
    run_id: str,
    is_host: bool,
    nodes: int,
    local_world_size: int,
) -> Any:
    """A ``worker_spec`` (torch's or kelastic's ``WorkerSpec`` class) over torch's c10d rendezvous."""
    import torch.distributed.elastic.rendezvous.registry as registry
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    params = RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=nodes, max_nodes=nodes, is_host=is_host
    )
    return worker_spec(
        role="w",
        local_world_size=local_world_size,
        entrypoint=fn,
        args=args,
        rdzv_handler=registry.get_rendezvous_handler(params),
        max_restarts=0,
        monitor_interval=0.01,
    )


def _agent(impl: str, endpoint: str, run_id: str, is_host: bool, out: Any) -> None:
    if impl == "torch":
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    else:
        from kelastic.agent.api import WorkerSpec  # type: ignore[assignment]
        from kelastic.agent.local_agent import LocalElasticAgent  # type: ignore[assignment]
    mp = _mp(impl)
    spec = c10d_spec(WorkerSpec, dist_sum, (), endpoint, run_id, is_host, nodes=2, local_world_size=4)
    specs = mp.DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="finish_probe_"), redirects=mp.Std.ALL)
    agent = LocalElasticAgent(spec, specs, "spawn", 30)
    result = agent.run()
    spec.rdzv_handler.shutdown()
    failed = {r: f.exitcode for r, f in result.failures.items()}
    out.put((sorted(result.return_values), failed))


def agent_run(impl: str) -> str:
    """One run of the two-agent scenario; "" when both agents succeeded, else what failed."""
    endpoint = f"127.0.0.1:{_free_port()}"
    run_id = uuid.uuid4().hex[:8]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    agents = [ctx.Process(target=_agent, args=(impl, endpoint, run_id, i == 0, out)) for i in (1, 0)]
    for p in agents:
        p.start()
    for p in agents:
        p.join(300)
    problems = []
    for p in agents:
        if p.is_alive():
            p.kill()
            p.join()
            problems.append(f"agent pid {p.pid} still running after 300 s")
        elif p.exitcode != 0:
            problems.append(f"agent pid {p.pid} exited with {p.exitcode}")
    ranks: list[int] = []
    while not out.empty():
        values, failed = out.get(timeout=5)
        ranks += values
        if failed:
            problems.append(f"an agent's workers failed: exit codes {failed}")
    if not problems and sorted(ranks) != list(range(8)):
        problems.append(f"ranks that returned: {sorted(ranks)}")
    return "; ".join(problems)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["launcher", "agent"])
    parser.add_argument("--impl", choices=["kelastic", "torch"], default="kelastic")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()
    failed = 0
    for i in range(args.runs):
        began = time.monotonic()
        problem = launcher_run(args.impl, args.ranks) if args.mode == "launcher" else agent_run(args.impl)
        failed += bool(problem)
        verdict = f"FAILED: {problem}" if problem else "ok"
        print(f"{args.impl} {args.mode} run {i}: {verdict} ({time.monotonic() - began:.1f} s)", flush=True)
    print(f"{args.impl} {args.mode}: {failed} of {args.runs} runs failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
