"""Rendezvous of many simulated nodes: kelastic's backend against torch's c10d handler.

One ``kelastic-rendezvous`` store process serves every measurement. A measurement
of N nodes spreads N handlers over ceil(N / ``--per-process``) client processes
(128 each by default: more threads per interpreter and the wait for its GIL after
every store operation grows faster than linearly), so that the figure
measures the rendezvous and not the GIL of one harness process. Each client
connects its handlers (not measured), reports ready, and all clients release
their handlers into ``next_rendezvous`` at the same wall-clock instant.

Per run it prints the phases in seconds after the release: ``join`` (the last node
took its slot and wrote its record), ``close`` (the first node learned the round's
size), ``seen`` (the last one did), ``wstore`` (rank 0 had its ring successor's
record; it hosts the worker store since its join), ``done`` (the last call
returned); the store server's CPU seconds during the run and its idle load with
every node connected (heartbeats); the clients' CPU seconds. Then the curve:
median seconds and milliseconds per node for every size.

What runs is the real handler, as agents use it, with all its threads (event
watcher, keep-alive, peer link) and store connections: thousands of them on the
few cores of one machine, where real nodes each have their own. Three settings
keep the harness's own contention out of the figure, never the handler's work:

- the clients run niced, so that the store server is not starved behind them;
- ``--switch-interval`` (1 s): the clients' ``sys.setswitchinterval``. With the
  default 5 ms, each of the hundreds of threads waiting for its process's GIL
  wakes every 5 ms to ask for it; on 2 cores those wake-ups swamp the scheduler
  (load average 800, the clients' CPU 5x per node, 2,048 nodes in 6 to 30 s). A
  real node has one handler per interpreter and no such queue. Every thread here
  blocks in I/O within microseconds, so a longer interval costs no latency;
- ``--keep-alive`` (30 s): the heartbeat period. One beat per node per period is
  O(1) work per node and no part of the rendezvous, but 4,096 simulated nodes
  beating every second would be 4,096 thread wake-ups a second on these cores
  (and late beats read as deaths, each an event every node handles). Each node
  beats once when it connects and once when it joins; with 30 s no periodic beat
  falls in the measured window. ``--keep-alive 1`` measures with them.

The clients also freeze what exists once their handlers are connected
(``gc.freeze``), as the agent does after its imports, so that no collection in
the measured window walks torch's objects.

``--controlled`` publishes a controller membership listing all N nodes first (as
the operator does), so the controlled close rule is measured. torch's c10d
handler runs side by side at ``--torch-sizes`` (it does not reach large sizes).

    python bench/bench_rendezvous.py --repeat 3                       # curve 64 .. 4096
    python bench/bench_rendezvous.py --sizes 1024 --repeat 3 --controlled
    python bench/bench_rendezvous.py --sizes 256 --torch-sizes 64,256

No figure is asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK")
#: The rendezvous targets (nodes: seconds until every node returned), printed beside the curve.
TARGETS = {1024: 2.0, 4096: 8.0}
#: Seconds over which the store's idle load (heartbeats of connected nodes) is sampled.
_IDLE_SAMPLE = 2.0


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


# ---------------------------------------------------------------------------
# client process


def _make_handlers(
    backend: str,
    endpoint: str,
    run_id: str,
    first: int,
    count: int,
    nodes: int,
    cap: float,
    keep_alive: float,
) -> list[Any]:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from kelastic.agent.rendezvous import get_rendezvous_handler

    def make(i: int) -> Any:
        conf: dict[str, Any] = {"join_timeout": int(cap)}
        if backend == "c10d":
            conf["is_host"] = False
        else:
            conf["node_name"] = f"node{i}"
            if keep_alive:
                conf["keep_alive_interval"] = keep_alive
        params = RendezvousParameters(backend, endpoint, run_id, nodes, nodes, local_addr="127.0.0.1", **conf)
        handler = get_rendezvous_handler(params)
        if backend == "kelastic":
            handler.is_closed()  # connects and starts its threads, as c10d's handler does on creation
        return handler

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(make, range(first, first + count)))


def run_client(args: argparse.Namespace) -> dict[str, Any]:
    """Create this process's handlers, report ready, wait for ``GO <t0>``, rendezvous them."""
    handlers = _make_handlers(
        args.client, args.endpoint, args.run_id, args.first, args.count, args.nodes, args.cap, args.keep_alive
    )
    # As the agent does after its imports: what exists now (torch, the handlers) is
    # frozen, so no collection during the measured window scans it.
    gc.collect()
    gc.freeze()
    print("READY", flush=True)
    line = sys.stdin.readline().split()
    t0 = float(line[1])
    gate = threading.Event()
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def run(handler: Any) -> None:
        gate.wait()
        try:
            info = handler.next_rendezvous()
            returned = time.time()
            timings = getattr(handler, "last_timings", None)
            record = {"rank": info.rank, "returned": returned}
            if timings is not None:
                record.update(joined=timings.joined, closed=timings.closed, wstore=timings.worker_store)
            with lock:
                records.append(record)
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            message = str(exc).splitlines()[0] if str(exc) else ""
            with lock:
                errors.append(f"{type(exc).__name__}: {message} (at {where.filename}:{where.lineno})")

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in handlers]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, t0 - time.time()))
    cpu = time.process_time()
    gate.set()
    deadline = time.monotonic() + args.cap
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {"records": records, "errors": errors[:3], "cpu": time.process_time() - cpu}


# ---------------------------------------------------------------------------
# parent


@dataclass
class Run:
    backend: str
    nodes: int
    processes: int
    complete: bool = False
    done: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    server_cpu: float = 0.0
    idle_server_load: float = 0.0  # CPU seconds per second of the store before the release
    client_cpu: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float | None:
        return self.phases.get("done") if self.complete else None


def _spawn(
    args: argparse.Namespace, backend: str, endpoint: str, run_id: str, first: int, count: int, nodes: int
) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--client", backend, "--endpoint", endpoint, "--run-id", run_id]
    cmd += ["--first", str(first), "--count", str(count), "--nodes", str(nodes), "--cap", str(args.cap)]
    cmd += ["--keep-alive", str(args.keep_alive), "--switch-interval", str(args.switch_interval)]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    # stderr goes to a file: a pipe nobody reads during the run would block a chatty client.
    with open(_stderr_path(run_id, first), "w") as errors:
        return subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, env=env
        )


def _stderr_path(run_id: str, first: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"bench-rendezvous-{os.getpid()}-{run_id}-{first}.stderr")


def _stderr_tail(run_id: str, first: int) -> str:
    with open(_stderr_path(run_id, first)) as f:
        return f.read()[-600:]


def _publish_membership(endpoint: str, run_id: str, nodes: int) -> None:
    from kelastic.agent.rendezvous import control

    store = control.connect(endpoint)
    names = [f"node{i}" for i in range(nodes)]
    control.publish_membership(store, run_id, nodes=names, min_nodes=1, max_nodes=nodes)


def measure(
    args: argparse.Namespace, backend: str, server_pid: int, endpoint: str, run_id: str, nodes: int
) -> Run:
    """One rendezvous of ``nodes`` handlers spread over client processes."""
    processes = max(1, math.ceil(nodes / args.per_process))
    run = Run(backend, nodes, processes)
    if backend == "kelastic" and args.controlled:
        _publish_membership(endpoint, run_id, nodes)
    shares = [nodes // processes + (1 if i < nodes % processes else 0) for i in range(processes)]
    clients = []
    firsts = [sum(shares[:i]) for i in range(processes)]
    for first, share in zip(firsts, shares, strict=True):
        clients.append(_spawn(args, backend, endpoint, run_id, first, share, nodes))
    try:
        setup_deadline = time.monotonic() + args.setup_timeout
        for first, proc in zip(firsts, clients, strict=True):
            assert proc.stdout is not None
            line = proc.stdout.readline()  # blocks; the client exits (EOF) on an error
            if line.strip() != "READY" or time.monotonic() > setup_deadline:
                proc.wait(30)
                detail = line.strip() or _stderr_tail(run_id, first)
                run.errors.append(f"a client did not get ready: {detail}")
                return run
        # The store's load with every node connected and idle: heartbeats, mostly.
        idle = _cpu_seconds(server_pid)
        time.sleep(_IDLE_SAMPLE)
        run.idle_server_load = (_cpu_seconds(server_pid) - idle) / _IDLE_SAMPLE
        t0 = time.time() + 0.3
        server_cpu = _cpu_seconds(server_pid)
        for proc in clients:
            assert proc.stdin is not None
            proc.stdin.write(f"GO {t0}\n")
            proc.stdin.flush()
        outputs = []
        for proc in clients:
            assert proc.stdout is not None
            outputs.append(proc.stdout.readline())
        run.server_cpu = _cpu_seconds(server_pid) - server_cpu
    finally:
        from kelastic.localcluster.testing import stop_process

        for first, proc in zip(firsts, clients, strict=True):
            stop_process(proc, grace=2.0)
            os.unlink(_stderr_path(run_id, first))
    records: list[dict[str, Any]] = []
    for out in outputs:
        if not out.startswith("{"):
            run.errors.append("a client printed no result")
            continue
        result = json.loads(out)
        records += result["records"]
        run.errors += result["errors"]
        run.client_cpu += result["cpu"]
    run.done = len(records)
    run.complete = run.done == nodes and sorted(r["rank"] for r in records) == list(range(nodes))

    def last(key: str) -> float | None:
        values = [r[key] for r in records if r.get(key) is not None]
        return max(values) - t0 if values else None

    for phase, value in (
        ("join", last("joined")),
        ("close", min((r["closed"] for r in records if r.get("closed")), default=None)),
        ("seen", last("closed")),
        ("wstore", next((r["wstore"] for r in records if r["rank"] == 0 and r.get("wstore")), None)),
        ("done", last("returned")),
    ):
        if value is not None:
            run.phases[phase] = value - t0 if phase in ("close", "wstore") else value
    return run


def _describe(run: Run, cap: float) -> str:
    where = f"{run.nodes:5d} nodes in {run.processes} processes"
    if not run.complete:
        return f"{run.backend:8s} {where}: incomplete within {cap:.0f} s ({run.done}/{run.nodes} returned) {run.errors[:2]}"
    phases = "  ".join(f"{k} {v:6.3f}" for k, v in run.phases.items())
    return (
        f"{run.backend:8s} {where}: {phases}  | store server CPU {run.server_cpu:5.2f} s "
        f"(idle load {100 * run.idle_server_load:.0f}%), "
        f"clients CPU {run.client_cpu:5.2f} s"
    )


def _parse_sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,128,256,512,1024,2048,4096", help="node counts of the curve")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the kelastic backend per size")
    parser.add_argument(
        "--torch-sizes", default="64,256", help="sizes at which torch's c10d handler also runs"
    )
    parser.add_argument("--controlled", action="store_true", help="publish a controller membership first")
    parser.add_argument(
        "--per-process", type=int, default=128, help="simulated nodes per client process (at most)"
    )
    parser.add_argument("--cap", type=float, default=60.0, help="give up on one run after this many seconds")
    parser.add_argument(
        "--keep-alive",
        type=float,
        default=30.0,
        help="kelastic heartbeat period in s (0: the backend's own); see the module docstring",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=1.0,
        help="sys.setswitchinterval of the client processes (see the module docstring)",
    )
    parser.add_argument("--setup-timeout", type=float, default=300.0, help="bound on connecting all handlers")
    parser.add_argument("--client", choices=["kelastic", "c10d"], help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.client:
        # Hundreds of simulated nodes share each core here, where real nodes each have
        # their own: keep the store server (not niced) from starving behind them.
        os.nice(10)
        sys.setswitchinterval(args.switch_interval)
        result = run_client(args)
        print(json.dumps(result), flush=True)
        os._exit(0)  # handler threads may still block in the store; do not wait for them

    from kelastic.agent.rendezvous import start_server_process

    sizes = _parse_sizes(args.sizes)
    plan = [("kelastic", n) for n in sizes for _ in range(args.repeat)]
    plan += [("c10d", n) for n in _parse_sizes(args.torch_sizes)]
    runs: list[Run] = []
    server = start_server_process("127.0.0.1", 0)
    mode = "controlled" if args.controlled else "uncontrolled"
    print(
        f"rendezvous store {server.endpoint} (pid {server.pid}); kelastic rounds {mode}; phases in s after release"
    )
    try:
        for i, (backend, nodes) in enumerate(plan):
            started = time.monotonic()
            run = measure(args, backend, server.pid, server.endpoint, f"bench-{backend}-{nodes}-{i}", nodes)
            runs.append(run)
            print(f"{_describe(run, args.cap)}  (wall {time.monotonic() - started:.0f} s)", flush=True)
    finally:
        server.stop()

    print(
        "\ncurve (median of complete runs; ms per node = seconds / nodes * 1000; the CPU columns are "
        "milliseconds of CPU per node: the store server's is kelastic's cost, the clients' is mostly "
        "the harness's threads sharing these cores):"
    )
    print(
        f"  {'backend':8s} {'nodes':>5s} {'seconds':>8s} {'ms/node':>8s} {'server CPU s':>12s} "
        f"{'server ms/node':>14s} {'clients ms/node':>15s} {'target':>12s}"
    )
    ok = True
    for backend, nodes in dict.fromkeys(plan):
        mine = [r for r in runs if r.backend == backend and r.nodes == nodes]
        times = [r.seconds for r in mine if r.seconds is not None]
        if len(times) < len(mine) or not times:
            print(f"  {backend:8s} {nodes:5d} {'incomplete':>8s}")
            ok = ok and backend != "kelastic"
            continue
        median = statistics.median(times)
        cpu = statistics.median(r.server_cpu for r in mine)
        clients = statistics.median(r.client_cpu for r in mine)
        target = TARGETS.get(nodes) if backend == "kelastic" else None
        verdict = "" if target is None else f"< {target:g} s {'met' if median < target else 'MISSED'}"
        print(
            f"  {backend:8s} {nodes:5d} {median:8.3f} {1000 * median / nodes:8.3f} {cpu:12.2f} "
            f"{1000 * cpu / nodes:14.3f} {1000 * clients / nodes:15.3f} {verdict:>12s}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
