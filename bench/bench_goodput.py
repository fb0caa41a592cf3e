"""Goodput benchmark: what faults cost a training job, with disk and with memory checkpoints.

One job, run in one invocation under three configurations:

(a) ``torchrun`` (``--rdzv-backend c10d``, its store in the first node's agent) with a disk
    checkpoint every K steps: ``dcp.save`` with ``FileSystemWriter`` (which fsyncs its files)
    into a new folder per checkpoint, rank 0 then pointing ``latest`` at it; on restart every
    rank ``dcp.load``\\ s the folder ``latest`` names. That is torch's own recipe for a
    distributed state, and it writes each replicated tensor once, spread over the ranks;
(b) ``kelastic-agent`` (``--warm-start``, a ``kelastic-rendezvous`` store) with the same disk
    checkpoints (its memory checkpoint service off: ``--checkpoint-memory 0``);
(c) ``kelastic-agent`` with the memory checkpoint: ``dcp.save(state,
    storage_writer=MemoryWriter())`` every K steps, ``MemoryReader`` on restart
    (``--checkpoint-dir`` a fresh tmpfs folder per node incarnation, ``--checkpoint-replicas 1``);
(d) the same with saves that overlap training, every step: ``OverlappingSaver.save(state)``
    after the update, whose copy runs through the next step's work; the step waits
    (``wait_staged()``) only before its own update, and the next save first waits for the
    previous one to be committed. Its save stall is the time the training thread spends in
    those two calls.
(s) (c) with one hot standby: one more ``kelastic-agent --standby``, warm and waiting in the
    rendezvous without a rank, takes a lost node's place in the same re-form (the lost node's
    replacement then waits as the next standby). Faults strike members only.
(e) (d) and (s) together: overlapping saves every step and one hot standby, where a fault
    should cost less than a step; the worker trains under ``kelastic.inprocess.run``, so a
    re-form keeps the surviving nodes' worker processes, state and imports
    (``--restart-processes``: without it, every re-form stops and starts every worker), and
    each node holds a spare worker process (``KELASTIC_SPARE_WORKERS=1``) that takes the
    place of one that crashed (``--no-spares``: a crashed worker's node starts a new one).
    The worker restores with ``kelastic.checkpoint.restore(state, replicated=True)``: after a
    fault the ranks whose process was kept hand their live state to the others, no checkpoint
    read and no step redone (``--no-roll-forward``: every rank restores the newest checkpoint).
(t) a straggler: (e) (overlapping saves every step, one hot standby, in-process workers that
    roll forward) with steps of CPU work
    (the rank spins for ``--step-time`` seconds of its own CPU time, so a process stopped part
    of the time takes longer; three ranks then need three cores' worth, so on fewer cores the
    fault-free step is longer) and ``--stragglers policy=Replace,ratio=1.5,window=5``. No fault: after a fault-free stretch
    (``--straggler-before`` seconds) one member's worker processes are stopped and continued
    in a duty cycle (SIGSTOP 2/3, SIGCONT 1/3 of every 0.3 s: a third of the speed) until the
    group has replaced it with the standby, then the job runs ``--straggler-after`` seconds
    more. It prints the time from the slowdown to the replacement, and the step time before,
    while slowed and after, beside the fault-free one.

The job (this file with ``--worker``): N nodes of one rank each (``--nodes``, default 3,
``--nnodes N-1:N``), gloo, a state of ``--state-mib`` MiB (default 512) shaped like four
layers' weights and Adam's two moments (12 float32 tensors, replicated on every rank as
with DDP); a step all-reduces a small tensor, sleeps until ``--step-time`` has passed (a GPU
step's forward and backward without their compute, so that two cores can run three ranks),
then updates one row of every tensor as a pure function of the step number (the optimizer
step). Both 1.0 s and 0.1 s steps by default.

Each configuration first calibrates: the job's first incarnation times ``--calibrate`` saves
of its state (the cost is the median from the third save on, the slowest rank's: the first
two allocate, a memory checkpoint keeping the last complete one and one in progress) and plain
copies of the same tensors into preallocated memory, then takes the Young/Daly interval
``sqrt(2 * save cost * MTBF)`` (MTBF = ``--fault-every``) in steps, or every step where the
first-order waste ``save/interval + interval/(2*MTBF)`` is lower there. (d) saves every step;
its calibration times the stall (the save's call, and the wait before the next update after a
step's work). The window opens
at its first step after calibration. Faults fall every ``--fault-every`` seconds (at
0.5, 1.5, 2.5 ... intervals into ``--window``), cycling through:

* **crash**: the victim node's rank calls ``os._exit(1)`` (the bench touches a file a thread of
  the rank polls every 10 ms, so that the crash falls where the fault's time says, mid-step);
* **pod delete**, emulated without Kubernetes: SIGTERM to the victim node's agent, as the
  kubelet sends it, SIGKILL after a 30 s grace; its tmpfs folder removed (the pod's
  ``/dev/shm`` goes with it); then a replacement agent with the same node name started at
  once, as the operator does;
* **node kill**: the victim's agent SIGKILLed with its workers, its tmpfs folder removed,
  a replacement started.

Victims alternate over nodes 1..N-1: torchrun's store lives in node 0's agent, and losing
it ends a torchrun job outright. Every wait has a deadline. A job whose restarted group
has not stepped by the next fault's time (or ``--stall-cap`` seconds after the fault),
whose agents all exited, or (torchrun) whose store host exited, is reported as failed
after the fault before it; its remaining window counts no steps and its state is its
last checkpoint.

Per configuration it prints the chosen K and why; the save stall per checkpoint (median of
the window's saves); the restore time (median, from each fault to the first step of the
group that restarted after it); steps lost per fault (steps redone after every restart in
the window, down and up, and for a failed job the steps past its last checkpoint, per
fault); lost seconds per fault (window - steps kept x fault-free step time - save stalls,
per fault); and goodput = steps kept in the final lineage per second of window /
fault-free steps per second. For the kelastic configurations it also prints the job-status
figure: the operator's own computation (``kelastic.operator.goodput``, what ``status.goodput``
shows) over the agents' goodput records, read from the rendezvous store every
``--status-every`` seconds as the operator does, accumulated from the window's opening. The fault-free rate is measured by the same job without
checkpoints and without faults, on kelastic-agent, over ``--baseline-window`` seconds.
Then the issue's targets beside the figures, and whether each is met. Times are printed,
never asserted.

    python bench/bench_goodput.py [--step-time 1.0] [--window 600] [--fault-every 120]
    python bench/bench_goodput.py --window 60 --fault-every 20 --state-mib 64   # smoke, minutes
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

#: A pod's termination grace period (Kubernetes' default): SIGKILL after it.
GRACE_S = 30.0
#: Collective timeout in the worker: a rank stuck on a lost peer is freed by it.
COLLECTIVE_TIMEOUT_S = 60
FAULT_KINDS = ("crash", "pod delete", "node kill")


# --- decisions (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """How often a configuration checkpoints, and why."""

    steps: int
    reason: str


def waste(save_s: float, interval_s: float, mtbf_s: float) -> float:
    """First-order share of time lost to checkpointing every ``interval_s`` of work: the save
    stall per interval plus half an interval redone per fault (Young's model)."""
    return save_s / interval_s + interval_s / (2.0 * mtbf_s)


def choose_interval(save_s: float, step_s: float, mtbf_s: float) -> Interval:
    """The Young/Daly checkpoint interval ``sqrt(2 * save * MTBF)`` in whole steps, or every
    step where that wastes less (the optimum falls under one step when saves are cheap)."""
    optimum_s = math.sqrt(2.0 * max(save_s, 0.0) * mtbf_s)
    candidates = {1, max(1, math.floor(optimum_s / step_s)), max(1, math.ceil(optimum_s / step_s))}
    best = min(sorted(candidates), key=lambda k: waste(save_s, k * step_s, mtbf_s))
    why = (
        f"save {save_s:.3f} s, MTBF {mtbf_s:.0f} s: sqrt(2*save*MTBF) = {optimum_s:.1f} s "
        f"= {optimum_s / step_s:.1f} steps of {step_s:g} s"
    )
    if best == 1 and optimum_s < step_s:
        why += ", under one step: every step"
    else:
        why += f": every {best} step{'s' if best > 1 else ''}"
    return Interval(best, f"{why} (expected waste {100 * waste(save_s, best * step_s, mtbf_s):.1f}%)")


def lineage(steps: Sequence[tuple[float, int]]) -> list[tuple[float, int]]:
    """The completions that the final state descends from, oldest first.

    ``steps`` are ``(time, step number)`` completions in any order, redone steps included.
    Walking back in time from the last completion, each step's lineage completion is the
    latest one of that step before its successor's: a step completed and then lost to a
    restore is superseded by its redo.
    """
    ordered = sorted(steps)
    if not ordered:
        return []
    kept = [ordered[-1]]
    need = ordered[-1][1] - 1
    for t, s in reversed(ordered[:-1]):
        if need < 1:
            break
        if s == need:
            kept.append((t, s))
            need -= 1
    return kept[::-1]


@dataclass
class Fault:
    kind: str
    node: str
    time: float
    note: str = ""
    #: the restores that followed it, before the next fault: what each took and redid
    restarts: list[str] = field(default_factory=list)


@dataclass
class Figures:
    """One configuration's result over its window (times in seconds)."""

    label: str
    interval: Interval | None = None
    save_cost: float | None = None
    copy_share: float | None = None
    copy_full: float | None = None
    stalls: list[float] = field(default_factory=list)
    restores: list[float | None] = field(default_factory=list)
    redone: int = 0
    faults: list[Fault] = field(default_factory=list)
    kept: int = 0
    window: float = 0.0
    goodput: float | None = None
    #: the job-status figure (the operator's status.goodput over the window), and its parts
    status: dict[str, Any] | None = None
    lost_per_fault: float | None = None
    failed: str | None = None
    checks: tuple[int, int] = (0, 0)
    sources: dict[str, int] = field(default_factory=dict)
    #: bytes every node's ranks fetched from other nodes, at each restore in the window
    fetched: list[int] = field(default_factory=list)
    #: per fault, ms after it per phase (goodput_phases.breakdown)
    phases: list[dict[str, float | None]] = field(default_factory=list)


def analyse(
    fig: Figures, events: list[dict[str, Any]], w0: float, w1: float, fault_free_rate: float
) -> Figures:
    """Fill ``fig`` from the worker's events (rank 0's ``events.jsonl``) and its faults."""
    steps = [(e["t"], e["step"]) for e in events if e["e"] == "step"]
    # A roll-forward restores the step the survivors completed, which the rank 0 that wrote
    # these events may not have (it was lost, or was one step behind): the link that says the
    # state descends from that step's completion.
    steps += [(e["t"], e["step"]) for e in events if e["e"] == "restored" and e.get("source") == "live"]
    saves = [e for e in events if e["e"] == "saved"]
    if fig.failed is not None:
        # a failed job keeps what its last checkpoint holds
        last_saved = max((e["step"] for e in saves), default=0)
        fig.redone += max((s for _, s in steps), default=0) - last_saved  # never to be redone
        steps = [(t, s) for t, s in steps if s <= last_saved]
    line = lineage(steps)
    fig.window = w1 - w0
    fig.kept = sum(1 for t, _ in line if w0 <= t <= w1)
    fig.stalls = [e["seconds"] for e in saves if w0 <= e["t"] <= w1]
    fig.goodput = fig.kept / fig.window / fault_free_rate if fault_free_rate > 0 else None
    # restore time: from each fault to the first step of an incarnation begun after it
    for f in fig.faults:
        later = [e for e in events if e["e"] == "step" and e["t"] > f.time and e["began"] > f.time]
        fig.restores.append(min(e["t"] for e in later) - f.time if later else None)
    # steps redone: at every restore in the window, the steps completed beyond the restored one
    done_before = 0
    for e in sorted(events, key=lambda e: e["t"]):
        if e["e"] == "step":
            done_before = max(done_before, e["step"])
        elif e["e"] == "restored" and e["t"] >= w0:
            redone = max(0, done_before - e["step"])
            fig.redone += redone
            cause = next((f for f in reversed(fig.faults) if f.time <= e["t"]), None)
            copied = e.get("copied") or []
            if cause is not None:
                fetched = ", ".join(f"{n} {_mib(f)}" for n, _, f in copied)
                cause.restarts.append(
                    f"+{e['t'] - cause.time:.1f} s: step {e['step']} from {e['source']} in "
                    f"{e['seconds']:.2f} s at world {e['world']}, {redone} redone"
                    + (f"; fetched over the network: {fetched}" if copied else "")
                )
            if copied:
                fig.fetched.append(sum(int(f) for _, _, f in copied))
            fig.sources[e["source"]] = fig.sources.get(e["source"], 0) + 1
            ok, n = fig.checks
            fig.checks = (ok + bool(e["check"]), n + 1)
    if fig.faults:
        lost = fig.window - fig.kept / fault_free_rate - sum(fig.stalls)
        fig.lost_per_fault = lost / len(fig.faults)
    return fig


# --- worker --------------------------------------------------------------------------------------

LAYERS = 4


def worker(a: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    began = time.time()
    node = os.environ.get("BENCH_NODE", "?")
    out: Path = a.out
    phases = out / "phases.jsonl"

    def phase(name: str) -> None:
        """Every rank's phases of its start, for the breakdown (bench/goodput_phases.py)."""
        with open(phases, "a") as f:
            f.write(json.dumps({"e": name, "t": time.time(), "node": node, "pid": os.getpid()}) + "\n")

    phase("began")
    # four layers' weights and Adam's two moments, replicated on every rank (as with DDP);
    # allocated once per process: a worker kept across a re-form keeps them
    per = a.state_mib * 2**20 // (3 * LAYERS)
    rows = max(1, per // 4096)
    tensors: dict[str, Any] = {}
    for i in range(LAYERS):
        tensors[f"model.layer{i}.weight"] = torch.zeros(rows, 1024)
        tensors[f"optim.layer{i}.exp_avg"] = torch.zeros(rows, 1024)
        tensors[f"optim.layer{i}.exp_avg_sq"] = torch.zeros(rows, 1024)
    names = sorted(tensors)
    state: dict[str, Any] = {"tensors": tensors, "step": torch.zeros((), dtype=torch.int64)}
    end = time.monotonic() + a.duration
    crash = out / f"crash_{node}"

    def crash_when_told() -> None:
        while True:
            if crash.exists():
                crash.unlink(missing_ok=True)
                os._exit(1)  # a failing rank: the others block in the all-reduce until it is gone
            time.sleep(0.01)

    crashing: list[threading.Thread] = []

    # A standby's worker started early waits in kelastic.inprocess.run for its first group.
    waited = os.environ.get("KELASTIC_HANDOFF_PARKED") == "1"

    def train() -> None:
        incarnation = began
        if crashing or waited:  # a kept worker, or one started early: its group begins now
            incarnation = time.time()
            phase("began")
        phase("pg")
        train_in_group(a, state, tensors, names, phase, incarnation, node, end, crash_when_told, crashing)

    if a.in_process:
        import kelastic.inprocess

        kelastic.inprocess.run(train, backend="gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        train()
        dist.destroy_process_group()


def train_in_group(
    a: argparse.Namespace,
    state: dict[str, Any],
    tensors: dict[str, Any],
    names: list[str],
    phase: Callable[[str], None],
    began: float,
    node: str,
    end: float,
    crash_when_told: Callable[[], None],
    crashing: list[threading.Thread],
) -> None:
    """One group's training (the whole run, or one generation of a kept worker): restore,
    calibrate once per job, then steps until ``end``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from kelastic.agent import progress

    out: Path = a.out
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = next(iter(tensors.values())).shape[0]

    def emit(event: str, **fields: object) -> None:
        if rank == 0:
            line = {
                "e": event,
                "t": time.time(),
                "world": world,
                "began": began,
                "pid": os.getpid(),
                **fields,
            }
            with open(out / "events.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")

    def update(s: int) -> None:
        """The state after step s is a pure function of s: row (s-1) of tensor i holds s*16+i."""
        for i, k in enumerate(names):
            tensors[k][(s - 1) % rows].fill_(float(s * 16 + i))
        state["step"].fill_(s)

    def consistent() -> bool:
        s = int(state["step"])
        return s == 0 or all(
            float(tensors[k][(s - 1) % rows, 0]) == float(s * 16 + i) for i, k in enumerate(names)
        )

    disk = Path(a.disk_dir) if a.disk_dir else None
    saver = None
    if a.mode == "overlap":
        from kelastic.checkpoint import OverlappingSaver

        saver = OverlappingSaver()

    def save(s: int) -> None:
        if saver is not None:
            saver.save(state, step=s)
        elif a.mode == "memory":
            from kelastic.checkpoint import MemoryWriter

            dcp.save(state, storage_writer=MemoryWriter(step=s))
        else:
            assert disk is not None
            folder = disk / f"step-{s:08d}"
            dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
            if rank == 0:
                tmp = disk / "latest.tmp"
                tmp.write_text(folder.name)
                os.replace(tmp, disk / "latest")
                for old in sorted(disk.glob("step-*"))[:-2]:  # keep the newest two
                    shutil.rmtree(old, ignore_errors=True)

    def restore() -> str | None:
        if a.mode in ("memory", "overlap") and a.in_process and not a.no_roll_forward:
            from kelastic.checkpoint import restore as roll_or_restore

            done = roll_or_restore(state, replicated=True)
            if done is None:
                return None
            gathered = [None] * world
            dist.all_gather_object(
                gathered, [node, done.local_bytes, done.fetched_bytes + done.received_bytes]
            )
            copied.extend(gathered)
            return done.source
        if a.mode in ("memory", "overlap"):
            from kelastic.checkpoint import MemoryReader

            reader = MemoryReader()
            if not reader.exists():
                return None
            dcp.load(state, storage_reader=reader)
            assert reader.choice is not None
            # what each node read from its own memory and fetched from others
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, [node, reader.local_bytes, reader.fetched_bytes])
            copied.extend(gathered)
            return str(reader.choice.source.value)
        if a.mode == "disk":
            assert disk is not None
            pointer = disk / "latest"
            if not pointer.exists():
                return None
            dcp.load(state, storage_reader=dcp.FileSystemReader(disk / pointer.read_text().strip()))
            return "disk"
        return None

    # Leaving by an exception (the group broke) abandons the save in flight: see OverlappingSaver.
    with saver if saver is not None else contextlib.nullcontext():
        t = time.monotonic()
        copied: list[Any] = []  # per node: [name, bytes read from its memory, bytes fetched]
        source = restore()
        phase("restored")
        if source is not None:
            emit("restored", step=int(state["step"]), seconds=time.monotonic() - t, source=source,
                 check=consistent(), copied=copied)  # fmt: skip

        calibration = out / "calibration.json"
        if a.mode == "none":
            every = 0
        elif calibration.exists():
            every = json.loads(calibration.read_text())["steps"]
        else:
            staged = None if saver is None else saver.wait_staged
            every = calibrate(a, tensors, names, save, staged, rank, world, calibration)
            if saver is not None:
                saver.wait()  # the calibration's last save is over before the state changes
        x = torch.ones(1)
        if not crashing:
            crashing.append(threading.Thread(target=crash_when_told, daemon=True))
            crashing[0].start()
        s = int(state["step"])
        inflight: tuple[int, float] | None = None  # (d): the save in flight and its stall so far
        first_step = True
        while time.monotonic() < end:
            t0 = time.monotonic()
            # (t): what a rank waits on its peers is not its own work (how a straggler shows)
            with progress.waiting() if a.busy else contextlib.nullcontext():
                dist.all_reduce(x)
            s += 1
            if a.busy:  # forward and backward as CPU work: slower when the process is stopped at times
                spin(a.step_time)
            else:
                time.sleep(max(0.0, a.step_time - (time.monotonic() - t0)))  # forward and backward
            if saver is not None and inflight is not None:
                t1 = time.monotonic()
                saver.wait_staged()  # the update changes the state next
                inflight = (inflight[0], inflight[1] + time.monotonic() - t1)
            if a.in_process:
                import kelastic.inprocess

                with kelastic.inprocess.updating(s):  # the state a survivor can hand on
                    update(s)
            else:
                update(s)
            emit("step", step=s)
            if first_step:
                first_step = False
                phase("step")
            progress.update(s)  # what the agent's goodput record (and so the job's status) is made of
            if every and s % every == 0 and saver is not None:
                t1 = time.monotonic()
                committed = saver.save(state, step=s)  # waits for the previous save first
                if inflight is not None and committed == inflight[0]:
                    emit("saved", step=committed, seconds=inflight[1])
                inflight = (s, time.monotonic() - t1)
            elif every and s % every == 0:
                t1 = time.monotonic()
                save(s)
                emit("saved", step=s, seconds=time.monotonic() - t1)


def spin(cpu_seconds: float) -> None:
    """Work until this thread has used ``cpu_seconds`` of CPU time (a step's compute)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        sum(range(1000))


def calibrate(
    a: argparse.Namespace,
    tensors: dict[str, Any],
    names: list[str],
    save: Callable[[int], None],
    staged: Callable[[], None] | None,
    rank: int,
    world: int,
    calibration: Path,
) -> int:
    """Time saves of the initial state and plain copies of the same tensors; choose K (all
    ranks agree: they take the slowest rank's times); rank 0 writes ``calibration.json``.

    With ``staged`` (overlapping saves) a save's cost is its stall: the call, then after a
    step's work the wait before the state may change; K is 1."""
    import torch
    import torch.distributed as dist

    def timed(fn: Callable[[], None], reps: int) -> list[float]:
        times = []
        for _ in range(reps):
            t = time.monotonic()
            fn()
            times.append(time.monotonic() - t)
        return times

    # plain copies into preallocated (and once touched) memory: this rank's share of the
    # tensors, as DCP spreads replicated tensors over the ranks, and the whole state
    share = names[rank::world]
    dst = {k: torch.empty_like(tensors[k]).fill_(1.0) for k in names}  # every page touched

    def copy(keys: list[str]) -> Callable[[], None]:
        def run() -> None:
            for k in keys:
                dst[k].copy_(tensors[k])

        return run

    copy_share = statistics.median(timed(copy(share), 5))
    copy_full = statistics.median(timed(copy(names), 5))
    dst.clear()  # give the memory back before the saves
    saves = []
    for _ in range(max(3, a.calibrate)):
        # one step apart, as the tightest interval would have them: a memory save waits for
        # the previous one's replica, which back-to-back saves would charge to every save
        time.sleep(a.step_time)
        dist.barrier()
        took = timed(lambda: save(0), 1)[0]
        if staged is not None:
            time.sleep(a.step_time)  # the next step's work: the copy runs meanwhile
            took += timed(staged, 1)[0]
        saves.append(took)
    # The first two saves allocate (the memory checkpoint keeps the last complete one and
    # one in progress, in files it then reuses): the steady cost is from the third save on.
    cost = statistics.median(saves[2:])
    worst = torch.tensor([cost, copy_share, copy_full], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    cost, copy_share, copy_full = (float(v) for v in worst)
    if staged is None:
        interval = choose_interval(cost, a.step_time, a.mtbf)
    else:
        interval = Interval(1, f"overlapping saves: every step (stall {cost:.3f} s a save)")
    if rank == 0:
        info = {"steps": interval.steps, "reason": interval.reason, "save_cost": cost,
                "saves": saves, "copy_share": copy_share, "copy_full": copy_full}  # fmt: skip
        tmp = calibration.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, calibration)
    return interval.steps


# --- driver --------------------------------------------------------------------------------------


class Launcher(Enum):
    TORCHRUN = "torchrun"
    KELASTIC = "kelastic"


@dataclass(frozen=True)
class Config:
    label: str
    launcher: Launcher
    mode: str  # disk | memory | overlap | none
    standbys: int = 0  # kelastic-agent --standby nodes beside --nodes
    #: ``kelastic-agent --stragglers`` (empty: the agent's default); a step of CPU work (``busy``)
    stragglers: str = ""
    busy: bool = False
    #: the worker trains under ``kelastic.inprocess.run``: a re-form keeps the survivors' processes
    in_process: bool = False

    @property
    def in_memory(self) -> bool:
        """Whether its checkpoints live in the agents' memory (their tmpfs folders)."""
        return self.mode in ("memory", "overlap")


CONFIGS = (
    Config("(a) torchrun + disk", Launcher.TORCHRUN, "disk"),
    Config("(b) kelastic + disk", Launcher.KELASTIC, "disk"),
    Config("(c) kelastic + memory", Launcher.KELASTIC, "memory"),
    Config("(d) kelastic + overlapping", Launcher.KELASTIC, "overlap"),
    Config("(s) (c) + 1 standby", Launcher.KELASTIC, "memory", standbys=1),
    Config("(e) (d) + 1 standby", Launcher.KELASTIC, "overlap", standbys=1, in_process=True),
    Config(
        "(t) a straggler: (e) with steps of CPU work, one node at 1/3 speed",
        Launcher.KELASTIC,
        "overlap",
        standbys=1,
        stragglers="policy=Replace,ratio=1.5,window=5",
        busy=True,
        in_process=True,
    ),
)
BASELINE = Config("fault-free, no checkpoint", Launcher.KELASTIC, "none")


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]
    shm: Path | None


class Job:
    """One configuration's nodes, store and folders; ``close()`` kills whatever is left."""

    def __init__(self, cfg: Config, a: argparse.Namespace, step_time: float, root: Path) -> None:
        self.cfg, self.a, self.step_time = cfg, a, step_time
        self.dir = Path(tempfile.mkdtemp(prefix=f"{cfg.launcher.value}_{cfg.mode}_", dir=root))
        self.out = self.dir / "out"
        self.out.mkdir()
        self.disk = self.dir / "disk"
        self.disk.mkdir()
        self.shm_root = Path("/dev/shm") / f"kelastic-goodput-{os.getpid()}-{self.dir.name}"
        self.secret = self.dir / "job-secret"  # every agent of the job gets it (--job-secret-file)
        self.secret.write_text(secrets.token_hex(32))
        self.nodes: dict[str, Node] = {}
        self.incarnations = 0
        self.run_id = f"goodput-{time.time_ns()}"
        self.server: Any = None
        self.endpoint = ""
        self._conn: Any = None  # a client of the rendezvous store (kelastic), opened on first read
        if cfg.launcher is Launcher.KELASTIC:
            from kelastic.agent.rendezvous.server import start_server_process

            host = f"127.{os.getpid() % 200 + 50}.{int(time.time() * 1000) % 250 + 1}.{len(cfg.mode) + 10}"
            self.server = start_server_process(host, 29400, timeout=30)
            self.endpoint = self.server.endpoint
        else:
            from bench_recovery import _free_port  # this folder is the script's: on sys.path

            self.endpoint = f"127.0.0.1:{_free_port()}"

    def command(self, name: str, shm: Path | None, standby: bool = False) -> list[str]:
        a, n = self.a, self.a.nodes
        worker = [
            __file__, "--worker", "--out", str(self.out), "--mode", self.cfg.mode,
            "--state-mib", str(a.state_mib), "--step-time", str(self.step_time),
            "--disk-dir", str(self.disk), "--mtbf", str(a.fault_every), "--calibrate", str(a.calibrate),
            "--duration", str(a.window * 4 + 600), *(["--busy"] if self.cfg.busy else []),
            *(["--in-process"] if self.cfg.in_process and not a.restart_processes else []),
            *(["--no-roll-forward"] if a.no_roll_forward else []),
        ]  # fmt: skip
        restarts = str(4 * max(1, int(a.window / a.fault_every)) + 10)
        if self.cfg.launcher is Launcher.TORCHRUN:
            return [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{max(1, n - 1)}:{n}",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.run_id, "--max-restarts", restarts, *worker,
            ]  # fmt: skip
        ckpt = (
            [
                "--checkpoint-dir",
                str(shm),
                "--checkpoint-memory",
                a.checkpoint_memory,
                "--checkpoint-replicas",
                "1",
            ]
            if self.cfg.in_memory
            else ["--checkpoint-memory", "0"]
        )
        return [
            sys.executable, "-m", "kelastic.agent", "--nnodes", f"{max(1, n - 1)}:{n}", "--nproc-per-node", "1",
            "--rdzv-backend", "kelastic", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
            "--max-restarts", restarts, "--local-addr", "127.0.0.1", "--warm-start",
            "--job-secret-file", str(self.secret),
            "--log-dir", str(self.dir / "agent-logs" / f"{name}.{self.incarnations}"), *ckpt,
            *(["--standby"] if standby else []),
            *(["--stragglers", self.cfg.stragglers] if self.cfg.stragglers else []), *worker,
        ]  # fmt: skip

    def start(self, name: str, standby: bool = False) -> Node:
        self.incarnations += 1
        shm = self.shm_root / f"{name}.{self.incarnations}" if self.cfg.in_memory else None
        env = {
            **os.environ,
            "BENCH_JOB": str(self.dir),  # every process of the node inherits the tags (see kill)
            "BENCH_NODE": name,
            "KELASTIC_NODE_NAME": name,
            "PYTHONUNBUFFERED": "1",
            # the agent's events, for the per-fault breakdown (bench/goodput_phases.py)
            "KELASTIC_EVENTS_FILE": str(self.dir / "agent-events" / f"{name}.{self.incarnations}.jsonl"),
        }
        if not (self.cfg.in_process and not self.a.restart_processes):
            # the worker inits its group itself: workers started before their group would fail
            env["KELASTIC_KEEP_WORKERS"] = "0"
        elif not self.a.no_spares:
            env["KELASTIC_SPARE_WORKERS"] = "1"
        env.pop("OMP_NUM_THREADS", None)
        with (self.dir / f"{name}.log").open("ab") as f:
            proc = subprocess.Popen(
                self.command(name, shm, standby),
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        node = Node(name, proc, shm)
        self.nodes[name] = node
        return node

    def start_all(self, deadline: float) -> None:
        for i in range(self.a.nodes):
            self.start(f"node{i}")
            if i == 0 and self.cfg.launcher is Launcher.TORCHRUN:
                from bench_recovery import _wait_listening

                _wait_listening(self.endpoint, deadline)  # node 0 hosts torchrun's store
        for i in range(self.cfg.standbys):
            self.start(f"standby{i}", standby=True)

    def members(self) -> list[str] | None:
        """The nodes of the job's current rendezvous round (kelastic; None when unknown)."""
        if self.cfg.launcher is not Launcher.KELASTIC:
            return None
        try:
            from kelastic.agent.rendezvous import control

            return list(control.read_status(self._store(), self.run_id).members)
        except Exception:
            self._conn = None
            return None

    def _store(self) -> Any:
        from kelastic.agent.rendezvous import control

        if self._conn is None:
            self._conn = control.connect(self.endpoint, timeout=5.0)
        return self._conn

    def status_goodput(self, prior: dict[str, Any] | None) -> dict[str, Any] | None:
        """One read of the store as the operator makes it, folded into ``prior`` by the
        operator's own code: what ``status.goodput`` would show now (None when unreadable)."""
        from kelastic.agent.rendezvous import control
        from kelastic.operator import goodput

        try:
            status = control.read_status(self._store(), self.run_id)
        except Exception:
            self._conn = None
            return prior
        reports = [goodput.report(node, record) for node, record in status.goodputs]
        return goodput.goodput_status(prior, reports, time.time()) or prior

    def kill(self, node: Node) -> None:
        """SIGKILL the node's agent and every process under it (workers run in sessions of
        their own): those that carry this job's and this node's tags in their environment."""
        if node.proc.poll() is None:
            node.proc.kill()
        for pid in _tagged(str(self.dir), node.name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if node.shm is not None:
            shutil.rmtree(node.shm, ignore_errors=True)  # the node's memory is gone with it

    def inject(self, kind: str, name: str) -> str:
        """Inject one fault; returns a note on what happened."""
        node = self.nodes[name]
        if kind == "crash":
            (self.out / f"crash_{name}").touch()
            return ""
        if kind == "pod delete":
            try:
                os.kill(node.proc.pid, signal.SIGTERM)  # the kubelet signals the container's PID 1
            except ProcessLookupError:
                pass
            try:
                node.proc.wait(timeout=GRACE_S)
                note = f"agent exited {node.proc.returncode} after SIGTERM"
            except subprocess.TimeoutExpired:
                note = f"agent still running {GRACE_S:.0f} s after SIGTERM: SIGKILLed"
        else:
            note = ""
        self.kill(node)
        self.start(name)
        return note

    def alive(self) -> bool:
        return any(n.proc.poll() is None for n in self.nodes.values())

    def failure(self, faults: list[Fault], stall_cap: float) -> str | None:
        """Why the job can no longer step, or None while it may."""
        after = f"job failed after fault {len(faults)}" if faults else "job failed before any fault"
        if not self.alive():
            return f"{after} (its agents all exited)"
        host = self.nodes.get("node0")
        if self.cfg.launcher is Launcher.TORCHRUN and host is not None and host.proc.poll() is not None:
            return f"{after} (node0, the host of torchrun's store, exited {host.proc.returncode})"
        if (
            faults
            and time.time() - faults[-1].time > stall_cap
            and not _restarted_since(self, faults[-1].time)
        ):
            return f"{after} (no step in {stall_cap:.0f} s)"
        return None

    def close(self) -> None:
        for node in list(self.nodes.values()):
            self.kill(node)
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.shm_root, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)

    def events(self) -> list[dict[str, Any]]:
        path = self.out / "events.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a kill
        return rows

    def phase_records(self) -> list[dict[str, Any]]:
        """The agents' events and every rank's phases, as goodput_phases.breakdown reads them."""
        rows = []
        files = [*(self.dir / "agent-events").glob("*.jsonl"), self.out / "phases.jsonl"]
        for path in files:
            if not path.exists():
                continue
            node = path.name.split(".")[0]
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if "name" in rec:  # an agent's event
                    md = rec.get("metadata", {})
                    rec = {**md, "e": rec["name"].removeprefix("kelastic.agent."), "t": rec["timestamp"],
                           "node": node}  # fmt: skip
                rows.append(rec)
        return rows

    def calibration(self) -> dict[str, Any] | None:
        path = self.out / "calibration.json"
        return json.loads(path.read_text()) if path.exists() else None


def _last_step_time(job: Job) -> float | None:
    steps = [e["t"] for e in job.events() if e["e"] == "step"]
    return max(steps) if steps else None


def _restarted_since(job: Job, t: float) -> bool:
    """Whether a group whose workers began after ``t`` has stepped (every fault restarts it)."""
    return any(e["e"] == "step" and e["began"] > t for e in job.events())


def run_config(cfg: Config, a: argparse.Namespace, step_time: float, root: Path, rate: float) -> Figures:
    """Start the job, wait for calibration, inject the faults over the window, analyse."""
    fig = Figures(cfg.label)
    job = Job(cfg, a, step_time, root)
    try:
        job.start_all(time.time() + a.start_cap)
        # the window opens at the first step after calibration
        deadline = time.time() + a.start_cap
        w0 = None
        while time.time() < deadline and w0 is None:
            time.sleep(0.2)
            cal = job.calibration()
            if cal is not None:
                w0 = next((e["t"] for e in job.events() if e["e"] == "step"), None)
            if not job.alive():
                break
        if w0 is None:
            fig.failed = f"did not start within {a.start_cap:.0f} s"
            return fig
        cal = job.calibration()
        assert cal is not None
        fig.interval = Interval(cal["steps"], cal["reason"])
        fig.save_cost, fig.copy_share, fig.copy_full = cal["save_cost"], cal["copy_share"], cal["copy_full"]
        w1 = w0 + a.window
        due = [w0 + (i + 0.5) * a.fault_every for i in range(int(a.window / a.fault_every))]
        status: dict[str, Any] | None = None
        polled = 0.0
        victims = [f"node{i}" for i in range(1, a.nodes)] or ["node0"]
        while time.time() < w1:
            fig.failed = job.failure(fig.faults, a.stall_cap)
            if fig.failed is not None:
                break
            if cfg.launcher is Launcher.KELASTIC and time.time() - polled >= a.status_every:
                polled = time.time()
                status = job.status_goodput(status)
            if due and time.time() >= due[0]:
                due.pop(0)
                if fig.faults and not _restarted_since(job, fig.faults[-1].time):
                    fig.failed = (
                        f"job failed after fault {len(fig.faults)} (no step in the {a.fault_every:g} s since)"
                    )
                    break
                i = len(fig.faults)
                kind, victim = FAULT_KINDS[i % len(FAULT_KINDS)], victims[i % len(victims)]
                members = job.members() if cfg.standbys else None
                if members and victim not in members:
                    # a standby holds no rank: strike the member that took its turn instead
                    others = [n for n in members if n != "node0"] or members
                    victim = others[i % len(others)]
                fault = Fault(kind, victim, time.time())
                fig.faults.append(fault)
                fault.note = job.inject(kind, victim)
            time.sleep(0.1)
        if fig.failed is None:
            # let the lineage settle: a step after the window's end (a restore may be under way)
            settle = time.time() + a.stall_cap
            while time.time() < settle and (_last_step_time(job) or 0) < w1:
                time.sleep(0.2)
            if (_last_step_time(job) or 0) < w1:
                fig.failed = f"job failed after fault {len(fig.faults)} (no step after the window, {a.stall_cap:.0f} s)"
        fig.status = status
        import goodput_phases  # this folder is the script's: on sys.path

        fig.phases = goodput_phases.breakdown(job.phase_records(), [f.time for f in fig.faults], time.time())
        return analyse(fig, job.events(), w0, w1, rate)
    finally:
        job.close()


@dataclass
class StragglerFigures:
    """The straggler configuration's result (times in seconds)."""

    label: str
    victim: str = ""
    failed: str | None = None
    #: median step time before the slowdown (the job's fault-free one), while slowed, and after
    before: float | None = None
    slowed: float | None = None
    after: float | None = None
    #: from the slowdown to the standby a member, and to the re-formed group's first step
    replaced: float | None = None
    first_step: float | None = None
    restored: str = ""
    verdict: dict[str, Any] | None = None

    def text(self, step_time: float) -> str:
        ratio = None if self.after is None or not self.before else self.after / self.before
        lines = [
            f"  {self.label}: {self.failed or 'done'}; {self.victim} slowed to a third",
            f"    step time: fault-free (before) {_s(self.before)}, slowed {_s(self.slowed)}, after the "
            f"replacement {_s(self.after)} ({_s(None if ratio is None else 100 * (ratio - 1), '%', 1)} "
            f"vs fault-free; target within 10%)",
            f"    slowdown -> standby in its place {_s(self.replaced, ' s', 1)} (target <= 30 s); first step "
            f"of the re-formed group {_s(self.first_step, ' s', 1)} after the slowdown; {self.restored or '-'}",
            f"    verdict in the store: {json.dumps(self.verdict) if self.verdict else '-'}",
        ]
        return "\n".join(lines)


class Throttle:
    """Stops and continues the processes ``pids()`` names in a duty cycle (a third of the speed)."""

    def __init__(self, pids: Callable[[], list[int]], stopped: float = 0.2, running: float = 0.1) -> None:
        import threading

        self._pids, self._stopped, self._running = pids, stopped, running
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _signal(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _run(self) -> None:
        while not self._halt.is_set():
            pids = self._pids()
            self._signal(pids, signal.SIGSTOP)
            time.sleep(self._stopped)
            self._signal(pids, signal.SIGCONT)
            self._halt.wait(self._running)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=5)
        self._signal(self._pids(), signal.SIGCONT)


def step_seconds(steps: Sequence[tuple[float, int, float]], t0: float, t1: float) -> float | None:
    """Median seconds per step between rank 0's consecutive steps of one incarnation in [t0, t1] (pure)."""
    inside = sorted((t, s, b) for t, s, b in steps if t0 <= t <= t1)
    per = [
        (t2 - t1_) / (s2 - s1)
        for (t1_, s1, b1), (t2, s2, b2) in itertools.pairwise(inside)
        if b1 == b2 and s2 > s1
    ]
    return statistics.median(per) if per else None


def _await_window(job: Job, a: argparse.Namespace) -> float | None:
    """The first step after calibration (None: the job did not start in time)."""
    deadline = time.time() + a.start_cap
    while time.time() < deadline and job.alive():
        time.sleep(0.2)
        if job.calibration() is not None:
            first = next((e["t"] for e in job.events() if e["e"] == "step"), None)
            if first is not None:
                return first
    return None


def run_straggler(cfg: Config, a: argparse.Namespace, step_time: float, root: Path) -> StragglerFigures:
    """Run the job fault-free, throttle one member until the standby replaces it, run on; measure."""
    fig = StragglerFigures(cfg.label)
    job = Job(cfg, a, step_time, root)
    throttle: Throttle | None = None
    try:
        job.start_all(time.time() + a.start_cap)
        w0 = _await_window(job, a)
        if w0 is None:
            fig.failed = f"did not start within {a.start_cap:.0f} s"
            return fig
        time.sleep(a.straggler_before)
        members = job.members() or []
        fig.victim = next((n for n in members if n != "node0"), "node1")
        agent = job.nodes[fig.victim].proc.pid  # its agent keeps running: only its workers are slowed
        throttle = Throttle(lambda: [p for p in _tagged(str(job.dir), fig.victim) if p != agent])
        slowed = time.time()
        throttle.start()
        replaced = None
        while replaced is None and time.time() < slowed + a.straggler_cap and job.alive():
            now_members = job.members()
            if now_members and fig.victim not in now_members and len(now_members) == a.nodes:
                replaced = time.time()
            time.sleep(0.2)
        throttle.stop()
        if replaced is None:
            fig.failed = f"{fig.victim} was not replaced within {a.straggler_cap:.0f} s of the slowdown"
            replaced = time.time()
        else:
            fig.replaced = replaced - slowed
        time.sleep(a.straggler_after)
        events = job.events()
        steps = [(e["t"], e["step"], e["began"]) for e in events if e["e"] == "step"]
        fig.before = step_seconds(steps, w0, slowed)
        fig.slowed = step_seconds(steps, slowed + 5 * step_time, replaced)
        later = [t for t, _, b in steps if b > slowed]
        if later:
            fig.first_step = min(later) - slowed
            fig.after = step_seconds(steps, min(later), time.time())
        done = max((s for t, s, _ in steps if t < min(later, default=time.time())), default=0)
        restores = [e for e in events if e["e"] == "restored" and e["t"] > slowed]
        if restores:
            r = restores[0]
            fig.restored = (
                f"restored step {r['step']} from {r['source']} in {r['seconds']:.2f} s, "
                f"{max(0, done - r['step'])} step(s) redone"
            )
        try:
            from kelastic.agent.rendezvous import control

            verdict = control.read_straggler(job._store(), job.run_id)
            fig.verdict = dict(verdict) if verdict is not None else None
        except Exception:
            fig.verdict = None
        return fig
    finally:
        if throttle is not None:
            throttle.stop()
        job.close()


def baseline_rate(a: argparse.Namespace, step_time: float, root: Path) -> float | None:
    """Steps per second of the job with no checkpoint and no fault over ``--baseline-window``."""
    job = Job(BASELINE, a, step_time, root)
    try:
        job.start_all(time.time() + a.start_cap)
        deadline = time.time() + a.start_cap
        while time.time() < deadline and _last_step_time(job) is None:
            time.sleep(0.2)
        first = _last_step_time(job)
        if first is None:
            return None
        time.sleep(a.baseline_window)
        steps = [(e["t"], e["step"]) for e in job.events() if e["e"] == "step"]
        inside = [(t, s) for t, s in steps if t >= first]
        if len(inside) < 2:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
    finally:
        job.close()


def _tagged(job: str, node: str) -> list[int]:
    """Processes (other than this one) whose environment names this job's folder and node."""
    want = {f"BENCH_JOB={job}".encode(), f"BENCH_NODE={node}".encode()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue  # gone, or not ours to read
        if want <= env:
            found.append(int(entry.name))
    return found


# --- report --------------------------------------------------------------------------------------


def _s(v: float | None, unit: str = " s", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _status_parts(status: dict[str, Any] | None) -> str:
    if not status or "restarts" not in status:
        return "-"
    return f"{status['restarts']} / {status['restartSeconds']:.1f} / {status['redoneSteps']}"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def report(figs: list[Figures], a: argparse.Namespace, step_time: float, rate: float) -> None:
    rows: list[tuple[str, Callable[[Figures], str]]] = [
        ("checkpoint every K steps", lambda f: str(f.interval.steps) if f.interval else "-"),
        ("save cost (calibration)", lambda f: _s(f.save_cost, digits=3)),
        ("save stall / checkpoint (median)", lambda f: _s(_median(f.stalls), digits=4)),
        ("restore time (median)", lambda f: _s(_median(f.restores))
         + (f" ({sum(r is None for r in f.restores)} never)" if any(r is None for r in f.restores) else "")),
        ("bytes fetched per restore (all)", lambda f: _mib(_median(f.fetched)) if f.fetched else "-"),
        ("steps lost per fault", lambda f: f"{f.redone / len(f.faults):.1f}" if f.faults else "-"),
        ("lost seconds per fault", lambda f: _s(f.lost_per_fault, digits=1)),
        ("steps kept in the window", lambda f: str(f.kept)),
        ("goodput", lambda f: _s(None if f.goodput is None else 100 * f.goodput, "%", 1)),
        ("goodput in the job's status", lambda f: (f.status or {}).get("percent", "-")),
        ("  its restarts / restart s / redone", lambda f: _status_parts(f.status)),
        ("restores checked / done", lambda f: f"{f.checks[0]}/{f.checks[1]}"),
        ("outcome", lambda f: f.failed or f"ok, {len(f.faults)} faults"),
    ]  # fmt: skip
    width = max(24, *(len(f.label) + 2 for f in figs))
    print(f"\n{'':34s}" + "".join(f"{f.label:>{width}s}" for f in figs))
    for name, cell in rows:
        print(f"{name:34s}" + "".join(f"{cell(f):>{width}s}" for f in figs))
    print()
    for f in figs:
        if f.interval:
            print(f"  {f.label}: K = {f.interval.steps}: {f.interval.reason}")
        for i, fault in enumerate(f.faults):
            r = f.restores[i] if i < len(f.restores) else None
            print(f"    fault {i + 1}: {fault.kind} {fault.node}; first step after it {_s(r)}"
                  + (f"; {fault.note}" if fault.note else ""))  # fmt: skip
            for line in fault.restarts:
                print(f"      restored {line}")
        if f.phases:
            import goodput_phases

            print("    ms after each fault (first node: noticed, re-form, step; last node: the others):")
            for line in goodput_phases.table([fault.kind for fault in f.faults], f.phases):
                print(f"      {line}")
        if f.sources:
            print(f"    restored from: {', '.join(f'{k} x{v}' for k, v in sorted(f.sources.items()))}")
        st = f.status or {}
        if "ratio" in st:
            print(f"    job status: {st['percent']} = {st['keptSteps']} steps kept x {st['stepSeconds']:.3f} s / "
                  f"{st['elapsedSeconds']:.1f} s; restarts {st['restartSeconds']:.1f} s, {st['redoneSteps']} steps "
                  f"redone, save stalls {st['saveStallSeconds']:.1f} s")  # fmt: skip
    print()
    by = {f.label[:3]: f for f in figs}
    mem, disk = by.get("(c)"), by.get("(b)")
    at_target = step_time == 1.0 and a.fault_every == 120
    cond = "" if at_target else f" [this run: {step_time:g} s step, a fault every {a.fault_every:g} s]"
    if mem is not None:
        stalls = mem.stalls  # the window's saves all come after the calibration's
        med = _median(stalls)
        if med is not None and mem.copy_share:
            ok = med <= 1.5 * mem.copy_share
            print(f"target: memory save stall <= 1.5x a plain copy of the same tensors (from the 3rd save on): "
                  f"{med:.3f} s vs copy of this rank's share {mem.copy_share:.3f} s "
                  f"({med / mem.copy_share:.1f}x; whole state {mem.copy_full or 0:.3f} s): "
                  f"{'met' if ok else 'NOT met'}")  # fmt: skip
        if mem.goodput is not None:
            print(f"target: goodput of (c) >= 97% with a fault every 2 minutes on the 1 s step job: "
                  f"{100 * mem.goodput:.1f}%: {'met' if mem.goodput >= 0.97 else 'NOT met'}{cond}")  # fmt: skip
        if disk is not None and mem.lost_per_fault is not None and disk.lost_per_fault is not None:
            ratio = disk.lost_per_fault / mem.lost_per_fault if mem.lost_per_fault > 0 else math.inf
            print(f"target: lost seconds per fault of (c) >= 5x fewer than (b): {disk.lost_per_fault:.1f} s vs "
                  f"{mem.lost_per_fault:.1f} s ({ratio:.1f}x): {'met' if ratio >= 5 else 'NOT met'}{cond}")  # fmt: skip
    over = by.get("(d)")
    if over is not None:
        med = _median(over.stalls)
        if med is not None and over.copy_share:
            share = med / over.copy_share
            print(f"target: overlapping save stall <= 10% of a plain copy of the rank's share, saving every step: "
                  f"{med:.4f} s vs {over.copy_share:.3f} s ({100 * share:.1f}%): "
                  f"{'met' if share <= 0.10 else 'NOT met'}")  # fmt: skip
        if over.faults:
            redone = over.redone / len(over.faults)
            print(f"target: steps redone per fault <= 1 with overlapping saves every step: {redone:.1f}: "
                  f"{'met' if redone <= 1 else 'NOT met'}{cond}")  # fmt: skip
    spare = by.get("(s)")
    if spare is not None and spare.lost_per_fault is not None:
        print(f"target: lost seconds per fault with one standby <= 2 s: {spare.lost_per_fault:.1f} s "
              f"(without, (c): {_s(mem.lost_per_fault if mem else None, digits=1)}): "
              f"{'met' if spare.lost_per_fault <= 2.0 else 'NOT met'}{cond}")  # fmt: skip
    both = by.get("(e)")
    if both is not None:
        if both.lost_per_fault is not None:
            print(f"target: lost seconds per fault with overlapping saves and one standby <= 2 s: "
                  f"{both.lost_per_fault:.1f} s: {'met' if both.lost_per_fault <= 2.0 else 'NOT met'}{cond}")  # fmt: skip
        if both.goodput is not None:
            status = both.status.get("ratio") if both.status else None
            ok = both.goodput >= 0.99 and isinstance(status, float) and status >= 0.99
            print(f"target: goodput >= 99% with overlapping saves and one standby, in the bench and the job's "
                  f"status: {100 * both.goodput:.1f}% / "
                  f"{f'{100 * status:.1f}%' if isinstance(status, float) else '-'}: {'met' if ok else 'NOT met'}{cond}")  # fmt: skip
        if both.restores:
            worst = max((r for r in both.restores if r is not None), default=None)
            ok = worst is not None and None not in both.restores and worst <= step_time + 0.5
            print(f"target: the first step completes <= {step_time + 0.5:g} s after each fault (training resumes "
                  f"within 0.5 s): slowest {_s(worst)}: {'met' if ok else 'NOT met'}")  # fmt: skip
        if both.faults:
            redone = both.redone / len(both.faults)
            print(f"target: steps redone per fault <= 0.6 with overlapping saves and one standby: {redone:.1f}: "
                  f"{'met' if redone <= 0.6 else 'NOT met'}{cond}")  # fmt: skip
    for f in figs:
        if f.goodput is not None and f.status and isinstance(f.status.get("ratio"), float):
            gap = 100 * (f.status["ratio"] - f.goodput)
            print(f"goodput of {f.label[:3]}: the job's status says {f.status['percent']}, the bench "
                  f"{100 * f.goodput:.1f}% ({gap:+.1f} points; same definition, docs/operations.md)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    p.add_argument("--disk-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--mtbf", type=float, default=120.0, help=argparse.SUPPRESS)
    p.add_argument("--duration", type=float, default=3600.0, help=argparse.SUPPRESS)
    p.add_argument("--busy", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--restart-processes", action="store_true",
                   help="(e): train without kelastic.inprocess, every re-form restarting every worker process")  # fmt: skip
    p.add_argument("--no-spares", action="store_true",
                   help="(e): no spare worker process: a node whose worker crashed starts a new one")  # fmt: skip
    p.add_argument("--no-roll-forward", action="store_true",
                   help="(e): restore the checkpoint after every fault, not a survivor's live state")  # fmt: skip
    p.add_argument("--state-mib", type=int, default=512, help="model + optimizer state, MiB (default 512)")
    p.add_argument("--nodes", type=int, default=3, help="nodes of one rank each (default 3)")
    p.add_argument("--step-time", type=float, action="append",
                   help="seconds per step, sleep-padded; repeat for several (default: 1.0 and 0.1)")  # fmt: skip
    p.add_argument("--window", type=float, default=600.0, help="seconds of faults per configuration (600)")
    p.add_argument("--fault-every", type=float, default=120.0, help="seconds between faults, the MTBF (120)")
    p.add_argument("--baseline-window", type=float, default=0.0,
                   help="seconds of the fault-free run without checkpoints (default: min(window, 30))")  # fmt: skip
    p.add_argument("--calibrate", type=int, default=6, help="saves timed before the window (default 6)")
    p.add_argument(
        "--configs", default="abcdset", help="which configurations, of a, b, c, d, s, e, t (default abcdset)"
    )
    p.add_argument("--straggler-before", type=float, default=30.0,
                   help="(t): fault-free seconds before the slowdown (30)")  # fmt: skip
    p.add_argument("--straggler-after", type=float, default=30.0,
                   help="(t): seconds measured after the replacement (30)")  # fmt: skip
    p.add_argument("--straggler-cap", type=float, default=180.0,
                   help="(t): the most seconds waited for the replacement (180)")  # fmt: skip
    p.add_argument("--status-every", type=float, default=2.0,
                   help="seconds between reads of the store for the job-status goodput (the operator's 2)")  # fmt: skip
    p.add_argument("--checkpoint-memory", default="",
                   help="kelastic-agent --checkpoint-memory for (c) and (d) (default: 2Gi or 5x the state)")  # fmt: skip
    p.add_argument("--start-cap", type=float, default=240.0, help="deadline for a job's start, s (240)")
    p.add_argument("--stall-cap", type=float, default=90.0,
                   help="a job with no step for this long has failed, s (90)")  # fmt: skip
    a = p.parse_args()
    if a.worker:
        a.step_time = a.step_time[0]
        worker(a)
        return
    step_times = a.step_time or [1.0, 0.1]
    a.checkpoint_memory = a.checkpoint_memory or f"{max(2048, 5 * a.state_mib)}Mi"
    baseline_window = a.baseline_window or min(a.window, 30.0)
    a.baseline_window = baseline_window
    root = Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    configs = [c for c in CONFIGS if c.label[1] in a.configs]
    faults = int(a.window / a.fault_every)
    print(
        f"bench_goodput: {a.nodes} nodes x 1 rank (--nnodes {max(1, a.nodes - 1)}:{a.nodes}), gloo; state "
        f"{a.state_mib} MiB (weights + Adam moments, replicated); {faults} faults in {a.window:g} s, one every "
        f"{a.fault_every:g} s, cycling {', '.join(FAULT_KINDS)} (pod delete = SIGTERM to the agent, "
        f"SIGKILL after {GRACE_S:.0f} s, then a replacement agent of the same node name, as kubelet and "
        f"operator do; node kill = agent and workers SIGKILLed, then a replacement); {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; logs in {root}",
        flush=True,
    )
    started = time.monotonic()
    for step_time in step_times:
        print(f"\n=== step {step_time:g} s ===", flush=True)
        rate = baseline_rate(a, step_time, root)
        if rate is None:
            print("the fault-free run did not step: no figures for this step time", flush=True)
            continue
        print(
            f"fault-free: {rate:.3f} steps/s (the job without checkpoints, no fault, on kelastic-agent, "
            f"{baseline_window:g} s)",
            flush=True,
        )
        figs = []
        for cfg in configs:
            if cfg.busy:
                print(run_straggler(cfg, a, step_time, root).text(step_time), flush=True)
                continue
            fig = run_config(cfg, a, step_time, root, rate)
            figs.append(fig)
            print(
                f"  {cfg.label}: {fig.failed or 'done'}; goodput "
                f"{_s(None if fig.goodput is None else 100 * fig.goodput, '%', 1)} "
                f"(load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        if figs:
            report(figs, a, step_time, rate)
    print(f"\n(total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
