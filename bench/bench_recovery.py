"""Recovery benchmark: kelastic-agent against torchrun on the same job, in one run.

Four agents with one rank each (``--nnodes 2:4``) run a worker (this file with
``--worker``) that does an all-reduce every 50 ms and timestamps every step.
For each launcher and each repetition:

1. cold start: agents started → every rank has done a step at world 4;
2. worker crash: one rank exits with an error (a bug, an exception) while the
   others wait in the all-reduce → every rank's *new* process has done a step
   (a crash restarts the whole group with either launcher, spending a restart);
3. recovery: SIGKILL of one whole node (agent and worker) → every survivor has
   done a step at world 3;
4. scale up: a fresh agent for the fourth node starts → every rank has done a
   step at world 4.

kelastic runs with ``--rdzv-backend kelastic`` against a ``kelastic-rendezvous``
store; torchrun is ``python -m torch.distributed.run --rdzv-backend c10d`` with
its default settings; its store lives in one of the agents, so the bench starts
node0 first, waits until its store answers, then starts the others and kills the
last one (losing the store's host would end a torchrun job outright). Both get ``--max-restarts 3`` (torchrun's default of 0 would end the
job at the first failed collective). Waits are capped (``--cap``); a phase that
did not finish within the cap is reported as ``> cap``; a capped cold start ends
the repetition; after a capped recovery, scale-up is measured on a fresh job of
three nodes that reached steady state (the fourth joins it).

Prints every measurement, the medians and the ratios torchrun/kelastic. Targets:
recovery < 3 s and >= 10x faster than torchrun; scale-up < 3 s.

kelastic runs twice: with its defaults (workers are fresh ``python`` processes,
like torchrun's) and with ``--warm-start`` (workers forked from a server that
already imported torch; see ``kelastic.agent.warm``).

    python bench/bench_recovery.py [--reps 2] [--warm-reps 2] [--torchrun-reps 1] [--cap 45]

``--gpu`` runs the same phases on GPUs with NCCL: one agent per GPU (up to four, at
least two; ``--nnodes`` from two below that to all of them, at least 1), each agent given
its own GPU in ``CUDA_VISIBLE_DEVICES`` as a pod is given it by the device plugin, the
worker's all-reduce on its GPU and waited for. The same NCCL timeout for both launchers
(120 s, as gloo's on CPU): a torchrun survivor stuck in a collective on a lost peer is
freed only by it (or by the cap). Without CUDA and two GPUs it says so and exits 2.

    python bench/bench_recovery.py --gpu [--reps 2] [--warm-reps 2] [--torchrun-reps 1]
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

NODES = 4
STEP_SLEEP = 0.05
#: The worker's collective timeout, either backend (see the module docstring).
COLLECTIVE_TIMEOUT_S = 120


# --- worker --------------------------------------------------------------------------------------


def worker(out: Path, duration: float, backend: str = "gloo") -> None:
    """Step forever (up to ``duration`` s): all-reduce, then log ``time world rank step``.
    With ``nccl`` the tensor lives on ``cuda:LOCAL_RANK`` and every step waits for the GPU."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = os.environ.get("BENCH_NODE", "?")
    (out / f"pid_{node}").write_text(str(os.getpid()))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    log = open(out / f"steps_{node}.log", "a", buffering=1)  # noqa: SIM115 - lives as long as the worker
    crash = out / f"crash_{node}"
    end = time.monotonic() + duration
    step = 0
    x = torch.ones(1, device=device)
    while time.monotonic() < end:
        if crash.exists():
            crash.unlink()
            os._exit(1)  # a failing rank: the others block in the all-reduce until it is gone
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step is done when the GPU is
        log.write(f"{time.time():.6f} {world} {rank} {step}\n")
        step += 1
        time.sleep(STEP_SLEEP)


# --- driver --------------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]


@dataclass
class Launcher:
    label: str
    command: Callable[[str, Path], list[str]]  # (node name, out dir) -> argv
    start_store: Callable[[], object] = lambda: None
    stop_store: Callable[[object], None] = lambda s: None
    # torchrun's c10d store lives in whichever agent binds the endpoint first; the bench
    # starts node0 alone until the store answers, so that the node it kills is not the host.
    host_endpoint: Callable[[], str] | None = None
    #: Variables of a node's own (its GPU in --gpu mode).
    node_env: Callable[[str], dict[str, str]] = lambda name: {}
    nodes: list[Node] = field(default_factory=list)


def _first_steps(out: Path, world: int, since: float, fresh: bool = False) -> dict[str, float]:
    """Per node: time of its first step at ``world`` after ``since`` (``fresh``: of a new process,
    i.e. its step 0)."""
    firsts: dict[str, float] = {}
    for path in out.glob("steps_*.log"):
        node = path.stem[len("steps_") :]
        for line in path.read_text().splitlines():
            parts = line.split()
            if (
                len(parts) == 4
                and int(parts[1]) == world
                and float(parts[0]) >= since
                and (not fresh or parts[3] == "0")
            ):
                firsts[node] = float(parts[0])
                break
    return firsts


def _wait_all_at(
    out: Path, world: int, nodes: set[str], since: float, cap: float, fresh: bool = False
) -> float | None:
    """Seconds from ``since`` until every node in ``nodes`` stepped at ``world``; None past ``cap``."""
    deadline = since + cap
    while time.time() < deadline:
        firsts = _first_steps(out, world, since, fresh)
        if nodes <= set(firsts):
            return max(firsts[n] for n in nodes) - since
        time.sleep(0.05)
    return None


def _start_node(launcher: Launcher, name: str, out: Path, logs: Path) -> Node:
    env = {
        **os.environ,
        "BENCH_NODE": name,
        "KELASTIC_NODE_NAME": name,
        "PYTHONUNBUFFERED": "1",
        **launcher.node_env(name),
    }
    env.pop("OMP_NUM_THREADS", None)
    with (logs / f"{launcher.label}_{name}.log").open("ab") as f:
        proc = subprocess.Popen(
            launcher.command(name, out), stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    node = Node(name, proc)
    launcher.nodes.append(node)
    return node


def _kill_node(node: Node, out: Path) -> None:
    """SIGKILL the agent's whole process group and its worker (wherever the launcher put it)."""
    try:
        os.killpg(node.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_file = out / f"pid_{node.name}"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    node.proc.wait(timeout=10)


def _kill_all(launcher: Launcher, out: Path) -> None:
    for node in launcher.nodes:
        if node.proc.poll() is None or (out / f"pid_{node.name}").exists():
            _kill_node(node, out)
    launcher.nodes.clear()


def _start_job(launcher: Launcher, names: list[str], out: Path, logs: Path, t0: float, cap: float) -> None:
    for i, n in enumerate(names):
        _start_node(launcher, n, out, logs)
        if i == 0 and launcher.host_endpoint is not None:
            _wait_listening(launcher.host_endpoint(), t0 + cap)


def run_once(launcher: Launcher, cap: float, logs: Path, nodes: int = NODES) -> dict[str, float | None]:
    """One repetition: cold start, worker crash, recovery, scale up (see the module docstring)."""
    out = Path(tempfile.mkdtemp(prefix=f"bench_{launcher.label}_"))
    store = launcher.start_store()
    names = [f"node{i}" for i in range(nodes)]
    result: dict[str, float | None] = {}
    try:
        t0 = time.time()
        _start_job(launcher, names, out, logs, t0, cap)
        result["cold start"] = _wait_all_at(out, nodes, set(names), t0, cap)
        if result["cold start"] is None:
            return result
        time.sleep(1.0)  # steady state
        t_crash = time.time()
        (out / f"crash_{names[1]}").touch()
        result["worker crash"] = _wait_all_at(out, nodes, set(names), t_crash, cap, fresh=True)
        if result["worker crash"] is None:
            return result
        time.sleep(1.0)
        victim = launcher.nodes[-1]
        t_kill = time.time()
        _kill_node(victim, out)
        (out / f"pid_{victim.name}").unlink(missing_ok=True)
        result["recovery"] = _wait_all_at(out, nodes - 1, set(names[:-1]), t_kill, cap)
        if result["recovery"] is None:
            # The job did not recover: measure scale-up on a fresh, healthy job of 3 nodes.
            _kill_all(launcher, out)
            launcher.stop_store(store)
            store = launcher.start_store()
            t3 = time.time()
            _start_job(launcher, names[:-1], out, logs, t3, cap)
            # set-up, not a measurement: allow torchrun's 30 s last call plus start-up
            if _wait_all_at(out, nodes - 1, set(names[:-1]), t3, 2 * cap) is None:
                return result
        time.sleep(1.0)
        t_join = time.time()
        _start_node(launcher, victim.name, out, logs)
        result["scale up"] = _wait_all_at(out, nodes, set(names), t_join, cap)
        return result
    finally:
        _kill_all(launcher, out)
        launcher.stop_store(store)


def _wait_listening(endpoint: str, deadline: float) -> None:
    host, port = endpoint.rsplit(":", 1)
    while time.time() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Setup:
    """What every launcher runs: how many agents, the rendezvous range, CPU or GPUs."""

    nodes: int = NODES
    min_nodes: int = 2
    gpu: bool = False

    def worker_args(self, out: Path, duration: float) -> list[str]:
        backend = ["--backend", "nccl"] if self.gpu else []
        return [__file__, "--worker", "--out", str(out), "--duration", str(duration), *backend]

    def node_env(self, name: str) -> dict[str, str]:
        """node<i> gets GPU i (numbered as nvidia-smi numbers them); nothing on CPU."""
        if not self.gpu:
            return {}
        return {"CUDA_VISIBLE_DEVICES": name.removeprefix("node"), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def gpu_setup() -> Setup | str:
    """The --gpu set-up for this machine, or why there is none."""
    from kelastic.agent.devices import cuda_device_count

    found = cuda_device_count()
    if found < 2:
        return f"bench_recovery --gpu needs CUDA and at least 2 GPUs (found {found}): run it on a GPU machine"
    nodes = min(found, NODES)
    return Setup(nodes=nodes, min_nodes=max(1, nodes - 2), gpu=True)


def kelastic_launcher(duration: float, logdir: Path, warm: bool, setup: Setup = Setup()) -> Launcher:
    from kelastic.agent.rendezvous.server import start_server_process

    state: dict[str, str] = {}

    def start_store() -> object:
        host = f"127.{os.getpid() % 200 + 50}.{int(time.time() * 1000) % 250 + 1}.9"
        server = start_server_process(host, 29400, timeout=30)
        state["endpoint"] = server.endpoint
        state["id"] = f"bench-{time.time_ns()}"
        return server

    secret = logdir / "job-secret"  # the job's agents share it
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text(secrets.token_hex(32))

    def command(name: str, out: Path) -> list[str]:
        return [
            sys.executable, "-m", "kelastic.agent", "--nnodes", f"{setup.min_nodes}:{setup.nodes}",
            "--nproc-per-node", "1", "--job-secret-file", str(secret),
            "--rdzv-backend", "kelastic", "--rdzv-endpoint", state["endpoint"], "--rdzv-id", state["id"],
            "--max-restarts", "3", "--local-addr", "127.0.0.1", "--log-dir", str(logdir / state["id"] / name),
            *(["--warm-start"] if warm else []), *setup.worker_args(out, duration),
        ]  # fmt: skip

    label = "kelastic-warm" if warm else "kelastic"

    def stop(server: object) -> None:
        server.stop()  # type: ignore[attr-defined]

    return Launcher(label, command, start_store, stop, node_env=setup.node_env)


def torchrun_launcher(duration: float, setup: Setup = Setup()) -> Launcher:
    state: dict[str, str] = {}

    def start_store() -> object:
        state["endpoint"] = f"127.0.0.1:{_free_port()}"
        state["id"] = f"bench-{time.time_ns()}"
        return None

    def command(name: str, out: Path) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", f"{setup.min_nodes}:{setup.nodes}",
            "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", state["endpoint"], "--rdzv-id", state["id"],
            "--max-restarts", "3",
            *setup.worker_args(out, duration),
        ]  # fmt: skip

    return Launcher(
        "torchrun", command, start_store, host_endpoint=lambda: state["endpoint"], node_env=setup.node_env
    )


def _fmt(v: float | None, cap: float) -> str:
    return f"> {cap:.0f} s" if v is None else f"{v:.2f} s"


PHASES = ("cold start", "worker crash", "recovery", "scale up")


def _median(values: list[float | None], cap: float) -> tuple[float, bool]:
    """Median with capped runs counted as ``cap``; the flag says a capped run was included."""
    vals = [cap if v is None else v for v in values]
    return statistics.median(vals), any(v is None for v in values)


def _device_line(setup: Setup) -> str:
    """The card the figures were taken on (a subprocess asks: this process never initialises CUDA)."""
    if not setup.gpu:
        return "gloo on CPU"
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
        cards = sorted(
            {
                line.split(":", 1)[1].split("(UUID")[0].strip()
                for line in listed.stdout.splitlines()
                if ":" in line
            }
        )
    except (OSError, subprocess.TimeoutExpired):
        cards = []
    return f"NCCL on {setup.nodes} GPUs ({', '.join(cards) or 'card unknown'})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--duration", type=float, default=600.0, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    p.add_argument(
        "--gpu", action="store_true", help="on GPUs with NCCL, one agent per GPU (needs CUDA and 2 GPUs)"
    )
    p.add_argument("--reps", type=int, default=2, help="repetitions with kelastic (default 2)")
    p.add_argument(
        "--warm-reps", type=int, default=2, help="repetitions with kelastic --warm-start (default 2)"
    )
    p.add_argument(
        "--torchrun-reps", type=int, default=1, help="repetitions with torchrun (default 1: it is slow)"
    )
    p.add_argument("--cap", type=float, default=45.0, help="cap on each wait, seconds (default 45)")
    a = p.parse_args()
    if a.worker:
        worker(a.out, a.duration, a.backend)
        return
    setup: Setup = Setup()
    if a.gpu:
        found = gpu_setup()
        if isinstance(found, str):
            print(found, file=sys.stderr, flush=True)
            sys.exit(2)
        setup = found

    logs = Path(tempfile.mkdtemp(prefix="bench_recovery_logs_"))
    print(
        f"bench_recovery: {setup.nodes} agents x 1 rank, --nnodes {setup.min_nodes}:{setup.nodes}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {_device_line(setup)}; "
        f"agent logs in {logs}",
        flush=True,
    )
    started = time.monotonic()
    labels = ("kelastic", "kelastic-warm", "torchrun")
    results: dict[str, list[dict[str, float | None]]] = {label: [] for label in labels}
    makers: dict[str, Callable[[], Launcher]] = {
        "kelastic": lambda: kelastic_launcher(a.duration, logs, warm=False, setup=setup),
        "kelastic-warm": lambda: kelastic_launcher(a.duration, logs, warm=True, setup=setup),
        "torchrun": lambda: torchrun_launcher(a.duration, setup),
    }
    # Interleaved (round-robin) so that a change of machine load affects every launcher alike.
    wanted = dict(zip(labels, (a.reps, a.warm_reps, a.torchrun_reps), strict=True))
    for i in range(max(wanted.values(), default=0)):
        for label in labels:
            if i >= wanted[label]:
                continue
            r = run_once(makers[label](), a.cap, logs, setup.nodes)
            results[label].append(r)
            print(
                f"  {label:13s} rep {i + 1}: "
                + ", ".join(f"{k} {_fmt(r[k], a.cap) if k in r else 'not reached'}" for k in PHASES)
                + f"  (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    print()
    header = f"{'phase':12s}" + "".join(f"{label:>15s}" for label in labels)
    print(header + f"{'torchrun/kelastic':>20s}{'torchrun/warm':>16s}")
    for phase in PHASES:
        cells, meds = [], {}
        for label in labels:
            values = [r[phase] for r in results[label] if phase in r]
            if not values:
                cells.append(f"{'-':>15s}")
                continue
            med, capped = _median(values, a.cap)
            meds[label] = (med, capped)
            cells.append(f"{('>' if capped and med >= a.cap else '') + f'{med:.2f} s':>15s}")
        ratios = []
        for mine in ("kelastic", "kelastic-warm"):
            ratio = "-"
            if mine in meds and "torchrun" in meds and meds[mine][0] > 0:
                t = meds["torchrun"]
                ratio = f"{'>' if t[1] else ''}{t[0] / meds[mine][0]:.1f}x"
            ratios.append(ratio)
        print(f"{phase:12s}" + "".join(cells) + f"{ratios[0]:>20s}{ratios[1]:>16s}")
    print(
        f"\n(medians; a capped run counts as {a.cap:.0f} s and is marked '>'; total {time.monotonic() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()
