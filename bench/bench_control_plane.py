"""Control-plane faults under a training job: how long the group stops stepping.

Three ``kelastic-agent`` nodes (one rank each, ``--warm-start``) train the worker
of ``bench_recovery.py`` (an all-reduce every 50 ms, every step timestamped)
against a ``kelastic-rendezvous`` store on loopback. On a fresh job for each
fault, once every rank steps:

* ``store``: the store SIGKILLed, restarted on the same address ``--store-down``
  seconds later (a store pod recreated);
* ``worker``: one node SIGKILLed (agent and worker);
* ``store+worker``: both at once, the store back ``--store-down`` seconds later;
* ``partition``: node 3 in its own network namespace, its link down for
  ``--partition`` seconds then up (the scenario of
  ``tests/agent/test_agent_partition.py``; needs root): when the survivors went on at
  world 2, and the stall of the running group when the link came back.

For each it prints the *stall* (the longest time without any rank completing a
step, in the ``--window`` seconds after the fault), the world size after it, and
how many workers started afresh (0: the group was not restarted). Figures, not
assertions. The operator's absence and a force-deleted store pod on ``kelastic
local`` are printed by ``e2e/test_e2e_elastic.py`` (``-k "test_g or test_j" -s``).

    python bench/bench_control_plane.py [--store-down 2] [--window 15]
"""

from __future__ import annotations

import argparse
import itertools
import runpy
import sys
import tempfile
import time
from pathlib import Path

import bench_recovery as br

from kelastic.agent.rendezvous.server import start_server_process

FAULTS = ("store", "worker", "store+worker", "partition")
PARTITION = Path(__file__).resolve().parent.parent / "tests" / "agent" / "test_agent_partition.py"


def run_partition(down: float) -> str:
    scenario = runpy.run_path(str(PARTITION))
    try:
        with scenario["make_net"]() as net:
            figures = scenario["run_partition"](
                net, Path(tempfile.mkdtemp(prefix="bench_cp_partition_")), down
            )
    except RuntimeError as exc:
        return f"{'partition':13s} not measured: {exc}"
    return (
        f"{'partition':13s} stall {figures['stall']:6.2f}s at the heal   survivors at world 2 after "
        f"{figures['detected']:.2f}s   world 3 again {figures['back_at_three']:.2f}s after the heal "
        f"(link down {down:.0f}s)"
    )


def _timeline(out: Path, since: float) -> list[tuple[float, int, int, int]]:
    """Every step after ``since`` as (time, world, rank, step), in time order."""
    rows = []
    for path in out.glob("steps_*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4 and float(parts[0]) >= since:
                rows.append((float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3])))
    return sorted(rows)


def run_fault(fault: str, store_down: float, window: float, cap: float, logs: Path) -> str:
    launcher = br.kelastic_launcher(window + 120, logs, warm=True)
    out = Path(tempfile.mkdtemp(prefix=f"bench_cp_{fault.replace('+', '_')}_"))
    server = launcher.start_store()
    names = ["node0", "node1", "node2"]
    try:
        t0 = time.time()
        br._start_job(launcher, names, out, logs, t0, cap)
        if br._wait_all_at(out, 3, set(names), t0, cap) is None:
            return f"{fault:13s} cold start did not reach world 3 within {cap:.0f}s"
        time.sleep(2.0)  # steady state
        fault_at = time.time()
        if "store" in fault:
            server.kill()  # type: ignore[attr-defined]
        if "worker" in fault:
            br._kill_node(launcher.nodes[2], out)
        if "store" in fault:
            time.sleep(store_down)
            host, port = server.endpoint.rsplit(":", 1)  # type: ignore[attr-defined]
            server = start_server_process(host, int(port), timeout=30)
        time.sleep(max(0.0, fault_at + window - time.time()))
        rows = _timeline(out, fault_at - 0.2)
        times = [t for t, _, _, _ in rows]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        stall = max(gaps, default=window)
        world = rows[-1][1] if rows else 0
        fresh = sum(1 for _, _, _, step in rows if step == 0)
        return f"{fault:13s} stall {stall:6.2f}s   world after {world}   workers started afresh {fresh}"
    finally:
        br._kill_all(launcher, out)
        server.stop()  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store-down", type=float, default=2.0, help="seconds the store stays down (default 2)")
    p.add_argument("--window", type=float, default=15.0, help="seconds observed after the fault (default 15)")
    p.add_argument("--cap", type=float, default=60.0, help="cap on the cold start, seconds (default 60)")
    p.add_argument("--partition", type=float, default=45.0, help="seconds node 3 is cut off (default 45)")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {FAULTS}")
    a = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench_cp_logs_"))
    print(f"3 nodes, one rank each, {br.STEP_SLEEP:.2f} s per step; logs in {logs}", flush=True)
    for fault in a.faults.split(","):
        if fault == "partition":
            print(run_partition(a.partition), flush=True)
        else:
            print(run_fault(fault, a.store_down, a.window, a.cap, logs), flush=True)


if __name__ == "__main__":
    sys.exit(main())
