"""Rendezvous of many simulated nodes: kelastic's backend against torch's c10d handler.

One ``kelastic-rendezvous`` store process serves both backends. For each
measurement a fresh client process creates N handlers (``--nnodes N:N``), connects
them, then releases N threads at once into ``next_rendezvous`` and reports the
time until the last one returned (connection set-up is excluded for both).

    python bench/bench_rendezvous.py       # 256 nodes: 3 runs of kelastic, 1 of c10d; then 64 nodes: 1 + 1
    python bench/bench_rendezvous.py --nodes 128 --repeat 5 --torch-repeat 3 --small 0

Prints one line per run, then per size the medians and the ratio c10d / kelastic.
A c10d run that does not finish within ``--cap`` seconds counts as ``> cap``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _make_handlers(backend: str, endpoint: str, run_id: str, nodes: int, cap: float) -> list[Any]:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from kelastic.agent.rendezvous import get_rendezvous_handler

    def make(i: int) -> Any:
        conf: dict[str, Any] = {"join_timeout": int(cap)}
        if backend == "c10d":
            conf["is_host"] = False
        else:
            conf["node_name"] = f"node{i}"
        params = RendezvousParameters(backend, endpoint, run_id, nodes, nodes, local_addr="127.0.0.1", **conf)
        handler = get_rendezvous_handler(params)
        if backend == "kelastic":
            handler.is_closed()  # connects and starts its threads, as c10d's handler does on creation
        return handler

    # Set-up is not measured; connect in parallel (a TCPStore connect sometimes stalls for seconds).
    with ThreadPoolExecutor(max_workers=32) as pool:
        return list(pool.map(make, range(nodes)))


def run_client(backend: str, endpoint: str, run_id: str, nodes: int, cap: float) -> dict[str, Any]:
    """Measure one rendezvous of ``nodes`` handlers in this process."""
    setup = time.perf_counter()
    handlers = _make_handlers(backend, endpoint, run_id, nodes, cap)
    setup = time.perf_counter() - setup
    gate = threading.Event()
    finished: list[float] = []
    errors: list[str] = []
    ranks: list[int] = []
    lock = threading.Lock()

    def run(handler: Any) -> None:
        gate.wait()
        try:
            info = handler.next_rendezvous()
            with lock:
                finished.append(time.perf_counter())
                ranks.append(info.rank)
        except Exception as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in handlers]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    gate.set()
    deadline = started + cap
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    complete = len(finished) == nodes and sorted(ranks) == list(range(nodes))
    return {
        "backend": backend,
        "nodes": nodes,
        "done": len(finished),
        "complete": complete,
        "seconds": (max(finished) - started) if complete else None,
        "errors": errors[:3],
        "setup_seconds": round(setup, 2),
    }


def measure(backend: str, endpoint: str, run_id: str, nodes: int, cap: float) -> dict[str, Any]:
    """Run one measurement in a fresh process (its lingering handler threads die with it)."""
    cmd = [sys.executable, __file__, "--client", backend, "--endpoint", endpoint, "--run-id", run_id]
    cmd += ["--nodes", str(nodes), "--cap", str(cap)]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cap + 120, env=env)
    except subprocess.TimeoutExpired:
        return {
            "backend": backend,
            "nodes": nodes,
            "done": 0,
            "complete": False,
            "seconds": None,
            "errors": ["hung"],
        }
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout)[-800:]
    return {
        "backend": backend,
        "nodes": nodes,
        "done": 0,
        "complete": False,
        "seconds": None,
        "errors": [tail],
    }


def _describe(result: dict[str, Any], cap: float) -> str:
    if result["complete"]:
        return f"{result['seconds']:.3f} s"
    return (
        f"did not complete within {cap:.0f} s ({result['done']}/{result['nodes']} joined) {result['errors']}"
    )


def _summary(nodes: int, results: dict[str, list[dict[str, Any]]], cap: float) -> bool:
    def median(backend: str) -> float | None:
        runs = results[backend]
        times = [r["seconds"] for r in runs if r["complete"]]
        return statistics.median(times) if runs and len(times) == len(runs) else None

    ours, theirs = median("kelastic"), median("c10d")
    print(f"rendezvous of {nodes} simulated nodes (threads, one store process), median:")
    print(f"  kelastic : {ours:.3f} s" if ours is not None else "  kelastic : incomplete")
    if results["c10d"]:
        print(
            f"  c10d     : {theirs:.3f} s"
            if theirs is not None
            else f"  c10d     : > {cap:.0f} s (incomplete)"
        )
        if ours is not None:
            floor, prefix = (theirs, "") if theirs is not None else (cap, ">= ")
            print(f"  ratio c10d / kelastic: {prefix}{floor / ours:.1f}x")
    return ours is not None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="runs of the kelastic backend")
    parser.add_argument("--torch-repeat", type=int, default=1, help="runs of torch's c10d backend")
    parser.add_argument("--cap", type=float, default=20.0, help="give up on one run after this many seconds")
    parser.add_argument(
        "--small",
        type=int,
        default=64,
        help="also one run of each at this size, where c10d finishes (0: skip)",
    )
    parser.add_argument("--client", choices=["kelastic", "c10d"], help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.client:
        result = run_client(args.client, args.endpoint, args.run_id, args.nodes, args.cap)
        print(json.dumps(result), flush=True)
        os._exit(0)  # handler threads may still block in the store; do not wait for them

    from kelastic.agent.rendezvous import start_server_process

    plan = [("kelastic", args.nodes)] * args.repeat + [("c10d", args.nodes)] * args.torch_repeat
    if args.small:
        plan += [("kelastic", args.small), ("c10d", args.small)]
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    server = start_server_process("127.0.0.1", 0)
    try:
        for i, (backend, nodes) in enumerate(plan):
            started = time.perf_counter()
            result = measure(backend, server.endpoint, f"bench-{backend}-{nodes}-{i}", nodes, args.cap)
            results.setdefault(nodes, {"kelastic": [], "c10d": []})[backend].append(result)
            overhead = f"(set-up {result.get('setup_seconds', '?')} s, run wall {time.perf_counter() - started:.0f} s)"
            print(f"{backend:8s} {nodes:4d} nodes: {_describe(result, args.cap)} {overhead}", flush=True)
    finally:
        server.stop()
    print()
    ok = [_summary(nodes, by_backend, args.cap) for nodes, by_backend in results.items()]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
