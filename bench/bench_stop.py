"""Where a worker group's stop goes: ``PContext.close()`` on warm-started ranks in a collective.

What a restart's stop costs (``kelastic.agent.reform``: the old workers stop while the node
joins the next round, and the new ones wait for it). The ranks are started as ``kelastic-agent
--warm-start`` starts them: forked from a fork server that imported torch
(``kelastic.agent.warm``), running this file as a script (``warm.run_script``). Each rank
initialises a gloo group, allocates a state of ``--state-mib`` MiB (12 float32 tensors, as
``bench_goodput``'s), does one all-reduce with every rank, then enters a second one that a peer
never joins:

* ``hung``: the peer (a rank of another context, the "other node") stays alive, so the ranks
  are blocked in the collective when ``close()`` comes;
* ``crash``: the peer calls ``os._exit(1)`` first and ``close()`` comes as soon as it is gone,
  as an agent that noticed the fault at once would call it (the ranks may be on their way out
  already, their collective failed).

``close()`` is called from a thread, as the agent's stop is (``OverlappedStop``), on a context
of ``--ranks`` local ranks. Printed per round, in ms after the call: when the launcher sent
SIGTERM (the first ``signal_trees``), when the last rank had exited (its pidfd, read by a thread
of the bench: the kernel's exit, memory freed, is over), when the launcher had seen the last
exit status, when it sent its closing SIGKILL pass, and when ``close()`` returned; and the
median over rounds. ``--state-mib 0`` shows what the state's memory costs the exit; ``--maps N``
has each rank keep ``N`` files of the state's size in ``/dev/shm`` mapped (shared, populated),
as a rank's ``MemoryWriter`` keeps the files of its last checkpoints (up to 4), whose unmapping
is part of its exit too. "exited" is when the bench's own thread saw it, so it may come a
fraction of a millisecond after "seen". Figures only, nothing is asserted.

    python bench/bench_stop.py [--state-mib 512] [--ranks 1] [--rounds 5] [--scenario crash] [--maps 0]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _mark(out: Path, event: str) -> None:
    with open(out / "marks.jsonl", "a") as f:
        f.write(
            json.dumps({"e": event, "t": time.time(), "pid": os.getpid(), "rank": os.environ["RANK"]}) + "\n"
        )


def worker(out: Path, state_mib: int, maps: int, victim: bool) -> None:
    """A rank: gloo group, the state, one all-reduce with all; then the victim waits for its
    crash file and the others block in an all-reduce the victim never joins."""
    import mmap

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    numel = state_mib * 2**20 // (4 * 12)
    state = [torch.zeros(numel) for _ in range(12)] if numel else []  # zero_() touches every page
    kept = []  # the checkpoint files a MemoryWriter keeps mapped (populated, shared)
    for i in range(maps if numel and not victim else 0):
        path = out / f"shm-{os.environ['RANK']}-{i}"
        with open(path, "wb") as f:
            f.truncate(numel * 4 * 12)
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, numel * 4 * 12, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        kept.append((fd, mm))
    x = torch.ones(1)
    dist.all_reduce(x)
    _mark(out, "ready")
    if victim:
        while not (out / "crash").exists():
            time.sleep(0.005)
        os._exit(1)
    dist.all_reduce(x)  # the victim never joins it
    _mark(out, "returned")
    del state, kept


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Trace:
    """Times of the launcher's steps inside ``close()``: its signals and when it saw each exit."""

    def __init__(self) -> None:
        self.signals: list[tuple[float, int]] = []
        self.seen: dict[int, float] = {}

    def install(self, ctx: Any) -> Any:
        from kelastic.agent.multiprocessing import pcontext

        original_signal = pcontext.signal_trees

        def signal_trees(leaders: Any, extra: Any, sig: int) -> None:
            self.signals.append((time.time(), int(sig)))
            original_signal(leaders, extra, sig)

        pcontext.signal_trees = signal_trees
        original_exitcode = ctx._exitcode

        def exitcode(rank: int) -> int | None:
            code = original_exitcode(rank)
            if code is not None:
                self.seen.setdefault(rank, time.time())
            return code

        ctx._exitcode = exitcode
        return original_signal


def _exits(pids: list[int]) -> tuple[threading.Thread, dict[int, float]]:
    """A thread that records when each of ``pids`` has exited (its pidfd is readable)."""
    fds = {os.pidfd_open(pid): pid for pid in pids}
    when: dict[int, float] = {}

    def run() -> None:
        left = dict(fds)
        while left:
            ready, _, _ = select.select(list(left), [], [], 60)
            now = time.time()
            if not ready:
                return
            for fd in ready:
                when[left.pop(fd)] = now
                os.close(fd)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, when


def _wait_marks(out: Path, event: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = out / "marks.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        if sum(json.loads(line)["e"] == event for line in lines) >= count:
            return
        time.sleep(0.02)
    raise SystemExit(f"bench_stop: {count} ranks did not reach {event!r} within {timeout:.0f} s; see {out}")


def one_round(a: argparse.Namespace, root: Path, n: int) -> dict[str, float]:
    from kelastic.agent import warm
    from kelastic.agent.multiprocessing import Std, pcontext, start_processes

    out = root / f"round{n}"
    out.mkdir()
    port = _free_port()
    world = a.ranks + 1
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}
    script = (os.path.abspath(__file__), "--worker", str(out), str(a.state_mib), str(a.maps))

    def envs(first: int, count: int) -> dict[int, dict[str, str]]:
        return {r: {**common, "RANK": str(first + r), "LOCAL_RANK": str(r)} for r in range(count)}

    victim = start_processes(
        "victim", warm.run_script, {0: (*script, "victim")}, envs(0, 1),
        log_dir=out / "victim", start_method="forkserver", hold=True, redirects=Std.ALL,
    )  # fmt: skip
    ranks = start_processes(
        "rank", warm.run_script, {r: (*script, "rank") for r in range(a.ranks)}, envs(1, a.ranks),
        log_dir=out / "ranks", start_method="forkserver", hold=True, redirects=Std.ALL,
    )  # fmt: skip
    try:
        _wait_marks(out, "ready", world, 120)
        pids = list(ranks.pids().values())
        if a.scenario == "crash":
            victim_pid = victim.pids()[0]
            fd = os.pidfd_open(victim_pid)
            (out / "crash").touch()
            select.select([fd], [], [], 30)
            os.close(fd)
        else:
            time.sleep(0.2)  # the ranks are in the all-reduce by now
        watcher, exited = _exits(pids)
        trace = _Trace()
        original = trace.install(ranks)
        began = time.time()
        closer = threading.Thread(target=ranks.close, name="stop")  # as OverlappedStop does
        closer.start()
        closer.join()
        ended = time.time()
        pcontext.signal_trees = original
        watcher.join(5)
    finally:
        ranks.close(timeout=5)
        victim.close(timeout=5)
    term = [t for t, sig in trace.signals if sig != 9]
    kill = [t for t, sig in trace.signals if sig == 9]

    def ms(t: float | None) -> float:
        return float("nan") if t is None else (t - began) * 1e3

    return {
        "sigterm": ms(term[0] if term else None),
        "exited": ms(max(exited.values()) if len(exited) == len(pids) else None),
        "seen": ms(max(trace.seen.values()) if len(trace.seen) == len(pids) else None),
        "sigkill": ms(kill[0] if kill else None),
        "closed": ms(ended),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mib", type=int, default=512)
    p.add_argument("--ranks", type=int, default=1, help="local ranks in the context that is closed")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--maps", type=int, default=0, help="tmpfs files of the state's size each rank maps")
    p.add_argument("--scenario", choices=("crash", "hung"), default="crash")
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "victim")
        return
    a = p.parse_args()
    from kelastic.agent import warm

    forked = warm.fork_forkserver()  # as kelastic-agent --warm-start does, before any thread
    warm.wait_ready(300)
    print(
        f"bench_stop: {a.ranks} rank(s) + 1 peer, {a.state_mib} MiB state each, scenario {a.scenario}, "
        f"fork server {'forked from this process' if forked else 'fresh'}; ms after close() was called",
        flush=True,
    )
    cols = ("sigterm", "exited", "seen", "sigkill", "closed")
    print("round " + "".join(f"{c:>9}" for c in cols), flush=True)
    rows = []
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the checkpoint files are in memory
    with tempfile.TemporaryDirectory(prefix="bench_stop_", dir=shm) as tmp:
        for n in range(a.rounds):
            row = one_round(a, Path(tmp), n)
            shutil.rmtree(Path(tmp) / f"round{n}", ignore_errors=True)
            rows.append(row)
            print(f"{n:>5} " + "".join(f"{row[c]:9.1f}" for c in cols), flush=True)
    print("median" + "".join(f"{statistics.median(r[c] for r in rows):9.1f}" for c in cols))
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cpus")


if __name__ == "__main__":
    main()
