"""End-to-end latencies of kelastic on ``kelastic local``: how long until training runs again.

For each round, one ElasticJob (examples/train.py, min 2, max 4, 3 workers of
one process) is applied and three latencies are measured from the training
history that rank 0 writes (``first_step`` events, see examples/train.py):

* apply → first training step (pods created, agents rendezvous, gloo up);
* a worker pod force-deleted → first step of the re-formed group;
* ``kubectl scale --replicas 4`` → first step at world size 4.

After each round ``torchrun --standalone --nproc-per-node 3`` launches the same
script (launch → first step), so both meet the same load of the machine; the
ratio apply → first step / torchrun is printed per round and for the medians.

For apply → first step the bench also prints where the time goes, along the
critical path (each milestone is the latest of the three workers): ``kubectl
apply`` creating the job and the operator creating the pods (both seen by
``kubectl get --watch`` started before the apply), the kubelet starting each agent
(the agent's process start time from ``/proc``), the agent's start-up, its
``import torch``, its fork server having imported the rest of the preload (warm
start), the rendezvous, the workers' start, their gloo process group (rank 0's
``start`` record, after ``init_process_group`` and DDP's first broadcast) and the
first step. The agents' milestones are their own timestamped events
(``kelastic.agent.started``, ``.torch_imported``, ``.warm_ready``,
``.rendezvous``, ``.workers_started``), collected through
``$KELASTIC_EVENTS_FILE``. It adds the CPU seconds each part used meanwhile (from
``/proc``: pods, store, operator, control plane, the kubelet and API emulator in
this process) and torchrun's CPU to its first step: on a small machine the start
is CPU-bound, and these say by what. The operator is left to start and settle
before the first round.

Jobs run with the CRD's default ``spec.warmStart: true`` (workers forked from a
process that already imported torch); ``--no-warm-start`` sets it to false, so
every worker start is a fresh interpreter. ``--control-plane DIR`` measures the
same rounds a second time on the real control plane (``kelastic local
--control-plane``, the operator installed from the chart under its RBAC) and
prints both lanes side by side. Prints each round and the medians. No figure is
asserted.

    python bench/bench_e2e.py [--rounds 3] [--no-warm-start] [--control-plane DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import yaml

from kelastic.localcluster.testing import stop_process

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "default"
WORKERS = 3

#: The milestones of apply → first step, in order: (key, what it is). A phase is the time
#: between two consecutive milestones that were observed (without warm start there is no
#: fork server, say).
MILESTONES: tuple[tuple[str, str], ...] = (
    ("apply", "apply"),
    ("job", "job created"),
    ("created", "pods created"),
    ("process", "agent process"),
    ("main", "agent main"),
    ("torch", "torch imported"),
    ("warm", "fork server ready"),
    ("rendezvous", "rendezvous closed"),
    ("workers", "workers started"),
    ("gloo", "gloo group up"),
    ("first_step", "first step"),
)

STORE_CREATED = "(store pod created, after apply)"
#: CPU seconds spent between apply and the first step, by live processes (see Bench.round).
CPU_PODS = "CPU: worker pods (all processes)"
CPU_STORE = "CPU: store pod"
CPU_BENCH = "CPU: kubelet, proxy, API emulator"
CPU_OPERATOR = "CPU: operator"
CPU_CONTROL_PLANE = "CPU: etcd, kube-apiserver, ..."
CPU_TOTAL = "CPU: total"
CPU_TORCHRUN = "CPU: torchrun (agent, workers)"
CPU_LABELS = (CPU_PODS, CPU_STORE, CPU_BENCH, CPU_OPERATOR, CPU_CONTROL_PLANE, CPU_TOTAL, CPU_TORCHRUN)
#: The baseline: ``torchrun --standalone --nproc-per-node 3`` launching the same script.
TORCHRUN = "torchrun_launch_to_first_step"


class Watch:
    """When each object of ``resource`` matching ``selector`` (kubectl flags) was first seen:
    ``kubectl get --watch``, started (and its watch established) before the job is applied,
    so a first sighting is a creation."""

    def __init__(self, bench: Bench, resource: str, *selector: str, timeout: float = 60) -> None:
        self.seen: dict[str, float] = {}
        self._watching = threading.Event()
        self._proc = subprocess.Popen(
            [
                "kubectl",
                "--kubeconfig",
                str(bench.kubeconfig),
                "-n",
                NAMESPACE,
                "get",
                resource,
                "--watch",
                "-v=6",  # logs the watch request once the API server answered it
                *selector,
                "-o",
                "jsonpath={.metadata.name}{'\\n'}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read_names, daemon=True).start()
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._watching.wait(timeout):
            self.stop()
            raise TimeoutError(f"kubectl get {resource} --watch did not start watching within {timeout:.0f}s")

    def _read_names(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.strip():
                self.seen.setdefault(line.strip(), time.time())

    def _read_log(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            if "watch=true" in line:
                self._watching.set()

    def stop(self) -> None:
        stop_process(self._proc, 10)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file being appended to (a history, an agent's
    ``$KELASTIC_EVENTS_FILE``), oldest first, up to a line still being written; [] when none yet."""
    events = []
    for line in (path.read_text() if path.exists() else "").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return events


def milestones(
    applied: float,
    created: dict[str, float],
    agents: dict[str, list[dict[str, Any]]],
    history: list[dict[str, Any]],
) -> dict[str, float]:
    """The absolute times of apply → first step's milestones, each the latest of the workers
    (the critical path); a milestone that was not observed is left out."""
    first = next(e for e in history if e["event"] == "first_step" and e["world_size"] == WORKERS)
    until = float(first["time"])
    points = {"apply": applied, "first_step": until}
    if len(created) == WORKERS:
        points["created"] = max(created.values())
    gloo = [
        e["time"]
        for e in history
        if e["event"] == "start" and e["world_size"] == WORKERS and e["time"] <= until
    ]
    if gloo:
        points["gloo"] = gloo[-1]

    def latest(pick: Callable[[list[dict[str, Any]]], float | None]) -> float | None:
        times = [pick(events) for events in agents.values()]
        return (
            max(t for t in times if t is not None) if len(agents) == WORKERS and None not in times else None
        )

    def first_of(name: str, key: str = "timestamp") -> Callable[[list[dict[str, Any]]], float | None]:
        def pick(events: list[dict[str, Any]]) -> float | None:
            for e in events:
                if e["name"] == name:
                    value = e["timestamp"] if key == "timestamp" else e["metadata"].get(key)
                    return None if value is None else float(value)
            return None

        return pick

    def last_before(name: str) -> Callable[[list[dict[str, Any]]], float | None]:
        def pick(events: list[dict[str, Any]]) -> float | None:
            times = [float(e["timestamp"]) for e in events if e["name"] == name and e["timestamp"] <= until]
            return times[-1] if times else None

        return pick

    for key, pick in (
        ("process", first_of("kelastic.agent.started", "process_start")),
        ("main", first_of("kelastic.agent.started")),
        ("torch", first_of("kelastic.agent.torch_imported")),
        ("warm", first_of("kelastic.agent.warm_ready")),
        ("rendezvous", last_before("kelastic.agent.rendezvous")),
        ("workers", last_before("kelastic.agent.workers_started")),
    ):
        value = latest(pick)
        if value is not None:
            points[key] = value
    return points


def process_table() -> dict[int, tuple[int, str, float]]:
    """Every process: pid → (parent pid, command line, CPU seconds used so far), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat.rpartition(")")[2].split()  # the command name in (...) may hold spaces
        table[int(entry)] = (int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / tick)
    return table


def descendants(root: int, table: dict[int, tuple[int, str, float]]) -> list[int]:
    """The pids below ``root`` in ``table`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def children_cpu(
    before: dict[int, tuple[int, str, float]], after: dict[int, tuple[int, str, float]]
) -> dict[str, float]:
    """CPU seconds that the live processes below this one used between two tables, by kind:
    the worker pods, the store pod, the operator, the control plane's binaries."""
    cpu = {CPU_PODS: 0.0, CPU_STORE: 0.0, CPU_OPERATOR: 0.0}
    for pid in descendants(os.getpid(), after):
        _, cmd, seconds = after[pid]
        old = before.get(pid)
        used = seconds - (old[2] if old is not None and old[1] == cmd else 0.0)
        program = os.path.basename(cmd.split(" ", 1)[0])
        if program == "kubectl":
            continue  # the bench's own
        if program in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            cpu[CPU_CONTROL_PLANE] = cpu.get(CPU_CONTROL_PLANE, 0.0) + used
        elif "kelastic.operator" in cmd or "kelastic-operator" in cmd:
            cpu[CPU_OPERATOR] += used
        elif "kelastic-rendezvous" in cmd:
            cpu[CPU_STORE] += used
        else:
            cpu[CPU_PODS] += used
    return cpu


def breakdown(points: dict[str, float]) -> dict[str, float]:
    """Seconds per phase between consecutive observed :data:`MILESTONES`, by label; they add
    up to apply → first step (both ends are always observed)."""
    seen = [(key, name) for key, name in MILESTONES if key in points]
    return {f"{a_name} -> {b_name}": points[b] - points[a] for (a, a_name), (b, b_name) in pairwise(seen)}


class Bench:
    """A local cluster with the CRD and the operator, and the kubectl to drive it."""

    def __init__(self, kubeconfig: Path, checkpoints: Path, *, warm_start: bool = True) -> None:
        self.kubeconfig = kubeconfig
        self.checkpoints = checkpoints
        self.warm_start = warm_start

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        cmd = ["kubectl", "--kubeconfig", str(self.kubeconfig), "-n", NAMESPACE, *args]
        result = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[3:])}: {result.stderr.strip()}")
        return result.stdout

    def manifest(self, name: str) -> dict[str, Any]:
        example = (REPO / "examples" / "elasticjob.yaml").read_text()
        (doc,) = [d for d in yaml.safe_load_all(example) if d and d["kind"] == "ElasticJob"]
        doc["metadata"] = {"name": name, "namespace": NAMESPACE}
        doc["spec"]["warmStart"] = self.warm_start
        pod = doc["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]
        root = str(self.checkpoints)
        # Histories are read from a host directory: a hostPath replaces the example's claim.
        pod["volumes"][0] = {"name": "checkpoints", "hostPath": {"path": root, "type": "DirectoryOrCreate"}}
        pod["containers"][0]["volumeMounts"][0]["mountPath"] = root
        # The agents' timestamped events, for the breakdown (POD_NAME is the operator's downward env).
        pod["containers"][0].setdefault("env", []).append(
            {"name": "KELASTIC_EVENTS_FILE", "value": f"{root}/events/$(POD_NAME).jsonl"}
        )
        pod["containers"][0]["args"] = [
            "--steps=1000000",
            "--step-delay=0.05",
            "--checkpoint-every=10",
            f"--checkpoint-dir={root}/{{run_id}}",
            "--log-every=1000",
        ]
        return doc

    def history(self, uid: str) -> list[dict[str, Any]]:
        return json_lines(self.checkpoints / uid / "history.jsonl")

    def first_step(self, uid: str, since: float, world: int | None, what: str, timeout: float = 300) -> float:
        """Seconds from ``since`` to the first step completed after it (at ``world`` ranks, if given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.history(uid):
                if (
                    event["event"] == "first_step"
                    and event["time"] >= since
                    and world in (None, event["world_size"])
                ):
                    return float(event["time"]) - since
            time.sleep(0.05)
        raise TimeoutError(
            f"timed out after {timeout:.0f}s waiting for {what}; history: {self.history(uid)[-4:]}"
        )

    def wait(self, what: str, done: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.2)

    def round(self, index: int) -> tuple[dict[str, float], dict[str, float]]:
        """One job's latencies, and the breakdown of its apply → first step."""
        name = f"bench-{index}"
        watch = Watch(self, "pods", "-l", f"kelastic.dev/job-name={name}")
        job_watch = Watch(self, "elasticjobs", "--field-selector", f"metadata.name={name}")
        try:
            processes = process_table()
            bench_cpu = time.process_time()  # the emulator, kubelet and proxy run in this process
            started = time.time()
            self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(self.manifest(name)))
            uid = self.kubectl("get", "elasticjob", name, "-o", "jsonpath={.metadata.uid}").strip()
            figures = {
                "apply_to_first_step": self.first_step(uid, started, WORKERS, f"{name} to train at world 3")
            }
            # At once, while every pod process of the start is still alive.
            cpu = children_cpu(processes, process_table())
            cpu[CPU_BENCH] = time.process_time() - bench_cpu
        finally:
            watch.stop()
            job_watch.stop()
        workers = [f"{name}-worker-{i}" for i in range(WORKERS)]
        agents = {w: json_lines(self.checkpoints / "events" / f"{w}.jsonl") for w in workers}
        created = {w: watch.seen[w] for w in workers if w in watch.seen}
        points = milestones(started, created, agents, self.history(uid))
        if name in job_watch.seen:
            points["job"] = job_watch.seen[name]
        phases = breakdown(points)
        if f"{name}-rendezvous" in watch.seen:
            phases[STORE_CREATED] = watch.seen[f"{name}-rendezvous"] - started
        cpu[CPU_TOTAL] = sum(cpu.values())
        phases.update(cpu)

        killed = time.time()
        self.kubectl("delete", "pod", f"{name}-worker-1", "--grace-period=0", "--force")
        figures["pod_killed_to_first_step"] = self.first_step(
            uid, killed, None, f"{name} to train again after a kill"
        )
        # Let the replacement join, so the scale-up starts from a settled group of 3.
        self.first_step(uid, killed, 3, f"{name} to train at world 3 again")

        scaled = time.time()
        self.kubectl("scale", "elasticjob", name, "--replicas=4")
        figures["scale_up_to_first_step"] = self.first_step(uid, scaled, 4, f"{name} to train at world 4")

        self.kubectl("delete", "elasticjob", name, "--wait=false")
        self.wait(
            f"the pods of {name} to go",
            lambda: (
                not self.kubectl("get", "pods", "-l", f"kelastic.dev/job-name={name}", "-o", "name").strip()
            ),
        )
        return figures, phases


def torchrun_first_step(checkpoints: Path, timeout: float = 300) -> tuple[float, float]:
    """Baseline: seconds from launching ``torchrun --standalone`` with 3 ranks to their first
    step, and the CPU seconds its processes (agent and workers) used until then."""
    directory = checkpoints / f"torchrun-{time.time_ns()}"
    started = time.time()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=3",
            str(REPO / "examples" / "train.py"),
            "--steps=1000000",
            "--step-delay=0.05",
            f"--checkpoint-dir={directory}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=checkpoints,
    )
    try:
        deadline = time.monotonic() + timeout
        history = directory / "history.jsonl"
        while time.monotonic() < deadline:
            if history.exists() and '"first_step"' in history.read_text():
                first = next(json.loads(x) for x in history.read_text().splitlines() if '"first_step"' in x)
                table = process_table()
                cpu = sum(table[p][2] for p in [proc.pid, *descendants(proc.pid, table)] if p in table)
                return float(first["time"]) - started, cpu
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun exited with {proc.returncode} before its first step")
            time.sleep(0.05)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for torchrun's first step")
    finally:
        stop_process(proc, 30)  # torchrun passes SIGTERM on to its workers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="jobs to measure (default 3)")
    parser.add_argument(
        "--no-warm-start",
        action="store_true",
        help="run the jobs with spec.warmStart: false (a fresh interpreter per worker start)",
    )
    parser.add_argument(
        "--control-plane",
        type=Path,
        metavar="DIR",
        help="also measure on the real control plane whose binaries are in DIR (kube-apiserver, etcd, ...)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")

    lanes = {"emulator": measure_lane(None, args.rounds, not args.no_warm_start)}
    if args.control_plane is not None:
        lanes["control plane"] = measure_lane(args.control_plane, args.rounds, not args.no_warm_start)
    rows = lanes["emulator"]

    warm = "false" if args.no_warm_start else "true"
    print(
        f"\nkelastic local, examples/train.py, 3 workers (min 2, max 4), warmStart: {warm}, "
        f"{args.rounds} rounds, medians:"
    )
    print(f"  {'':30s} " + " ".join(f"{name:>14s}" for name in lanes))
    for key in rows[0]:
        print(
            f"  {key:30s} "
            + " ".join(
                f"{statistics.median(r[key] for r in lane_rows):12.2f} s" for lane_rows in lanes.values()
            )
        )
    for name, lane_rows in lanes.items():
        apply = statistics.median(r["apply_to_first_step"] for r in lane_rows)
        base = statistics.median(r[TORCHRUN] for r in lane_rows)
        each = ", ".join(f"{r['apply_to_first_step'] / r[TORCHRUN]:.2f}x" for r in lane_rows)
        print(f"  {name}: apply_to_first_step / torchrun: {apply / base:.2f}x (medians; each round: {each})")
    return 0


def measure_rounds(bench: Bench, rounds: int) -> list[dict[str, float]]:
    """The rounds of one lane, each followed by torchrun's baseline on the same script, so
    that both meet the same load of the machine."""
    rows: list[dict[str, float]] = []
    phases: list[dict[str, float]] = []
    for index in range(rounds):
        figures, parts = bench.round(index)
        figures[TORCHRUN], parts[CPU_TORCHRUN] = torchrun_first_step(bench.checkpoints)
        rows.append(figures)
        phases.append(parts)
        print(f"round {index}: " + "  ".join(f"{k} {v:.2f}s" for k, v in figures.items()), flush=True)
        print("  apply -> first step: " + ", ".join(f"{k} {v:.2f}s" for k, v in parts.items()), flush=True)
    print_breakdown(phases)
    return rows


def print_breakdown(phases: list[dict[str, float]]) -> None:
    """Medians of each phase of apply → first step over the rounds that observed it."""
    print(f"apply -> first step, where the time goes (medians of {len(phases)} rounds, latest worker):")
    labels = list(dict.fromkeys(label for p in phases for label in p if label not in CPU_LABELS))
    labels = [label for label in labels if label != STORE_CREATED] + [STORE_CREATED, *CPU_LABELS]
    for label in labels:
        values = [p[label] for p in phases if label in p]
        if values:
            print(f"  {label:38s} {statistics.median(values):6.2f} s")
        else:
            print(f"  {label:38s}      - (not observed)")


def settle(liveness: str | None, timeout: float = 120) -> None:
    """Wait until the operator (a process below this one) answers its liveness probe, when
    given, and then idles (under 5% of a core for a second), printing what it waits for. A
    running operator is what a job meets in a cluster: its own start-up (imports, first
    listings) must not fall into the first round."""
    print("waiting for the operator to start and settle", flush=True)
    deadline = time.monotonic() + timeout
    while liveness is not None:
        try:
            with urllib.request.urlopen(liveness, timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the operator did not answer {liveness} within {timeout:.0f}s")
        time.sleep(0.2)
    used = None
    while time.monotonic() < deadline:
        now = children_cpu({}, process_table())[CPU_OPERATOR]
        if used is not None and now - used < 0.05:
            return
        used = now
        time.sleep(1.0)
    raise TimeoutError(f"the operator kept using CPU for {timeout:.0f}s after it started")


def measure_lane(control_plane: Path | None, rounds: int, warm_start: bool) -> list[dict[str, float]]:
    """The rounds on one lane: the emulator with the operator as a process, or the real control
    plane with the operator installed from the chart (namespaced to the bench's namespace)."""
    from kelastic.localcluster.cli.cluster import LocalCluster

    lane = "emulator" if control_plane is None else f"control plane {control_plane}"
    print(f"-- lane: {lane}", flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="kelastic-bench-e2e-") as tmp,
        LocalCluster(
            Path(tmp) / "cluster", workdir=REPO, control_plane=control_plane, progress=print
        ) as cluster,
    ):
        bench = Bench(Path(cluster.kubeconfig), Path(tmp) / "checkpoints", warm_start=warm_start)
        bench.checkpoints.mkdir()
        if control_plane is not None:
            from kelastic.localcluster.cli.chart import install_chart

            install_chart(cluster.kubeconfig, REPO / "helm" / "kelastic", watch_namespaces=[NAMESPACE])
            settle(None)
            return measure_rounds(bench, rounds)
        bench.kubectl("apply", "-f", str(REPO / "crds" / "elasticjob.yaml"))
        log_path = Path(tmp) / "operator.log"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            liveness_port = s.getsockname()[1]
        with log_path.open("wb") as log:
            operator = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kelastic.operator",
                    f"--kubeconfig={cluster.kubeconfig}",
                    f"--namespace={NAMESPACE}",
                    "--standalone",
                    "--log-level=warning",
                    f"--liveness=http://127.0.0.1:{liveness_port}/healthz",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "POD_NAMESPACE": NAMESPACE},
            )
        try:
            settle(f"http://127.0.0.1:{liveness_port}/healthz")
            return measure_rounds(bench, rounds)
        except Exception:
            print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        finally:
            stop_process(operator, 30)


if __name__ == "__main__":
    sys.exit(main())
